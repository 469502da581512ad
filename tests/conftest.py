from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "layout_worker.py"


# What an in-process Trainer leaves in os.environ; a child inheriting MASTER_PORT would bind a port we hold.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    # One intra-op thread per rank: 2-4 ranks of a multi-process test share CI's 2 cores, and torch's default of
    # a thread per core in every rank oversubscribes them (gloo's own threads come on top).
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_worker(args: dict, tmp_path: Path, timeout: float = 600, torchrun: bool = False) -> dict:
    """Run ``tests/layout_worker.py``; return rank 0's result.

    By default Lightning's own launcher starts the extra processes; with ``torchrun=True`` torchrun starts them all
    and Lightning joins them (its TorchElastic cluster environment).
    """
    out = tmp_path / f"result-{os.urandom(4).hex()}.json"
    env = child_env()
    if args.get("accelerator", "cpu") == "cpu":  # CPU runs must not touch a GPU that happens to be there
        env["CUDA_VISIBLE_DEVICES"] = ""
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(args["devices"]), "--master-port", "29531"]
    proc = subprocess.run(
        [*launcher, str(WORKER), json.dumps({**args, "out": str(out)})],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"worker failed ({proc.returncode}) for {args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def run_here(args: dict, tmp_path: Path) -> dict:
    """``run_worker``'s one-process run inside this process: the same script and arguments, without starting an
    interpreter and importing torch, Lightning and Megatron again (10-20 s per launch on CI's two cores).

    For one-process reference runs on CPU. One intra-op thread, as ``child_env`` gives a launched worker, so that
    the run computes what a launch would.
    """
    assert args.get("devices", 1) == 1, args
    assert args.get("accelerator", "cpu") == "cpu", args
    if str(WORKER.parent) not in sys.path:
        sys.path.insert(0, str(WORKER.parent))  # the worker imports its helpers as a script does
    import layout_worker

    out = tmp_path / f"result-{os.urandom(4).hex()}.json"
    threads = torch_threads(1)
    try:
        with contextlib.chdir(tmp_path):
            layout_worker.main({**args, "out": str(out)})
    finally:
        torch_threads(threads)
    return json.loads(out.read_text())


def torch_threads(count: int) -> int:
    """Set torch's intra-op thread count; return the previous one."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    return previous


def run_workers(runs: list[dict], tmp_path: Path, timeout: float = 600) -> list[dict]:
    """Several independent ``run_worker`` launches at once; their results in order.

    A launch started by Lightning imports rank 0 first and only then starts (and imports) the other ranks, leaving
    a core idle for ~10 s; two launches side by side keep both of CI's cores busy. Each launch binds its own free
    port (Lightning's default when no MASTER_PORT is set, which ``child_env`` ensures).
    """
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run_worker, args, tmp_path, timeout) for args in runs]
        return [future.result() for future in futures]


@contextlib.contextmanager
def one_process_megatron(port: int) -> Iterator[None]:
    """Megatron's parallel state for this one process (gloo, CPU mode), for tests of modules outside a Trainer."""
    import torch

    from lightning_megatron import cpu
    from lightning_megatron.parallel.sizes import ParallelSizes
    from lightning_megatron.parallel.state import destroy, initialize, seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    with cpu.cpu_mode():
        initialize(ParallelSizes())
        seed(0)
        try:
            yield
        finally:
            destroy()


@pytest.fixture
def fresh_megatron_state() -> None:
    """For tests that check a failing run leaves no Megatron state: start as a fresh process would, without the
    groups that an earlier in-process run kept for a trainer.save_checkpoint after it (training/retained.py)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = cuda_devices()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            need = marker.kwargs.get("devices", 1)
            if have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {have}"))
