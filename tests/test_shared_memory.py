"""The host buffers of async saves: shared memory segments the writer process maps once (checkpointing/
shared_memory.py, checkpointing/write_process.py). The runs that save through them are in test_checkpoint_cost.py
and test_faults.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_megatron.checkpointing.shared_memory import SEGMENT_BYTES, SharedSegments


def test_buffers_are_whole_storages_in_memfd_segments() -> None:
    shared = SharedSegments()
    small = shared.tensor(torch.Size([3, 5]), torch.bfloat16, pinned=False)
    other = shared.tensor(torch.Size([7]), torch.float32, pinned=False)
    large = shared.tensor(torch.Size([SEGMENT_BYTES // 4 + 1]), torch.float32, pinned=False)
    try:
        # Megatron's writer clones a tensor that is a view of a larger storage: each buffer has its own.
        for tensor in (small, other, large):
            assert tensor.untyped_storage().nbytes() == tensor.nbytes
        assert shared.locate(small) == (0, 0)
        assert shared.locate(other) == (0, 4096)  # page-aligned after the first
        assert shared.locate(large) == (1, 0)  # larger than a segment: one of its own
        assert shared.locate(torch.zeros(3)) is None
        assert shared.locate(other[1:]) is None  # a view is not a buffer
        maps = Path("/proc/self/maps").read_text()
        assert maps.count("/memfd:lightning_megatron_ckpt_") >= 2  # anonymous shared memory, not /dev/shm
    finally:
        del small, other, large
        shared.release()
    assert shared.segments == {}


def test_the_writer_process_reads_what_the_training_process_writes_later() -> None:
    """The writer maps a segment once; what the training process stages into it afterwards is what it writes."""
    import pickle

    from lightning_megatron.checkpointing.write_process import WriterProcess

    shared = SharedSegments()
    buffer = shared.tensor(torch.Size([4, 4]), torch.float32, pinned=False)
    writer = WriterProcess()
    try:
        for value in (1.0, 2.0):  # two saves of the same buffer: handed over once
            buffer.fill_(value)
            writer.write(pickle.loads(pickle.dumps(_sum_of_buckets)), 0, [("f", "k", ([], [("item", buffer)]))], shared)
            assert writer.answer() == value * 16
        assert writer.segments_sent == 1
        maps = Path(f"/proc/{writer.process.pid}/maps")
        assert "lightning_megatron_ckpt_" in maps.read_text()
        del buffer
        shared.release()  # the buffers given back (keep_host_buffers=False): the writer unmaps them too
        writer.write(_sum_of_buckets, 0, [], shared)  # (a round trip after the unmapping)
        assert writer.answer() == 0
        assert "lightning_megatron_ckpt_" not in maps.read_text()
    finally:
        writer.close()
        shared.release()
    assert writer.process.returncode == 0  # asked to exit, it did


def _sum_of_buckets(rank: int, buckets: list, results: object) -> None:
    results.put(sum(float(t.sum()) for _, _, (_, tensors) in buckets for _, t in tensors))


@pytest.mark.gpu
def test_pinned_segments_take_copies_from_the_gpu_without_waiting() -> None:
    shared = SharedSegments()
    buffer = shared.tensor(torch.Size([1 << 20]), torch.bfloat16, pinned=True)
    try:
        assert buffer.is_pinned()  # cudaHostRegister'd: the copy below is a DMA, not a staged one
        source = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
        buffer.copy_(source, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(buffer, source.cpu())
    finally:
        del buffer
        shared.release()
