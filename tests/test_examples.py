"""The shipped examples run and learn: the TP=2 MLP (base-class contract) and the main LM job."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import child_env

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Both examples, started side by side (each a 2-process launch whose ranks also wait on each other)."""
    commands = {
        "tp_mlp": [str(EXAMPLES / "tp_mlp.py"), "--devices", "2", "--tp", "2", "--max-steps", "30"],
        "train_lm": [str(EXAMPLES / "train_lm.py"), "--max-steps", "30", "--devices", "2", "--tp", "2"],
    }
    env = child_env(CUDA_VISIBLE_DEVICES="")
    procs, logs = {}, {}
    for name, args in commands.items():
        cwd = tmp_path_factory.mktemp(name)
        logs[name] = (cwd / "stdout.txt", cwd / "stderr.txt")
        with logs[name][0].open("w") as out, logs[name][1].open("w") as err:  # files: no pipe to fill up
            # A session of its own, so that whatever the launch leaves (Lightning's rank 1) can be killed with it.
            procs[name] = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=out, stderr=err,
                                           start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {
        name: subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())
        for (name, proc), (out, err) in zip(procs.items(), logs.values(), strict=True)
    }


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
    assert console.count("lightning_megatron: kernels: local") == 1, console[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]
