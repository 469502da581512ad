"""What the benchmarks record besides wall time: host-GPU synchronisations and Python's garbage collections in the timed
steps, the model's parameter counts, GPU kernel profiles; and the step count and trace paths every variant of
benchmarks/throughput.py shares."""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time
import traceback
import warnings
from typing import Any

import torch


class SyncCounter:
    """Host-GPU synchronisations (``torch.cuda.set_sync_debug_mode``) between ``start`` and ``stop``, counted by
    the innermost call sites outside torch. Pageable host-to-device copies synchronise inside the driver, unseen."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.counts: collections.Counter[str] = collections.Counter()
        self._context: Any = None

    def start(self) -> None:
        if not self.enabled:
            return
        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record  # restored by the context's exit
        torch.cuda.set_sync_debug_mode("warn")

    def _record(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" not in str(message):
            return  # another warning (e.g. a deprecation) that "always" let through
        frames = [f for f in traceback.extract_stack()[:-1] if not _is_internal(f.filename)]
        sites = " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" for f in reversed(frames[-4:]))
        self.counts[sites] += 1

    def stop(self) -> None:
        if self._context is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._context.__exit__(None, None, None)
            self._context = None


class GcPauses:
    """Python's garbage collections between ``start`` and ``stop`` (``gc.callbacks``): count per generation and
    wall time. A full (generation 2) collection walks every tracked object of the process -- hundreds of thousands
    after importing torch, Megatron and Lightning -- and one falling into the timed steps of one variant only adds its
    pause to that variant's step time."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.gen2_ms: list[float] = []
        self.total_ms = 0.0
        self._began = 0.0

    def _record(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._began) * 1e3
        self.counts[info["generation"]] += 1
        self.total_ms += ms
        if info["generation"] == 2:
            self.gen2_ms.append(round(ms, 1))

    def start(self) -> None:
        if self._record not in gc.callbacks:
            gc.callbacks.append(self._record)

    def stop(self) -> None:
        if self._record in gc.callbacks:
            gc.callbacks.remove(self._record)

    def report(self) -> dict[str, Any]:
        return {"collections": self.counts, "ms": round(self.total_ms, 1), "gen2_ms": self.gen2_ms}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_FILES = (__file__, os.path.join(os.path.dirname(__file__), "throughput.py"))  # the timing code, not a call site


def _is_internal(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename in _OWN_FILES or filename.endswith("/warnings.py")


def total_steps(args: argparse.Namespace) -> int:
    """Warm-up, timed steps, and the host timeline's profiled steps after them."""
    return args.warmup + args.steps + (args.timeline_steps if args.host_timeline else 0)


def timeline_path(args: argparse.Namespace) -> str:
    """Where this rank writes its host-timeline trace (each rank its own file; rank 0's summary is printed)."""
    rank = int(os.environ.get("RANK", 0))
    return f"{args.host_timeline}.{args.variant}.{args.run_index}{f'.rank{rank}' if rank else ''}.json.gz"


def megatron_counts(chunks: list) -> dict[str, int]:
    """Collective over all ranks: the whole model's parameters (every one, and the frozen ones) and the standard MFU
    count's N (trainable, frozen), from this rank's Megatron chunks (bare or wrapped)."""
    from lightning_megatron.parallel.counts import flops_parameters, whole_model_counts

    params = [p for chunk in chunks for p in chunk.parameters()]
    total, frozen = whole_model_counts([params, [p for p in params if not p.requires_grad]], [True, True])
    flops_trainable, flops_frozen = flops_parameters(chunks)
    return {"params": total, "frozen": frozen, "flops_params": flops_trainable, "flops_frozen": flops_frozen}


def hf_counts(model: torch.nn.Module) -> dict[str, int]:
    """:func:`megatron_counts` of a ``transformers`` model (all of it trained): N is every parameter but the input
    embedding table, unless it is tied to the output head (then one parameter, counted once as the head)."""
    total = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter: counted once
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is table
    return {"params": total, "frozen": 0, "flops_params": total if tied else total - table.numel(), "flops_frozen": 0}


def start_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    profiler.start()
    return profiler


def write_profile(profiler: Any, path: str) -> None:
    """The timed steps' top GPU kernels by total time (rank 0)."""
    profiler.stop()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        events = profiler.key_averages()
        # GPU kernel time summed over the profiled steps: wall time minus this is where the GPU waited (host gap).
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # not the CPU ops' share
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3
        table = events.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)
        by_kernel = sorted(kernels, key=lambda e: -e.self_device_time_total)[:60]  # GPU kernels alone, largest first
        rows = [
            f"{e.self_device_time_total / 1e3:10.2f} ms {e.count:6d} x"
            f" {e.self_device_time_total / max(e.count, 1):9.1f} us  {e.key[:110]}"
            for e in by_kernel
        ]
        with open(path, "w") as f:
            f.write(json.dumps({"gpu_kernel_ms_total": round(kernel_ms, 2)}) + "\n" + table + "\n")
            f.write("GPU kernels by self time\n" + "\n".join(rows) + "\n")


def elapsed_ms(fn: Any, iters: int, device: torch.device) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` calls (CUDA events on GPU, the host clock elsewhere)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters
