"""The host buffers of async saves: shared memory segments the writer process maps once (checkpointing/
shared_memory.py, checkpointing/save/write_process.py). The runs that save through them are in test_checkpoint_cost.py
and test_faults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_megatron.checkpointing.save.shared_memory import SEGMENT_BYTES, SharedSegments


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

    from lightning_megatron.checkpointing.save.write_process import WriterProcess

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


def test_the_writer_process_starts_light_and_ready_to_write() -> None:
    """The writer imports what writing needs -- Megatron's writer, before any save arrives -- and not the package's
    API (Lightning, the models) nor Megatron-Core's models, whose import would make a save in a fit's first steps
    wait seconds for the writer; nor does a tensor sent by value (not in the shared buffers) import them. Each answer
    says when the write began and ended."""
    from lightning_megatron.checkpointing.save.write_process import WriterProcess

    writer = WriterProcess()
    by_value = torch.arange(6.0).view(2, 3)[:, 1:]  # a view: not a whole buffer, so sent by value
    try:
        writer.write(_modules, 0, [("f", "k", ([], [("item", by_value), ("empty", torch.zeros(0))]))], SharedSegments())
        assert writer.answer() == (
            {"megatron.core.dist_checkpointing.strategies.filesystem_async"},
            [by_value.tolist(), []],
        )
        assert set(writer.last_write) == {"writer_wait_s", "write_s", "writer_start_s"}
        assert writer.last_write["writer_wait_s"] >= 0
        assert writer.last_write["write_s"] >= 0
    finally:
        writer.close()
    assert writer.process.returncode == 0


def test_a_writer_still_starting_does_not_hold_up_the_handoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save is handed over from a thread: ``write`` returns while the writer has not read a byte yet (a 16 MB
    message, far more than the connection buffers), and the save is written once the writer serves."""
    import sys
    import threading

    from lightning_megatron.checkpointing.save import write_process

    gate = tmp_path / "gate"
    starting = f"import pathlib, sys, time\nwhile not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.05)\n"
    serving = f"import runpy\nrunpy.run_path({str(write_process._MAIN)!r}, run_name='__main__')"  # the real writer
    monkeypatch.setattr(write_process, "COMMAND", [sys.executable, "-c", starting + serving])
    shared = SharedSegments()
    writer = write_process.WriterProcess()
    try:
        tensor = torch.ones(4 << 20)  # not in a segment: sent by value
        handoff = threading.Thread(target=writer.write, args=(_sum_of_buckets, 0, [("f", "k", ([], [("t", tensor)]))],
                                                              shared))  # fmt: skip
        handoff.start()
        handoff.join(timeout=60)  # (a handoff in this thread would wait for the gate, opened below: forever)
        assert not handoff.is_alive()
        assert writer.busy
        assert not writer.done(blocking=False)  # still sending
        gate.touch()
        assert writer.answer() == float(4 << 20)
    finally:
        gate.touch()
        writer.close()
        shared.release()
    assert writer.process.returncode == 0


def _modules(rank: int, buckets: list, results: object) -> None:
    """Which of these modules the writer process has imported (this test module's own imports are all light), and
    the tensors it was handed."""
    import sys

    names = ("lightning", "torchmetrics", "transformers", "lightning_megatron.strategy", "megatron.core.models",
             "megatron.core.transformer", "megatron.core.dist_checkpointing.strategies.filesystem_async")  # fmt: skip
    tensors = [t.tolist() for _, _, (_, items) in buckets for _, t in items]
    results.put(({name for name in names if name in sys.modules}, tensors))


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


def _children() -> list[int]:
    tasks = Path("/proc/self/task")
    return [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]


def _holds_buffers(pid: int) -> bool:
    """Whether process ``pid`` maps a checkpoint buffer segment or holds a descriptor of one."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    fds = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds.append(os.readlink(fd))
        except OSError:
            continue
    return any("lightning_megatron_ckpt_" in text for text in [maps, *fds])


def test_processes_forked_during_a_run_do_not_keep_the_buffers(tmp_path: Path) -> None:
    """A data loader worker forked after the first async saves (a new epoch) and Megatron's result-queue manager hold
    neither the buffers' mappings nor their descriptors (which would keep the memory for as long as they live); the
    writer process maps them."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
    from lightning_megatron.data.corpus import synthetic_tokens
    from tests.conftest import one_process_trainer

    workers = tmp_path / "workers"
    seen: dict[str, bool] = {}

    class Look(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step != 4:  # the second of three batches of the second epoch, after four saves
                return
            writer = trainer.strategy.checkpoint_writer.background.writer.process.pid
            worker = int(workers.read_text().split()[-1])  # this epoch's worker, forked after the saves
            others = [pid for pid in _children() if pid != writer]
            seen["writer"] = _holds_buffers(writer)
            seen["worker alive"] = worker in others
            seen["others"] = not any(_holds_buffers(pid) for pid in others)

    strategy = MegatronStrategy(micro_batch_size=2, async_save=True)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1)
    trainer = one_process_trainer(5, strategy=strategy, callbacks=[Look(), saver], enable_checkpointing=True)
    data = DataLoader(_Recorded(synthetic_tokens(12, 32, 256, seed=2), workers), batch_size=4, num_workers=1)
    trainer.fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data)  # 3 steps an epoch
    assert seen == {"writer": True, "worker alive": True, "others": True}


class _Recorded(torch.utils.data.Dataset):
    """``data``, writing the pid of the process that reads it to ``record`` (a data loader worker's)."""

    def __init__(self, data: torch.Tensor, record: Path) -> None:
        self.data, self.record = data, record

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.record, "a") as file:
            file.write(f"{os.getpid()}\n")
        return self.data[index]
