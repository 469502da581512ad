"""Multi-process test runs whose ranks are forked from a process that has imported the stack once.

A launched rank spends ~15 s of CPU importing torch, Lightning, Megatron and transformers before it does anything,
so a 4-process run on CI's two cores spent most of its time importing. Here a multiprocessing fork server imports
the stack once per test session and forks every rank from itself (``tests/conftest.py:run_forked``). Each rank gets
the environment a launcher gives its processes (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), so
Lightning joins processes created outside it, as under torchrun: the run is a real multi-process run over gloo.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from importlib import import_module


def rank_main(entry: str, args: dict, rank: int, world: int, port: int, cwd: str, log: str, env: dict) -> None:
    """Rank ``rank`` of ``world``: runs ``entry`` (``"module:function"``) with ``args``, output into ``log``."""
    # The stack the fork server imported stays out of the collector's reach (as in the test process, conftest.py):
    # each run's teardown makes a full collection, which would walk all of it and copy its pages from the server.
    gc.freeze()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)  # the fork server's stdout is block-buffered: a killed rank's last
    sys.stderr.reconfigure(line_buffering=True)  # lines would be lost from the log
    os.environ.clear()  # the environment at launch time, not the fork server's from its start
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world)
    )
    import torch

    # What OMP_NUM_THREADS=1 gives a launched rank (the fork server's torch read the variable before it was set).
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    os.chdir(cwd)
    module, _, function = entry.partition(":")
    main: Callable[[dict], None] = getattr(import_module(module), function)
    main(args)
