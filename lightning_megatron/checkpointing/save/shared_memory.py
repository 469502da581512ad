"""Host memory shared by the training process and its checkpoint writer process.

An async save stages its tensors in host buffers that a separate writer process writes to disk while training goes
on. The writer (:mod:`.write_process`) is started once and maps each buffer once: a process forked per save, as
Megatron's async writer is, faults every page of the buffers into itself again at every save, several seconds per
10 GB. So the buffers live in segments of anonymous shared memory (``memfd_create``; not ``/dev/shm``, whose size a
container often limits to 64 MB), handed to the writer as file descriptors; on a GPU each segment is page-locked
(``cudaHostRegister``), so the copies from the GPU run at the link's speed.

Each buffer is a tensor of its own storage (``torch.frombuffer`` on the segment's mapping), so Megatron's writer
never clones it (it clones views of a larger storage).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

SEGMENT_BYTES = 256 << 20
"""The size of a segment buffers are cut from (a larger buffer gets a segment of its own)."""
_ALIGN = 4096
_NAME = "lightning_megatron_ckpt_"  # the segments' names, as /proc shows them (/memfd:<name><index>)


@dataclass
class Segment:
    """One memfd mapping: its descriptor (kept open to hand to the writer), its size, and the bytes used so far."""

    index: int
    fd: int
    nbytes: int
    view: mmap.mmap
    address: int
    used: int = 0
    pinned: bool = False


@dataclass(eq=False)
class SharedSegments:
    """The segments of one strategy's host buffers; :meth:`tensor` cuts a new buffer from them. ``shared``: keep each
    segment's descriptor open, to hand to a writer process; else it is closed once mapped (the mapping keeps the
    memory), so buffers for this process alone hold no descriptor."""

    shared: bool = True
    segments: dict[int, Segment] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self) -> None:
        _LIVE.add(self)

    def tensor(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> Tensor:
        """A new tensor (its content undefined) in a segment; page-locked when ``pinned`` and a GPU is there."""
        nbytes = max(shape.numel() * dtype.itemsize, 1)
        pinned = pinned and torch.cuda.is_available()
        segment = next((s for s in self.segments.values() if s.pinned == pinned and s.nbytes - s.used >= nbytes), None)
        if segment is None:
            segment = self._new(max(SEGMENT_BYTES, _round_up(nbytes)), pinned)
        offset = segment.used
        segment.used = _round_up(offset + nbytes)
        flat = torch.frombuffer(segment.view, dtype=dtype, count=shape.numel(), offset=offset)
        return flat.view(shape)

    def locate(self, tensor: Tensor) -> tuple[int, int] | None:
        """``(segment, byte offset)`` of a whole-storage tensor cut from these segments, else None."""
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() != tensor.nbytes:
            return None
        address = tensor.data_ptr()
        for segment in self.segments.values():
            if segment.address <= address < segment.address + segment.nbytes:
                return segment.index, address - segment.address
        return None

    def release(self) -> None:
        """Drop every segment (unpinned first); the memory goes back once no tensor and no writer maps it. (The
        mappings are never closed here: a tensor cut from one would then point at unmapped memory.)"""
        if any(segment.pinned for segment in self.segments.values()):
            with contextlib.suppress(RuntimeError):  # (a broken CUDA context: nothing is copying any more)
                torch.cuda.synchronize()  # no copy from the GPU may still write into memory about to be unpinned
        for segment in self.segments.values():
            if segment.pinned:
                torch.cuda.cudart().cudaHostUnregister(segment.address)
            if segment.fd >= 0:
                os.close(segment.fd)
        self.segments.clear()

    def _new(self, nbytes: int, pinned: bool) -> Segment:
        fd = os.memfd_create(f"{_NAME}{self._next}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            view = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            raise
        view.madvise(mmap.MADV_DONTFORK)  # processes forked later (data loader workers) do not map it
        segment = Segment(self._next, fd, nbytes, view, _address(view), pinned=pinned)
        if pinned:
            _fault_in(view)
            code = torch.cuda.cudart().cudaHostRegister(segment.address, nbytes, 0)
            if int(code) != 0:
                os.close(fd)
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of checkpoint host memory failed ({code})")
        if not self.shared:
            os.close(fd)
            segment.fd = -1
        self.segments[segment.index] = segment
        self._next += 1
        return segment


_LIVE: weakref.WeakSet[SharedSegments] = weakref.WeakSet()


def _close_in_child() -> None:
    """In a process forked from this one (a data loader worker, ...): close the segments' descriptors, which would
    keep their memory allocated for as long as that process lives. Python's ``mmap`` holds a duplicate of each
    descriptor it maps, which it does not expose: they are found by name. The child never uses the segments (their
    mappings are not inherited: MADV_DONTFORK)."""
    if not any(shared.segments for shared in list(_LIVE)):
        return
    for shared in list(_LIVE):
        for segment in shared.segments.values():
            segment.fd = -1
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            for name in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError, ValueError):
                    if os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{_NAME}"):
                        os.dup2(null, int(name))  # (the number stays taken: Python's mmap closes it at its end)
        finally:
            os.close(null)


os.register_at_fork(after_in_child=_close_in_child)


def map_segment(fd: int, nbytes: int, populate: bool) -> mmap.mmap:
    """The writer's mapping of a segment handed over as ``fd`` (closed here: the mapping keeps the memory). With
    ``populate`` (a page-locked segment: every page of it exists) every page is mapped now, in one pass of the
    kernel's, not faulted in one by one as the first write reads it; not otherwise, as reading a page of a segment
    that no buffer uses yet would allocate it."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    try:
        return mmap.mmap(fd, nbytes, flags, mmap.PROT_READ)
    finally:
        os.close(fd)


def tensor_at(view: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """The writer's tensor over ``shape`` x ``dtype`` bytes at ``offset`` of a read-only segment mapping."""
    count = 1
    for size in shape:
        count *= size
    import warnings

    with warnings.catch_warnings():  # the mapping is read-only in the writer, which only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype, count=count, offset=offset).view(shape)


def _fault_in(view: mmap.mmap) -> None:
    """Touch every page (the zero pages of a new segment) so that registering it pins allocated memory."""
    flat = torch.frombuffer(view, dtype=torch.uint8)
    flat.zero_()  # ATen's threads, faster than page faults one by one during registration
    del flat


def _address(view: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _round_up(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
