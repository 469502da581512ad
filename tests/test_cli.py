"""The LightningCLI entry point: YAML config, overrides, --print_config round trip, documented fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

CONFIG = Path(__file__).parent.parent / "examples" / "configs" / "tiny_cpu.yaml"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_megatron", *args], cwd=cwd, env=child_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.multiprocess
def test_fit_with_config_at_tp2(tmp_path: Path) -> None:
    proc = _cli("fit", "--config", str(CONFIG), "--trainer.max_steps", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in proc.stdout + proc.stderr


def test_print_config_round_trip_and_override(tmp_path: Path) -> None:
    printed = _cli("fit", "--config", str(CONFIG), "--trainer.strategy.tp", "1", "--trainer.devices", "1",
                   "--print_config", cwd=tmp_path)  # fmt: skip
    assert printed.returncode == 0, printed.stderr[-4000:]
    assert "tp: 1" in printed.stdout
    assert "num_query_groups: null" in printed.stdout  # the complete ModelConfig is in the YAML
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed.stdout)
    proc = _cli("fit", "--config", str(saved), "--trainer.max_steps", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_help_documents_model_fields(tmp_path: Path) -> None:
    proc = _cli("fit", "--model.help", "MegatronLMModule", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Key/value heads for grouped-query attention" in proc.stdout  # ModelConfig.num_query_groups docstring
