"""The LightningCLI entry point: YAML config, overrides, --print_config round trip, documented fields."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_megatron import CheckpointConfig, MegatronStrategy
from lightning_megatron.cli import build_cli, main
from tests.checkpoint_settings import SETTINGS
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


def _strategy_yaml(tmp_path: Path, **init_args: object) -> Path:
    """A second config over CONFIG: one process, the strategy's ``init_args`` merged over CONFIG's."""
    strategy = {"class_path": "lightning_megatron.MegatronStrategy", "init_args": {"tp": 1, **init_args}}
    path = tmp_path / "strategy.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"devices": 1, "strategy": strategy}}))
    return path


def test_a_yaml_sets_every_checkpoint_setting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = _strategy_yaml(tmp_path, checkpoint=SETTINGS)  # every field, none at its default
    with contextlib.chdir(tmp_path):
        cli = build_cli(["--config", str(CONFIG), "--config", str(config)], run=False)
    assert cli.trainer.strategy.checkpoint_writer.config == CheckpointConfig(**SETTINGS)
    assert cli.trainer.strategy.micro_batch_size == 4  # CONFIG's other init_args stay
    printed = _cli_here("fit", "--config", str(CONFIG), "--config", str(config), "--print_config", capsys=capsys)
    assert yaml.safe_load(printed)["trainer"]["strategy"]["init_args"]["checkpoint"] == SETTINGS
    strategy_help = ("--trainer.strategy.help", "MegatronStrategy")
    field_help = ("--trainer.strategy.checkpoint.help", "CheckpointConfig")
    documented = _cli_here("fit", *strategy_help, *field_help, capsys=capsys)
    assert "--trainer.strategy.checkpoint.read_threads" in documented
    assert "Threads each rank reads" in documented  # CheckpointConfig.read_threads's docstring


@pytest.mark.parametrize(
    ("init_args", "error"),
    [
        ({"checkpoint": {"read_threads": 0}}, "CheckpointConfig(read_threads=0): give a positive int"),
        ({"checkpoint": {"keep_host_buffers": "maybe"}}, "keep_host_buffers"),  # jsonargparse's own type check
        ({"async_save": True, "checkpoint": {"async_save": False}}, "(async_save=True, checkpoint=CheckpointConfig("),
    ],
    ids=["read_threads", "not_a_bool", "async_save_twice"],
)
def test_a_bad_checkpoint_setting_in_a_yaml_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, init_args: dict, error: str
) -> None:
    config = _strategy_yaml(tmp_path, **init_args)
    with pytest.raises((SystemExit, ValueError)) as failure, contextlib.chdir(tmp_path):
        build_cli(["--config", str(CONFIG), "--config", str(config)], run=False)
    # A value of the wrong type fails the parse (an exit, the error on stderr); a check when the settings are made
    # raises from jsonargparse's instantiation, the check's message in it.
    assert error in f"{failure.value}{capsys.readouterr().err}"
