"""Async saves in flight: each rank's writer process writes them, and every rank publishes them together.

This replaces Megatron's ``AsyncCallsQueue`` (which forks a writer per save) with the same contract: a save is
scheduled on every rank; it is finalised (Megatron's metadata, then our publish: :func:`.saving.save`'s finalisers)
on every rank once every rank's writer is done, which one small all-reduce per check establishes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lightning_megatron.checkpointing.save.staging import HostBuffers
from lightning_megatron.checkpointing.save.write_process import WriterProcess


class BackgroundSaves:
    """The async save of one strategy not yet published (one at a time), and its rank's writer process."""

    def __init__(self, buffers: HostBuffers) -> None:
        self.buffers = buffers
        self.writer: WriterProcess | None = None
        """This rank's writer process, started when a fit starts (:meth:`start`; by the first save otherwise, and
        again if it died)."""
        self.writers_started = 0
        self.last_write: dict[str, float] = {}
        """This rank's write of the save published last (:attr:`.write_process.WriterProcess.last_write`; empty if
        this rank wrote no file)."""
        self._request: Any | None = None
        self._failed: Exception | None = None  # handing the save to the writer failed: this rank's write result

    @property
    def pending(self) -> int:
        return int(self._request is not None)

    def schedule(self, request: Any) -> None:
        """Collective (with :meth:`finalize`): hand ``request`` (Megatron's ``AsyncRequest``) to the writer."""
        assert self._request is None, "the previous save must be published before the next one starts"
        self._request, self._failed, self.last_write = request, None, {}
        if request.async_fn is None:  # this rank writes no file
            return
        try:
            buckets = request.preload_fn() if request.preload_fn is not None else request.async_fn_args[1]
            self._writer().write(request.async_fn, torch.distributed.get_rank(), buckets, self.buffers.shared)
        except Exception as error:  # failed here; every rank learns it when the save is finalised, as for a write
            self._failed = RuntimeError(f"handing the save to the writer process failed: {type(error).__name__}: "
                                        f"{error}")  # fmt: skip

    def finalize(self, blocking: bool) -> bool:
        """Collective: if every rank's writer is done (with ``blocking``: once it is), run the save's finalisers
        (they raise if a rank's write failed) and return True; else False."""
        if self._request is None:
            return True
        writing = self.writer is not None and self.writer.busy
        local = int(writing and not self.writer.done(blocking))
        if _any_rank(local) and not blocking:
            return False
        request, self._request = self._request, None
        if self._failed is not None:
            request.async_fn_args[2].put(self._failed)  # where Megatron's finaliser reads the results
        elif writing:
            request.async_fn_args[2].put(self.writer.answer())
            self.last_write = self.writer.last_write
        for finalize in request.finalize_fns:
            finalize()
        return True

    def map_buffers(self) -> None:
        """The writer maps exactly the host buffers' segments: new ones (allocated ahead of the first save) are
        mapped now, given-back ones unmapped, so that their memory really goes back."""
        if self.writer is not None and not self.writer.busy and self.writer.alive:
            with contextlib.suppress(Exception):  # a broken writer is replaced at the next save
                self.writer.segments(self.buffers.shared)

    def close(self, abort: bool = False) -> None:
        """Stop the writer process (killing it with ``abort``: nothing is published; no collective)."""
        self._request = self._failed = None
        if self.writer is not None:
            self.writer.close(kill=abort)
            self.writer = None

    def start(self) -> None:
        """Start the writer process ahead of the first save, unless it runs."""
        self._writer()

    def _writer(self) -> WriterProcess:
        if self.writer is None or not self.writer.alive:
            if self.writer is not None:
                self.writer.close(kill=True)
            self.writer = WriterProcess()
            self.writers_started += 1
        return self.writer


def _any_rank(flag: int) -> bool:
    """Whether ``flag`` is set on any rank (an all-reduce over the default group, on its backend's device)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"
    value = torch.tensor([flag], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())
