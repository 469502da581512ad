"""When checkpoints become visible and when old ones may go: synchronous or asynchronous saves, deferred removals.

With ``CheckpointConfig.async_save`` a save returns once the shards are handed to this rank's background writer
process (started when a fit starts and kept for it: :mod:`.write_process`); the checkpoint is *published*
(``<name>.partial`` renamed to ``<name>``) when every rank's writer has finished, which
:meth:`CheckpointWriter.poll` checks between training steps. A pending save is always finalised before the next
save starts, before a checkpoint is loaded and at the end of training.

``ModelCheckpoint`` removes an older checkpoint right after asking for a new one. While a save is pending those
removals wait until it is published, so a kill at any moment leaves at least the last published checkpoint.

The writer's settings are a :class:`~.config.CheckpointConfig`, given when the strategy is made
(:attr:`CheckpointWriter.config`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron.checkpointing.config import CheckpointConfig, with_async_save
from lightning_megatron.checkpointing.load.reading import Reading, default_threads
from lightning_megatron.checkpointing.save import saving
from lightning_megatron.checkpointing.save.background import BackgroundSaves
from lightning_megatron.checkpointing.save.plans import SavePlans
from lightning_megatron.checkpointing.save.staging import HostBuffers
from lightning_megatron.checkpointing.save.write_process import children_ignore_sigterm

_SETTINGS = frozenset(CheckpointConfig.__dataclass_fields__)


class CheckpointWriter:
    """Owns the async-save queue of one strategy, its saves not yet published, the removals waiting for them, and
    what later saves reuse: the host buffers the tensors are staged in and the save plans."""

    def __init__(self, config: CheckpointConfig | None = None, async_save: bool | None = None) -> None:
        self.config = with_async_save(config, async_save)
        """The settings (async saves, what a save holds, host buffers, read threads), fixed for the strategy."""
        self.buffers = HostBuffers(shared=self.config.async_save)
        self.plans = SavePlans()
        self.last_save: dict[str, Any] = {}
        """Seconds the last save took on this rank: ``wait_s`` (for the previous async save to be published),
        ``stage_s`` (state dict and host copies; of it, ``allocate_s`` allocating and page-locking host buffers, where
        the save had to, and ``copy_wait_s`` waiting for the copies from the GPU), ``plan_s``, ``write_s`` (synchronous
        saves), ``blocked_s`` (all of it: what training waited), ``new_structure``. An async save's entry gains, in
        place, when it is published: ``writer_wait_s`` (from the handoff until this rank's writer process began the
        write), ``write_s`` (its write: shards and checksums), ``writer_start_s`` (how long that process took to
        start serving) and ``published_s`` (from the save's start until published here, between two training
        steps)."""
        self.last_load: dict[str, float] = {}
        """Seconds the parts of the last load took on this rank: ``open_s`` (metadata and common state),
        ``state_s`` (the state to read into, with its host buffers), ``check_s`` (the model against the files),
        ``verify_s`` (the checksums of what is read into the model), ``read_s`` (Megatron's load, while the
        optimizer state's checksums are verified), ``verify_after_read_s`` (waiting for those after the read),
        ``apply_s`` (into the model and optimizer); and ``read_parts``, the parts read in threads of their own, and
        ``read_bytes``, the stored bytes they read, and ``read_verified_bytes``, those they verified right before
        reading them (the optimizer state's share, with data-parallel ranks; all three 0 with Megatron's reader,
        ``read_threads=1``)."""
        self._processes_per_node = 1
        self._queue: BackgroundSaves | None = None
        self._saves: list[saving.PendingSave] = []  # oldest first, as they are finalised
        self._removals: list[Path] = []
        self._save_started = 0.0  # time.monotonic() when the last save started
        self.prestaged: dict[str, float] = {}
        """Seconds :meth:`prestage` took (``prestage_s``; of it ``allocate_s`` and ``copy_wait_s``), if it ran."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTINGS:  # these were attributes to set before a fit: a silent no-op now would change the run
            raise AttributeError(
                f"checkpoint_writer.{name} is a setting given when the strategy is made: "
                f"MegatronStrategy(checkpoint=CheckpointConfig({name}={value!r})) (in a LightningCLI YAML, "
                f"trainer.strategy.init_args.checkpoint.{name}); it reads as checkpoint_writer.config.{name}"
            )
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:  # only for names not found the usual way
        if name in _SETTINGS:
            raise AttributeError(f"checkpoint_writer.{name} is read as checkpoint_writer.config.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def prepare(self, distributed_optimizer: bool, processes_per_node: int = 1) -> None:
        """When a run starts (before any process group exists): raise ``ValueError`` for settings this run cannot
        serve; the default ``read_threads`` shares the CPUs among ``processes_per_node`` ranks."""
        self._processes_per_node = processes_per_node
        if not (self.config.save_model_weights or distributed_optimizer):
            raise ValueError(
                "CheckpointConfig(save_model_weights=False) stores the trained weights as the distributed optimizer's "
                "fp32 main weights, and this strategy has use_distributed_optimizer=False: use "
                "MegatronStrategy(use_distributed_optimizer=True) or keep save_model_weights=True"
            )
        if self.config.async_save and not hasattr(os, "memfd_create"):
            raise ValueError(
                "CheckpointConfig(async_save=True) stages saves in shared memory made with memfd_create, which this "
                "system does not have (Linux only): use async_save=False"
            )
        if self.config.async_save:  # forked before any shared memory or writer socket exists: it inherits none of them
            with children_ignore_sigterm():
                _start_result_queue()

    def start(self, trainer_fn: str = "fit") -> None:
        """When a run starts: for a fit (``trainer_fn``, Lightning's ``TrainerFn``) with async saves, start the writer
        process (its start, seconds of imports, overlaps building the model and the first steps instead of delaying
        the first save's publish)."""
        if self.config.async_save and trainer_fn == "fit":
            self._background().start()

    def prestage(self, *builds: Callable[[HostBuffers, bool], dict[str, Any]]) -> None:
        """When a fit starts (with async saves, after :meth:`start`): stage each of ``builds`` -- the structures the
        fit's saves will hold -- once, so that the host buffers are allocated and page-locked now (and, with async
        saves, the writer process maps them) before the first save. That save's staging then takes no longer than
        later saves', and the host memory is committed when the fit starts (an out-of-memory shows there, not at the
        first save). Not with ``keep_host_buffers`` off (each save allocates its own buffers). Collective, as a
        save."""
        self.prestaged = {}
        if not self.config.keep_host_buffers:
            return
        start, timings = time.perf_counter(), dict.fromkeys(self.buffers.timings, 0.0)
        for build in builds:
            build(self.buffers, self.config.save_model_weights)
            timings = {key: seconds + self.buffers.timings[key] for key, seconds in timings.items()}  # reset per build
        if self.config.async_save:
            self._background().map_buffers()
        self.prestaged = {"prestage_s": time.perf_counter() - start, **timings}

    def _background(self) -> BackgroundSaves:
        if self._queue is None:
            self._queue = BackgroundSaves(self.buffers)
        return self._queue

    @property
    def background(self) -> BackgroundSaves | None:
        """The async saves' writer process and the save it writes (None without async saves)."""
        return self._queue

    @property
    def pending(self) -> int:
        """Saves handed to background writers and not yet published."""
        return self._queue.pending if self._queue is not None else 0

    def save(
        self, build: Callable[[HostBuffers, bool], dict[str, Any]], path: str | Path, publish: bool = False
    ) -> None:
        """Collective. Publishes any earlier pending save, then saves ``build(buffers, save_model_weights)`` (the
        state, its tensors staged in the host buffers, which the earlier save no longer reads) synchronously or
        asynchronously; with ``publish`` (a save after a run, or on its way out after an exception, when the
        writer process may be stopped next) synchronously in any case."""
        start, started = time.perf_counter(), time.monotonic()
        self.finalize()  # the earlier save no longer reads the host buffers once published
        self._save_started = started  # (after the finalisation: it may publish the earlier save, timed from its own)
        assert not self.pending, "a save must not stage into host buffers a pending save still reads"
        staging = time.perf_counter()
        state = build(self.buffers, self.config.save_model_weights)
        timings = {"wait_s": staging - start, "stage_s": time.perf_counter() - staging, **self.buffers.timings}
        background = self.config.async_save and not publish  # published at once (a save after fit): written here
        strategy, new = self.plans.strategy_for(state)
        with children_ignore_sigterm():
            _start_result_queue()
            queue = self._background() if background else None  # (also for a save without start(): benchmarks)
            pending = saving.save(state, path, queue, strategy, validate=new is not None, timings=timings)
        if new is not None:
            self.plans.remember(new, strategy)
        self.last_save = {**timings, "blocked_s": time.perf_counter() - start, "new_structure": new is not None}
        if pending is not None:
            self._saves.append(pending)
        if publish:
            self.finalize()
        self._release_unless_kept()

    @contextlib.contextmanager
    def loading(self, group: Any | None = None) -> Iterator[Reading]:
        """Around a load: a save still being written is published first; yields how to read: the host buffers the
        optimizer state is read into (freed afterwards unless ``keep_host_buffers``), :attr:`last_load`,
        ``read_threads`` and ``group``, the group the ranks agree on a failed load in."""
        self.finalize()
        self.last_load.clear()
        threads = self.config.read_threads or default_threads(self._processes_per_node)
        try:
            yield Reading(self.buffers, self.last_load, threads, group)
        finally:
            self._release_unless_kept()

    def _release_unless_kept(self) -> None:
        if not self.config.keep_host_buffers and not self.pending:  # a pending save's writer still reads them
            self.buffers.release()
            if self._queue is not None:
                self._queue.map_buffers()

    def remove(self, path: str | Path) -> None:
        """Remove a checkpoint directory (rank 0), or queue the removal until pending saves are published."""
        self._removals.append(Path(path))
        if not self.pending:
            self._run_removals()

    def poll(self) -> None:
        """Collective while a save is pending (one small all-reduce): publish the saves every rank has written."""
        if self._queue is not None and self.pending:
            self._finalize(blocking=False)
            if not self.pending:
                self._run_removals()

    def finalize(self) -> None:
        """Collective: wait for every pending save, publish it, then run the queued removals."""
        if self._queue is not None and self.pending:
            self._finalize(blocking=True)
        self._run_removals()

    def _finalize(self, blocking: bool) -> None:
        assert self._queue is not None
        try:
            published = self._queue.finalize(blocking=blocking)
        except (Exception, CheckpointException) as error:  # the oldest pending save failed
            failed = self._saves.pop(0)
            raise failed.failed(error) from error
        finally:
            del self._saves[: len(self._saves) - self.pending]  # published
        if published:  # (the save of last_save: a save publishes the one before it first)
            self.last_save.update(self._queue.last_write, published_s=time.monotonic() - self._save_started)
        self._release_unless_kept()

    def close(self, failed: bool) -> None:
        """At the end of a run: :meth:`finalize` (or :meth:`abort` after a failure), then free the host buffers and
        plans (a later save makes them again)."""
        try:
            self.abort() if failed else self.finalize()
        finally:
            if self._queue is not None:
                self._queue.close()  # the writer process ends (it has written everything it was sent)
            self.buffers.release()
            self.plans.clear()

    def abort(self) -> None:
        """After a failure (peers may be gone): stop local writers without any collective; nothing is published,
        so the unfinished ``.partial`` directories stay unloadable and the older checkpoints stay in place."""
        if self._queue is not None:
            self._queue.close(abort=True)
        for pending in self._saves:
            pending.lock.release()
        self._saves.clear()
        self._removals.clear()

    def _run_removals(self) -> None:
        removals, self._removals = self._removals, []
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        for path in removals:
            shutil.rmtree(path, ignore_errors=True)


def _start_result_queue() -> None:
    """Megatron's writers report to a queue served by a multiprocessing manager process, which Megatron spawns at
    the first save; a spawned process gets a fresh signal mask, so a job-wide SIGTERM would kill it and every later
    finalisation would fail on its broken pipe. Started here first instead, forked (Megatron's function takes the
    start method; forked processes inherit the blocked SIGTERM). A no-op once the queue exists."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    get_write_results_queue("fork")
