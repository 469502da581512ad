"""The LightningCLI entry point: YAML config, overrides, --print_config round trip, documented fields."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_megatron import MegatronStrategy
from lightning_megatron.cli import build_cli, main
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


def _cli_here(*args: str, capsys: pytest.CaptureFixture) -> str:
    """The CLI in this process (its stdout), for the commands that exit instead of training: no ~15 s interpreter
    start. ``test_fit_with_config_at_tp2`` runs the installed entry point."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_print_config_round_trip_and_override(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    printed = _cli_here("fit", "--config", str(CONFIG), "--trainer.strategy.tp", "1", "--trainer.devices", "1",
                        "--print_config", capsys=capsys)  # fmt: skip
    assert "tp: 1" in printed
    assert "num_query_groups: null" in printed  # the complete ModelConfig is in the YAML
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    with contextlib.chdir(tmp_path):
        cli = build_cli(["fit", "--config", str(saved), "--trainer.max_steps", "2"])
    assert cli.trainer.global_step == 2
    assert isinstance(cli.trainer.strategy, MegatronStrategy)
    assert cli.trainer.strategy.parallel.tp == 1


def test_help_documents_model_fields(capsys: pytest.CaptureFixture) -> None:
    out = _cli_here("fit", "--model.help", "MegatronLMModule", capsys=capsys)
    assert "Key/value heads for grouped-query attention" in out  # ModelConfig.num_query_groups docstring
