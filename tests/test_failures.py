"""Failures of a real 2-process TP=2 CPU job: a rank killed mid-training (then resumed), a rank that goes silent,
SIGTERM to the whole job (then resumed from its final checkpoint) or to one rank.

All run ``tests/reliability_worker.py``, its ranks forked from the session's fork server (tests/conftest.py:
start_forked), which has imported torch, Lightning and Megatron once for every multi-process test: each job is real
processes joined over gloo, without ~7 s of imports per rank. (Lightning's own launcher, rank 1 a child of rank 0,
is exercised by the DP=2 layout test, the two-"node" test, the examples and the CLI fit.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import child_env, start_forked


def _losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def _job(args: dict, cwd: Path, timeout: float, peers: float = 30) -> tuple[list[int | None], float, list[str]]:
    """Run the worker's ``args.get("devices", 2)`` ranks, in a process group of their own (``own_group``); wait up to
    ``timeout`` s for rank 0 to exit, then up to ``peers`` s for the others, and kill whatever is left of the group
    (no process of the job outlives the test: a killed rank's checkpoint writer or result-queue manager). Returns each
    rank's exit code (``None``: still running, killed), when rank 0 exited (``time.time()``), and each rank's log
    (its stdout and stderr)."""
    world, group = args.get("devices", 2), cwd / f"group-{os.urandom(4).hex()}"
    args = {**args, "own_group": str(group)}
    ranks, logs = start_forked("reliability_worker:main", args, world, cwd, child_env(CUDA_VISIBLE_DEVICES=""))
    try:
        ranks[0].join(timeout)
        exited = time.time()
        deadline = time.monotonic() + peers
        for rank in ranks[1:]:
            rank.join(max(0.0, deadline - time.monotonic()))
        codes = [rank.exitcode for rank in ranks]
    finally:
        if group.exists() and int(group.read_text()) != os.getpgid(0):  # never this process's own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(group.read_text()), signal.SIGKILL)
        for rank in ranks:
            if rank.is_alive():
                rank.kill()
            rank.join()
    return codes, exited, [log.read_text() if log.exists() else "" for log in logs]


def _tail(logs: list[str]) -> str:
    return "\n".join(f"--- rank {rank}:\n{log[-3000:]}" for rank, log in enumerate(logs))


@pytest.mark.multiprocess
def test_sigkill_one_rank_then_resume_last_reproduces_the_curve(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # Async checkpoints at steps 3 and 6 (+ last.ckpt); rank 1 SIGKILLs itself before step 7, while last.ckpt of
    # step 6 is still being written in the background (it is only published at the next poll, which never comes).
    killed = {
        "max_steps": 9, "ckpt_dir": str(ckpt), "ckpt_every": 3, "losses": str(tmp_path / "killed.jsonl"),
        "kill_at": 6, "stamp": str(tmp_path / "killed_at"), "async_save": True, "timeout": 600,
    }  # fmt: skip
    codes, exited, logs = _job(killed, tmp_path, timeout=300)
    kill_to_exit = exited - float((tmp_path / "killed_at").read_text())
    print(f"kill -> job exit: {kill_to_exit:.2f} s (exit codes {codes})")
    assert codes[1] == -9, _tail(logs)  # SIGKILLed
    assert codes[0] not in (0, None), _tail(logs)  # rank 0 failed, and did not hang
    assert kill_to_exit < 30, kill_to_exit  # the survivor fails fast on the closed connection, no 600 s timeout

    names = sorted(p.name for p in ckpt.iterdir())
    # The interrupted save stays unpublished; the previous last.ckpt (step 3) and the step-6 checkpoint are whole.
    # (last.ckpt.lock, the lock file of that save, is gone if rank 0 released it in its teardown; a stale one is
    # taken over by the next save, below.)
    assert [n for n in names if n != "last.ckpt.lock"] == ["epoch=0-step=6.ckpt", "last.ckpt", "last.ckpt.partial"]
    assert (ckpt / "last.ckpt" / "metadata.json").is_file()

    curve = _losses(tmp_path / "killed.jsonl")
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    # Resumed with synchronous saves (no writer processes to start: the slower part of this short run); the resume
    # and the lock and .partial left over are the same for both kinds of save.
    resumed = {**killed, "max_steps": 6, "resume": "last", "losses": str(tmp_path / "resumed.jsonl")}
    resumed["async_save"] = False
    del resumed["kill_at"]
    codes, _, logs = _job(resumed, tmp_path, timeout=300)  # TP=2 again, the same processes' layout
    assert codes == [0, 0], _tail(logs)
    again = _losses(tmp_path / "resumed.jsonl")
    assert sorted(again) == [4, 5, 6]  # resumed from last.ckpt = step 3, not from the half-written step-6 one
    assert again == {step: curve[step] for step in (4, 5, 6)}  # exactly the uninterrupted curve
    assert not (ckpt / "last.ckpt.partial").exists()  # the next save of last.ckpt replaced the leftover
    assert not (ckpt / "last.ckpt.lock").exists()  # and took the stale lock


@pytest.mark.multiprocess
def test_silent_rank_makes_the_other_fail_within_the_strategy_timeout(tmp_path: Path) -> None:
    # Both ranks start at once (so a short timeout also fits the rendezvous); rank 1 stops answering before step 3,
    # rank 0 must fail on its next collective after ~timeout seconds.
    timeout = 8
    args = {
        "max_steps": 4, "losses": str(tmp_path / "losses.jsonl"), "hang_at": 2, "hang_for": 120,
        "stamp": str(tmp_path / "hung_at"), "timeout": timeout,
    }  # fmt: skip
    codes, exited, logs = _job(args, tmp_path, timeout=300, peers=0)  # rank 1, still asleep, is killed
    waited = exited - float((tmp_path / "hung_at").read_text())
    print(f"silent rank -> error after {waited:.2f} s (timeout {timeout} s)")
    assert codes[0] not in (0, None), _tail(logs)
    assert "Timed out" in logs[0], _tail(logs)
    # Megatron's groups got the sub-minute timeout (it used to be rounded up to a whole minute).
    assert timeout <= waited < timeout + 15, waited
    assert sorted(_losses(tmp_path / "losses.jsonl")) == [1, 2]


@pytest.mark.multiprocess
def test_sigterm_to_the_job_stops_every_rank_at_one_step_with_a_final_checkpoint(tmp_path: Path) -> None:
    # Two batches an optimizer step (accumulate_grad_batches=2); async checkpoints at step 3 (+ last.ckpt), an
    # OnExceptionCheckpoint. Inside the window of step 5 -- its first batch trained, its gradients waiting in the
    # buffers -- rank 1 sends SIGTERM to the whole job's process group (both ranks and their checkpoint writer
    # processes: a group of their own, see _job), as a scheduler does: the window's step completes first, then
    # every rank stops.
    ckpt, exits, final = tmp_path / "ckpt", tmp_path / "exits", tmp_path / "final"
    exits.mkdir()
    job = {
        "max_steps": 9, "ckpt_dir": str(ckpt), "ckpt_every": 3, "losses": str(tmp_path / "job.jsonl"), "term_at": 4,
        "term_at_batch": 2, "accumulate": 2, "term": "group", "stamp": str(tmp_path / "term_at"), "async_save": True,
        "timeout": 600, "on_exception_dir": str(final), "exits": str(exits),
    }  # fmt: skip
    codes, exited, logs = _job(job, tmp_path, timeout=120)
    term_to_exit = exited - float((tmp_path / "term_at").read_text())
    print(f"SIGTERM -> job exit: {term_to_exit:.2f} s (exit codes {codes})")
    assert codes == [143, 143], _tail(logs)
    assert term_to_exit < 60, term_to_exit
    assert {p.name: p.read_text() for p in exits.iterdir()} == {"rank0": "143", "rank1": "143"}, _tail(logs)
    # Rank 0 may have entered the step's agreement before the signal reached it: 1 or 2 ranks counted it.
    stopped = r"SIGTERM received by [12] of 2 rank\(s\): every rank stopped at global step 5"
    assert re.search(stopped, logs[0]), _tail(logs)
    assert sorted(_losses(tmp_path / "job.jsonl")) == [1, 2, 3, 4, 5]
    # The periodic checkpoints are published (the step-3 save was finished, not abandoned), and so is the final one.
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert sorted(p.name for p in final.iterdir()) == ["on_exception.ckpt"]

    # Both resume, side by side at TP=2, and agree exactly: the final checkpoint holds step 5's state, the batch
    # position after its window. (Stopped at the window's first batch, the run would resume at its second, the first
    # one's gradients lost: step 6 would differ.)
    common = {"max_steps": 7, "timeout": 600, "accumulate": 2}
    from_last = {**common, "resume": str(ckpt / "last.ckpt"), "losses": str(tmp_path / "from_last.jsonl")}
    from_final = {**common, "resume": str(final / "on_exception.ckpt"), "losses": str(tmp_path / "from_final.jsonl")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for codes, _, logs in pool.map(lambda args: _job(args, tmp_path, timeout=300), [from_last, from_final]):
            assert codes == [0, 0], _tail(logs)
    job_curve, curve, after_final = (_losses(tmp_path / f"{n}.jsonl") for n in ("job", "from_last", "from_final"))
    assert sorted(curve) == [4, 5, 6, 7]
    assert sorted(after_final) == [6, 7]
    assert {step: curve[step] for step in (4, 5)} == {step: job_curve[step] for step in (4, 5)}
    assert after_final == {step: curve[step] for step in (6, 7)}


@pytest.mark.multiprocess
def test_sigterm_to_one_rank_just_before_an_async_save_stops_the_other_too(tmp_path: Path) -> None:
    from lightning_megatron.checkpointing import opening

    # Only rank 1 gets the signal (rank 0 does not), right before the async save of step 2 starts:
    # the save goes on, both ranks stop at the next step boundary, non-zero, and the checkpoint is published.
    ckpt, exits = tmp_path / "ckpt", tmp_path / "exits"
    exits.mkdir()
    job = {
        "max_steps": 9, "ckpt_dir": str(ckpt), "ckpt_every": 2, "losses": str(tmp_path / "job.jsonl"),
        "term_after": 2, "term": "self", "stamp": str(tmp_path / "term_at"), "async_save": True, "timeout": 600,
        "exits": str(exits),
    }  # fmt: skip
    codes, _, logs = _job(job, tmp_path, timeout=120)
    assert codes == [143, 143], _tail(logs)
    assert {p.name: p.read_text() for p in exits.iterdir()} == {"rank0": "143", "rank1": "143"}, _tail(logs)
    assert "SIGTERM received by 1 of 2 rank(s): every rank stopped at global step 2" in logs[0], _tail(logs)
    assert sorted(_losses(tmp_path / "job.jsonl")) == [1, 2]
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):  # published whole: metadata, shards, checksums
        common = opening.read_common_state(ckpt / name)
        assert common["global_step"] == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["writer_dies", "checksums_fail"])
def test_a_save_failing_on_one_rank_fails_on_both_naming_it(tmp_path: Path, fault: str) -> None:
    """DP=2, saves every 2 steps; step=4's fails on rank 1 alone: its async writer process kills itself, or (sync)
    its checksums file hits a full disk after the shards were written. Both ranks raise, naming rank 1's cause
    (Megatron's finaliser gathers it on rank 0), instead of the other rank waiting until the timeout."""
    from tests.conftest import run_worker

    args = {"devices": 2, "max_steps": 4, "async_save": fault == "writer_dies", "ckpt_dir": str(tmp_path / "ckpt"),
            "ckpt_every": 2, f"{fault}_on_rank": 1}  # fmt: skip
    rank0 = run_worker(args, tmp_path, timeout=300)
    rank1 = json.loads(next(tmp_path.glob("result-*.json.rank1")).read_text())
    cause = {"writer_dies": r"checkpoint writer process \(pid \d+\) exited with code -9",
             "checksums_fail": r"no space left on the device"}[fault]  # fmt: skip
    died = r"step=4\.ckpt failed: " + (r"rank 1: .*" if fault == "writer_dies" else "") + cause
    for result in (rank0, rank1):  # the cause comes from rank 1, and rank 0 gathered it: both name it
        assert re.search(died, result["error"]), result["error"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt"]
