"""A rank's share of a checkpoint read by several threads.

Megatron's ``torch_dist`` load reads through torch DCP's ``FileSystemReader``, which deserialises the stored
tensors one after the other in the calling thread: on an H100 host a 13.3 GB checkpoint took 7.2 s from the page
cache, slower than that host's disk (2.28 GB/s: 5.9 s). :class:`ThreadedReader` hands disjoint parts of the same read
plan, each a run of neighbouring entries of about equal bytes, to ``FileSystemReader.read_data`` in threads of its
own (file reads and tensor copies release the GIL); every entry is read exactly as torch reads it. Megatron builds
its reader inside its load strategy, so :class:`~lightning_megatron.compat.patches.ThreadedShardReads` puts this one in
its place for one load.

With data-parallel ranks, Megatron's fully-parallel load reads each tensor on one rank and sends it to the others.
The reader then verifies the checksums of the entries it was asked to verify (the optimizer state) right before
reading them, in the same threads, so each rank verifies only its share, and the disk is read once (the verification
brings the blocks into the page cache). A damaged part is not read at all -- a read that broke on it would leave the
other ranks waiting in Megatron's exchange -- and :meth:`ThreadedReader.raise_damage` raises it after the load, on
every rank, before anything read is used (:func:`.loading.load`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Set
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_megatron.checkpointing.integrity import checksums

if TYPE_CHECKING:
    from lightning_megatron.checkpointing.save.staging import HostBuffers


def default_threads(processes_per_node: int = 1) -> int:
    """Threads per rank for reading a checkpoint, at most 8 (each holds one deserialised entry at a time): the CPUs
    this process may use (its affinity, within a cgroup's CPU quota), shared by the node's ``processes_per_node``
    ranks unless the process is already pinned to fewer CPUs than the machine has."""
    machine = os.cpu_count() or 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    cpus = min(cpus, _cgroup_cpus() or cpus)
    if cpus >= machine:  # not pinned: the node's ranks share the CPUs
        cpus //= max(1, processes_per_node)
    return max(1, min(8, cpus))


def _cgroup_cpus() -> int | None:
    """The CPUs a cgroup v2 quota (``cpu.max``) allows this process, rounded up; None without a quota."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class Reading:
    """How a strategy's load reads: the host buffers the optimizer state is read into (the next save reuses them),
    where the load's timeline goes, the threads per rank, and the (gloo) group the ranks agree on a failed load in
    (none of Megatron's collectives can pair with it; ``None``: the default group)."""

    buffers: HostBuffers | None = None
    timings: dict[str, float] | None = None
    threads: int = 1
    group: Any | None = None


class ThreadedReader(FileSystemReader):
    """torch DCP's file reader whose :meth:`read_data` runs in ``threads`` threads (see the module)."""

    def __init__(
        self, path: str | os.PathLike, threads: int, verify: Set[Any] = frozenset(), metadata: Any | None = None
    ) -> None:
        """``verify``: the entries (``metadata.storage_data`` keys) whose checksums are verified right before they
        are read (see the module); ``metadata``: the checkpoint's, which holds where they are stored."""
        super().__init__(path)
        self.threads = threads
        self._verify, self._metadata = verify, metadata
        self.parts_read = 0
        """How many parts the last :meth:`read_data` was split into (for tests and timelines)."""
        self.bytes_read = 0
        """The stored bytes of the entries the last :meth:`read_data` read (with data parallelism, this rank's
        share of the checkpoint)."""
        self.bytes_verified = 0
        """The stored bytes of the entries the last :meth:`read_data` verified before reading them."""
        self._damage: list[ValueError] = []
        self._lock = threading.Lock()
        self._table: Any = None  # the checksums table, once read (None: not yet)
        self._pool: ThreadPoolExecutor | None = None  # the checksum threads the parts share

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        parts = split(plan.items, self.storage_data, self.threads)
        self.parts_read = len(parts)
        self.bytes_read = sum(self.storage_data[item.storage_index].length for item in plan.items)
        verified = {item.storage_index for item in plan.items} & set(self._verify)
        self.bytes_verified = sum(self.storage_data[index].length for index in verified)
        self._damage, self._table = [], None
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="checksums") as self._pool:
            if len(parts) <= 1:
                return self._read_part(plan, planner)
            # CUDA targets are copied to from the pool's threads: on the caller's device (each has its own).
            device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
            start = None if device is None else lambda: torch.cuda.set_device(device)
            with ThreadPoolExecutor(len(parts), thread_name_prefix="checkpoint-read", initializer=start) as pool:
                futures = [pool.submit(self._read_part, dataclasses.replace(plan, items=p), planner) for p in parts]
                for future in futures:  # the first error, once every part has stopped
                    future.result().wait()
        return _done()

    def _read_part(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Verify the part's entries that are to be verified, then read it; a damaged part is not read."""
        verify = [item.storage_index for item in plan.items if item.storage_index in self._verify]
        if verify:
            try:
                checksums.verify(Path(self.path), self._metadata, verify, self._recorded(), self._pool)
            except ValueError as damage:
                self._damage.append(damage)
                return _done()
        return super().read_data(plan, planner)

    def _recorded(self) -> Any:
        """The checksums table (None for a checkpoint without checksums), read once by the first part."""
        with self._lock:
            if self._table is None:
                self._table = [checksums.read(Path(self.path))]
            return self._table[0]

    def raise_damage(self) -> None:
        """Raise the damage the last :meth:`read_data` found (the first part's), if any."""
        if self._damage:
            raise self._damage[0]


def _done() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


def split(items: list[ReadItem], storage_data: dict[Any, Any], parts: int) -> list[list[ReadItem]]:
    """``items`` in file and offset order, cut into at most ``parts`` runs of about equal stored bytes (an entry is
    never cut; no run is empty)."""
    if parts <= 1 or len(items) <= 1:
        return [items] if items else []
    where = {id(item): storage_data[item.storage_index] for item in items}
    ordered = sorted(items, key=lambda item: (where[id(item)].relative_path, where[id(item)].offset))
    total = sum(where[id(item)].length for item in ordered)
    runs: list[list[ReadItem]] = [[]]
    done = 0
    for item in ordered:
        # A new run once this one holds its share of the bytes (the last run takes the rest).
        if runs[-1] and done >= total * len(runs) / parts and len(runs) < parts:
            runs.append([])
        runs[-1].append(item)
        done += where[id(item)].length
    return runs
