"""Host copies of what a save writes: buffers allocated once (when a fit starts, else at the first save) and reused.

A save copies every tensor it writes to host memory before training goes on (an async save's writer then writes
those copies while training changes the originals). From the GPU, copies into page-locked (pinned) memory run at
the link's speed, about ten times faster than into pageable memory, and allocating and pinning gigabytes takes
seconds; so the buffers are kept for the run: a later save of the same tensors allocates nothing. They hold one
copy of the rank's share of the checkpoint in host memory (about 14 bytes per parameter with Adam and bf16 weights)
until the strategy is torn down.

The buffers are cut from memory segments of 256 MB (:mod:`.shared_memory`; page-locked with ``cudaHostRegister`` on a
GPU), not torch's pinned memory: ``cudaHostAlloc`` pins about 2 GB/s, where touching pageable memory in ATen's
threads and registering it runs several times faster (``benchmarks/pinned_alloc.py``), and torch's allocator rounds
each buffer up to a power of two and keeps freed blocks in its cache. An async save's writer process, started once,
maps the segments once (:mod:`.write_process`). They go back to the system when released.

A staged tensor is a whole buffer, never a view, so Megatron's writer does not copy it again (it clones host views).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.checkpointing.save.shared_memory import SharedSegments


class HostBuffers:
    """The host buffers of one strategy's saves, keyed by what each holds (a sharded tensor's key and offset)."""

    def __init__(self, shared: bool = False) -> None:
        self.segments = SharedSegments(shared=shared) if shared or hasattr(os, "memfd_create") else None
        """The memory segments the buffers are cut from (None where the system has no ``memfd_create``: torch's
        memory then; async saves need them, :meth:`.writer.CheckpointWriter.prepare`)."""
        self._buffers: dict[tuple[Any, ...], Tensor] = {}
        self._staged: set[tuple[Any, ...]] = set()
        self._taken: set[int] = set()  # ids of the buffers this save holds (a renamed entry is staged already)
        self._cuda = False
        self.allocations = 0
        """Buffers allocated so far: a second save of the same tensors adds none."""
        self.bytes = 0
        """Bytes held in host buffers."""
        self.timings = {"allocate_s": 0.0, "copy_wait_s": 0.0}
        """Seconds of the current (or last) save spent allocating buffers (and page-locking them) and waiting for
        the copies from the GPU in :meth:`finish`."""

    @property
    def shared(self) -> SharedSegments | None:
        """The segments, when an async save's writer process maps them too; else None."""
        return self.segments if self.segments is not None and self.segments.shared else None

    def begin(self) -> None:
        """Start a save: each buffer may be staged into once until :meth:`finish`."""
        self._staged.clear()
        self._taken.clear()
        self._cuda = False
        self.timings = {"allocate_s": 0.0, "copy_wait_s": 0.0}

    def stage(self, name: tuple[Any, ...], tensor: Tensor) -> Tensor:
        """A host copy of ``tensor`` in the buffer ``name`` (allocated if new or of another shape). Copies from the
        GPU are queued without waiting (:meth:`finish` waits for them). A buffer of this save is returned as is
        (also under another name: a chained optimizer's entries are renamed after they were staged)."""
        if id(tensor) in self._taken:
            return tensor
        buffer = self.take(name, tensor.shape, tensor.dtype, pinned=tensor.is_cuda)
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        self._cuda = self._cuda or tensor.is_cuda
        return buffer

    def take(self, name: tuple[Any, ...], shape: torch.Size, dtype: torch.dtype, pinned: bool) -> Tensor:
        """The buffer ``name`` (its content undefined), allocated if new or of another shape: for one tensor of the
        current save (or load: a load reads into the buffers a later save reuses)."""
        if name in self._staged:
            raise ValueError(f"two tensors of one save would share the host buffer {name}")
        self._staged.add(name)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            if buffer is not None:
                self.bytes -= buffer.nbytes
            start = time.perf_counter()
            if self.segments is not None:
                buffer = self.segments.tensor(shape, dtype, pinned)
            else:
                buffer = torch.empty(shape, dtype=dtype, pin_memory=pinned)
            self.timings["allocate_s"] += time.perf_counter() - start
            self._buffers[name] = buffer
            self.allocations += 1
            self.bytes += buffer.nbytes
        self._taken.add(id(buffer))
        return buffer

    def finish(self) -> None:
        """Wait until every copy of this save is in host memory."""
        if self._cuda:
            start = time.perf_counter()
            torch.cuda.current_stream().synchronize()
            self.timings["copy_wait_s"] += time.perf_counter() - start

    def release(self) -> None:
        """Free every buffer (the next save allocates them again): the segments go back to the system once no tensor
        and no writer process maps them."""
        self._buffers.clear()
        self._staged.clear()
        self._taken.clear()
        self.bytes = 0
        if self.segments is not None:
            self.segments.release()


def stage_state(state: dict[str, Any], buffers: HostBuffers) -> None:
    """Replace, in place, the data of every sharded tensor of ``state`` with its host copy (factories applied
    first, so that the writer sees whole buffers); sharded objects and common entries stay as they are."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(state)

    def stage(item: Any) -> Any:
        if isinstance(item, ShardedTensor) and isinstance(item.data, Tensor):
            item.data = buffers.stage(name_of(item), item.data)
        return item

    dict_list_map_inplace(stage, state)


def name_of(item: Any) -> tuple[Any, ...]:
    """The host buffer name of a sharded tensor: its key and where its shard sits."""
    return (item.key, tuple(item.global_offset), tuple(item.axis_fragmentations or ()))
