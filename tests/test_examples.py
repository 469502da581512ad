"""The shipped examples run and learn: the TP=2 MLP (base-class contract) and the main LM job."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env, run_together

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Both examples, started side by side (each a 2-process launch whose ranks also wait on each other)."""
    commands = {
        "tp_mlp": [str(EXAMPLES / "tp_mlp.py"), "--devices", "2", "--tp", "2", "--max-steps", "30"],
        "train_lm": [str(EXAMPLES / "train_lm.py"), "--max-steps", "30", "--devices", "2", "--tp", "2"],
    }
    env = child_env(CUDA_VISIBLE_DEVICES="")
    launches = [([sys.executable, *args], env, tmp_path_factory.mktemp(name)) for name, args in commands.items()]
    return dict(zip(commands, run_together(launches), strict=True))


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.multiprocess
def test_tp_mlp_trains_at_tp2(runs: dict[str, subprocess.CompletedProcess]) -> None:
    out = _ok(runs["tp_mlp"]).stdout
    first, last = map(float, re.search(r"mse: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert last < first / 5, out


@pytest.mark.multiprocess
def test_main_job_loss_falls(runs: dict[str, subprocess.CompletedProcess]) -> None:
    proc = _ok(runs["train_lm"])
    out = proc.stdout
    losses = [float(x) for x in re.findall(r"train_loss ([\d.]+)", out)]
    assert len(losses) == 3, out
    assert losses[-1] < losses[0] - 0.5, out
    # A quiet console: megatron-core's and torch's notices of the torch-native path are not printed (once per
    # rank, ~60 lines); one line names the kernel set instead.
    console = proc.stdout + proc.stderr
    for noise in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "GPTModel IS DEPRECATED",
        "MimoModelConfig is experimental",
        "is deprecated. Please use",
        "CUDA_DEVICE_MAX_CONNECTIONS",
    ):
        assert noise not in console, console[-4000:]
    assert console.count("lightning_megatron: kernels: torch") == 1, console[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]
