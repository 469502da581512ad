"""examples/notebook.ipynb runs top to bottom in a fresh kernel of this environment (one device, in-process): it
trains, validates, plots the loss curve and asserts that the loss fell and val_ppl = exp(val_loss)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.conftest import child_env

NOTEBOOK = Path(__file__).parent.parent / "examples" / "notebook.ipynb"


def test_notebook_trains_validates_and_plots(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel "python3" is ipykernel's, i.e. this interpreter; a failing cell raises CellExecutionError.
    run_in = {"metadata": {"path": str(tmp_path)}}  # the kernel's working directory: the CSV logs go there
    # child_env: not the MASTER_PORT & co. that an earlier in-process Trainer of this pytest process left behind.
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources=run_in).execute(env=child_env())
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs)  # the loss curve
    printed = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
    assert "`Trainer.fit` stopped: `max_steps=40` reached." in printed
    assert "val_ppl" in printed
    assert (tmp_path / "notebook_logs" / "lightning_logs" / "version_0" / "metrics.csv").is_file()
