"""Probe: where an async save's writer should run, and from which host memory. Buffers like a checkpoint's staged
tensors -- torch's pinned memory (``cudaHostAlloc``) or memfd shared memory page-locked with ``cudaHostRegister``
(``checkpointing/save/shared_memory.py``) -- are written with ``torch.save`` per tensor into one file (CRC-32 off,
fsync'd, as Megatron's writer does): by the process that holds them, by a process forked for the write (Megatron's
per-save writer), by the persistent writer process (``checkpointing/save/write_process.py``, three times: the first maps
the segments), or by a thread while the main thread runs GPU work that waits on the GPU (a GPU-bound step) or Python
code (a host-bound step). Also times touching one byte of every page in the holder and in a forked child (the page
faults a forked writer pays), and whether a forked child sees the parent's later writes into pinned memory.

    PYTHONPATH=. python benchmarks/writer_probe.py --gb 4 --dir /tmp/probe

(The writer process imports this script as ``writer_probe``, from the benchmarks directory Python puts first on
``sys.path`` when it runs the script.)

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.checkpointing.save.shared_memory import SharedSegments
from lightning_megatron.checkpointing.save.write_process import WriterProcess


def write_all(buffers: list[torch.Tensor], path: Path) -> float:
    start = time.perf_counter()
    with open(path, "wb") as stream:
        for tensor in buffers:
            torch.save(tensor, stream)
        stream.flush()
        os.fsync(stream.fileno())
    return time.perf_counter() - start


def touch(buffers: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for tensor in buffers:
        tensor.view(torch.uint8)[::4096].sum()
    return time.perf_counter() - start


def in_child(target: Callable[[], float]) -> float:
    """Seconds ``target`` took in a forked child (and the fork itself, in the total)."""
    reader, writer = mp.get_context("fork").Pipe(duplex=False)
    process = mp.get_context("fork").Process(target=lambda: writer.send(target()))
    process.start()
    seconds = reader.recv()
    process.join()
    return seconds


def shared_after_fork(buffers: list[torch.Tensor]) -> bool:
    """Whether a child forked before the parent writes into a buffer reads what the parent wrote (a writer forked
    once could then serve later saves from the same buffers)."""
    context = mp.get_context("fork")
    written, answer = context.Event(), context.Queue()
    first = buffers[0]
    first[0] = 1.0
    process = context.Process(target=lambda: (written.wait(), answer.put(float(first[0]))))
    process.start()
    first[0] = 2.0
    written.set()
    value = answer.get()
    process.join()
    return value == 2.0


def busy_gpu(stop: threading.Event) -> int:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    steps = 0
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        float(a[0, 0])  # waits for the GPU, like a step's loss read
        steps += 1
    return steps


def busy_python(stop: threading.Event) -> int:
    steps = 0
    while not stop.is_set():
        sum(i * i for i in range(10_000))  # holds the GIL like a host-bound step's Python
        steps += 1
    return steps


def in_thread(buffers: list[torch.Tensor], path: Path, main: Callable[[threading.Event], int] | None) -> dict:
    result: dict[str, float] = {}
    stop = threading.Event()
    worker = threading.Thread(target=lambda: result.update(write_s=write_all(buffers, path)) or stop.set())
    if main is None:
        worker.start()
        worker.join()
        return result
    # The main thread's rate without the writer, then with it.
    timer = threading.Timer(3.0, stop.set)
    timer.start()
    alone = main(stop) / 3.0
    stop.clear()
    start = time.perf_counter()
    worker.start()
    steps = main(stop)
    worker.join()
    return {**result, "main_steps_per_s_alone": round(alone, 2),
            "main_steps_per_s_while_writing": round(steps / (time.perf_counter() - start), 2)}  # fmt: skip


def in_writer_process(rank: int, buckets: list, results: Any) -> None:
    """Run in the writer process (lightning_megatron.checkpointing.save.write_process): write the buckets' tensors."""
    path, _, (_, tensors) = buckets[0]
    results.put(write_all([t for _, t in tensors], Path(path)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--dir", default="/tmp/writer_probe")
    args = parser.parse_args()
    torch.serialization.set_crc32_options(False)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "shard.distcp"
    count = 128
    per = int(args.gb * 2**30 / 4 / count)
    cuda = torch.cuda.is_available()  # without a GPU (a smoke test): pageable buffers, no GPU-bound run
    device = torch.cuda.get_device_name() if cuda else "cpu"
    common = {"gb": round(count * per * 4 / 1e9, 2), "device": device, "torch": torch.__version__}

    def emit(what: str, **values: Any) -> None:
        rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()}
        print(json.dumps({"what": what, **rounded, **common}), flush=True)

    start = time.perf_counter()
    pinned = [torch.empty(per, pin_memory=cuda).fill_(1.0) for _ in range(count)]
    emit("allocate", kind="cudaHostAlloc", s=time.perf_counter() - start)
    segments = SharedSegments()
    start = time.perf_counter()
    shared = [segments.tensor(torch.Size([per]), torch.float32, pinned=True).fill_(1.0) for _ in range(count)]
    emit("allocate", kind="memfd_registered", s=time.perf_counter() - start)
    for segment in segments.segments.values():  # the package keeps them out of forked children; the probe forks
        segment.view.madvise(mmap.MADV_DOFORK)
    emit("child_sees_later_writes", kind="cudaHostAlloc", shared=shared_after_fork(pinned))
    for kind, buffers in (("cudaHostAlloc", pinned), ("memfd_registered", shared)):
        emit("touch_pages", kind=kind, where="parent", s=touch(buffers))
        emit("touch_pages", kind=kind, where="forked_child", s=in_child(lambda b=buffers: touch(b)))
    writer = WriterProcess()
    function = importlib.import_module("writer_probe").in_writer_process  # importable in the writer process
    runs: list[tuple[str, str, Callable[[], float]]] = []
    for kind, buffers in (("cudaHostAlloc", pinned), ("memfd_registered", shared)):
        runs += [
            (kind, "parent", lambda b=buffers: write_all(b, path)),
            (kind, "forked_child", lambda b=buffers: in_child(lambda: write_all(b, path))),
            (kind, "forked_child_again", lambda b=buffers: in_child(lambda: write_all(b, path))),
        ]
    for again in ("", "_again", "_third"):
        runs.append(
            ("memfd_registered", f"writer_process{again}", lambda: _in_writer(writer, function, segments, shared, path))
        )
    for kind, where, run in runs:
        path.unlink(missing_ok=True)
        os.sync()
        seconds = run()
        emit("write", kind=kind, where=where, write_s=seconds, gb_per_s=common["gb"] / seconds)
    writer.close()
    for where, busy in (("thread_main_gpu_bound", busy_gpu), ("thread_main_python", busy_python)):
        if where == "thread_main_gpu_bound" and not cuda:
            continue
        path.unlink(missing_ok=True)
        os.sync()
        result = in_thread(pinned, path, busy)
        emit("write", kind="cudaHostAlloc", where=where, **result, gb_per_s=common["gb"] / result["write_s"])
    path.unlink(missing_ok=True)
    shared.clear()
    segments.release()


def _in_writer(writer: WriterProcess, function: Any, segments: SharedSegments, tensors: list, path: Path) -> float:
    """Seconds the writer process took to write ``tensors`` (cut from ``segments``) into ``path``."""
    writer.write(function, 0, [(str(path), "key", ([], [(None, t) for t in tensors]))], segments)
    seconds = writer.answer()
    if isinstance(seconds, Exception):
        raise seconds
    return seconds


if __name__ == "__main__":
    main()
