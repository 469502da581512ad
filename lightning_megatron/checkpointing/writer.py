"""When checkpoints become visible and when old ones may go: synchronous or asynchronous saves, deferred removals.

With ``async_save`` a save returns once the shards are handed to a background writer process (Megatron's async
dist-checkpointing); the checkpoint is *published* (``<name>.partial`` renamed to ``<name>``) when every rank's
writer has finished, which :meth:`CheckpointWriter.poll` checks between training steps. A pending save is always
finalised before the next save starts, before a checkpoint is loaded and at the end of training.

``ModelCheckpoint`` removes an older checkpoint right after asking for a new one. While a save is pending those
removals wait until it is published, so a kill at any moment leaves at least the last published checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.checkpointing import sharded


class CheckpointWriter:
    """Owns the async-save queue of one strategy and the removals waiting for it."""

    def __init__(self, async_save: bool) -> None:
        self.async_save = async_save
        self._queue: Any | None = None
        self._removals: list[Path] = []

    @property
    def pending(self) -> int:
        """Saves handed to background writers and not yet published."""
        return self._queue.get_num_unfinalized_calls() if self._queue is not None else 0

    def save(self, state: dict[str, Any], path: str | Path) -> None:
        """Collective. Synchronous, or asynchronous after publishing any earlier pending save."""
        self.finalize()
        if self.async_save and self._queue is None:
            self._queue = sharded.async_queue()
        sharded.save(state, path, async_queue=self._queue if self.async_save else None)

    def remove(self, path: str | Path) -> None:
        """Remove a checkpoint directory (rank 0), or queue the removal until pending saves are published."""
        self._removals.append(Path(path))
        if not self.pending:
            self._run_removals()

    def poll(self) -> None:
        """Collective while a save is pending (one small all-reduce): publish the saves every rank has written."""
        if self._queue is not None and self.pending:
            self._queue.maybe_finalize_async_calls(blocking=False)
            if not self.pending:
                self._run_removals()

    def finalize(self) -> None:
        """Collective: wait for every pending save, publish it, then run the queued removals."""
        if self._queue is not None and self.pending:
            self._queue.maybe_finalize_async_calls(blocking=True)
        self._run_removals()

    def abort(self) -> None:
        """After a failure (peers may be gone): stop local writers without any collective; nothing is published,
        so the unfinished ``.partial`` directories stay unloadable and the older checkpoints stay in place."""
        if self._queue is not None:
            for call in list(self._queue.async_calls):
                call.async_caller.close(abort=True)
            self._queue.async_calls.clear()
        self._removals.clear()

    def _run_removals(self) -> None:
        removals, self._removals = self._removals, []
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        for path in removals:
            shutil.rmtree(path, ignore_errors=True)
