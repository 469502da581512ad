"""Host timeline of a few training steps (benchmarks/throughput.py ``--host-timeline``): where the GPU waits.

After the timed steps, ``torch.profiler`` (CPU and CUDA activities, no stacks) records ``--timeline-steps`` more
steps with named host ranges around the step's parts: every Lightning hook and loop action (a Lightning
``Profiler`` that opens ``record_function`` ranges, variants a and c), Megatron's forward/backward step and
gradient finalisation, the optimizer's parts, and this package's step functions. :func:`analyze` then reads the
Chrome trace: the GPU's busy time (the union of kernels, copies and fills), its idle time per step, and for the
idle time what the host was doing meanwhile -- the innermost named range and the innermost torch op running on the
main thread at each idle instant. Also run standalone on a saved trace: ``python benchmarks/host_timeline.py
TRACE.json.gz [STEPS]``.
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_NAMED = "user_annotation"


def _enabled() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def annotate(obj: Any, attr: str, label: str) -> None:
    """Wrap ``obj.attr`` so that, while a profiler records, each call is a ``record_function`` range ``label``."""
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not _enabled():
            return fn(*args, **kwargs)
        with torch.autograd.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


def annotate_megatron() -> None:
    """Ranges around Megatron-Core's per-micro-batch forward/backward step (both variants)."""
    from megatron.core.pipeline_parallel import schedules

    annotate(schedules, "forward_step", "mcore.forward_step")
    annotate(schedules, "backward_step", "mcore.backward_step")


def annotate_optimizer(optimizer: Any, scheduler: Any = None) -> None:
    """Ranges around Megatron's optimizer step and those of its parts it calls as methods of this object (the gradient
    norm's host read shows up as a ``cudaStreamSynchronize`` inside ``opt.step``)."""
    for attr in ("step", "prepare_grads", "clip_grad_norm", "step_with_ready_grads", "zero_grad"):
        if hasattr(optimizer, attr):
            annotate(optimizer, attr, f"opt.{attr}")
    if scheduler is not None:
        annotate(scheduler, "step", "lr_scheduler.step")


def annotate_chunks(chunks: list[Any]) -> None:
    for chunk in chunks:
        annotate(chunk, "zero_grad_buffer", "ddp.zero_grad_buffer")
    config = chunks[0].config
    if getattr(config, "finalize_model_grads_func", None) is not None:
        annotate(config, "finalize_model_grads_func", "mcore.finalize_model_grads")


def annotate_strategy() -> None:
    """Ranges around the adapter's per-step functions (variant a)."""
    from lightning_megatron import schedule
    from lightning_megatron.modules.base import MegatronLightningModule

    for name in ("run", "reduce_step", "train_metrics", "step_logs"):
        annotate(schedule, name, f"lm.schedule.{name}")
    annotate(MegatronLightningModule, "log_train_step", "lm.log_train_step")


def annotate_lightning_loop() -> None:
    """Ranges around Lightning's per-step loop work that its profiler does not name (variants a and c)."""
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    annotate(_TrainingEpochLoop, "advance", "pl.loop.advance")
    annotate(_TrainingEpochLoop, "on_advance_end", "pl.loop.on_advance_end")
    annotate(_TrainingEpochLoop, "update_lr_schedulers", "pl.loop.update_lr_schedulers")
    annotate(_AutomaticOptimization, "run", "pl.automatic_optimization.run")
    for name in ("on_batch_start", "on_batch_end", "update_train_step_metrics"):
        annotate(_LoggerConnector, name, f"pl.logger_connector.{name}")


def lightning_profiler() -> Any:
    """A Lightning profiler whose actions (every hook, the dataloader's next, the optimizer step) are host ranges."""
    from lightning.pytorch.profilers import Profiler

    class Ranges(Profiler):
        def __init__(self) -> None:
            super().__init__()
            self._open: dict[str, list[Any]] = collections.defaultdict(list)

        def start(self, action_name: str) -> None:
            if _enabled():
                handle = torch.ops.profiler._record_function_enter_new(f"pl:{action_name}", None)
                self._open[action_name].append(handle)

        def stop(self, action_name: str) -> None:
            if self._open.get(action_name):
                torch.ops.profiler._record_function_exit._RecordFunction(self._open[action_name].pop())

        def summary(self) -> str:
            return ""

    return Ranges()


_GC_OPEN: list[Any] = []


def _gc_range(phase: str, info: dict[str, Any]) -> None:
    """Python's garbage collections as host ranges ``gc.gen<N>`` while a profiler records."""
    if phase == "start" and _enabled():
        _GC_OPEN.append(torch.ops.profiler._record_function_enter_new(f"gc.gen{info['generation']}", None))
    elif phase == "stop" and _GC_OPEN:
        torch.ops.profiler._record_function_exit._RecordFunction(_GC_OPEN.pop())


def start() -> Any:
    import gc

    from torch.profiler import ProfilerActivity, profile

    if _gc_range not in gc.callbacks:
        gc.callbacks.append(_gc_range)
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    profiler.start()
    return profiler


def stop(profiler: Any, path: str, steps: int) -> dict[str, Any]:
    """Stop, write the trace to ``path`` (gzipped) and return :func:`analyze`'s summary."""
    torch.cuda.synchronize()
    profiler.stop()
    raw = path[: -len(".gz")] if path.endswith(".gz") else path
    profiler.export_chrome_trace(raw)
    with open(raw, "rb") as f:
        trace = json.load(f)
    if path.endswith(".gz"):
        with open(raw, "rb") as f, gzip.open(path, "wb", compresslevel=6) as out:
            out.write(f.read())
        os.remove(raw)
    return analyze(trace, steps)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(b, e) for b, e in merged]


def analyze(trace: dict[str, Any], steps: int, min_gap_us: float = 5.0) -> dict[str, Any]:
    """GPU idle time over the profiled window (first kernel start to last kernel end), in ms per step, and what the
    host's main thread ran during it: the innermost named range and the innermost torch op at each idle instant
    (sampled every 2 us of idle time, coarser beyond 0.4 s of idle time)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in _GPU_CATS]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    busy = _merge(gpu)
    window = (busy[0][0], busy[-1][1])
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False) if b[0] - a[1] >= min_gap_us]
    idle = sum(e - b for b, e in gaps)
    cpu = [e for e in events if e.get("cat") in ("cpu_op", _NAMED, "cuda_runtime", "python_function")]
    # The main thread: the one with the most named ranges (Lightning's loop, the schedule).
    named_per_tid = collections.Counter(e["tid"] for e in cpu if e.get("cat") == _NAMED)
    main = (named_per_tid or collections.Counter(e["tid"] for e in cpu)).most_common(1)[0][0]
    mine = sorted(
        ((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"], e.get("cat")) for e in cpu if e["tid"] == main),
        key=lambda x: (x[0], -x[1]),
    )
    cursor = {"i": 0, "stack": []}

    def covering(t: float) -> list[tuple[float, float, str, str]]:
        # Sweep (t never decreases): the events running at t, outermost first (nested per thread).
        i, stack = cursor["i"], cursor["stack"]
        while i < len(mine) and mine[i][0] <= t:
            stack.append(mine[i])
            i += 1
        cursor["i"], cursor["stack"] = i, [m for m in stack if m[1] > t]
        return cursor["stack"]

    by_range: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    by_chain: collections.Counter[str] = collections.Counter()
    big = set(sorted(gaps, key=lambda g: g[0] - g[1])[:25])
    big_gaps = []
    sample = max(2.0, idle / 200_000)  # us of idle time per sample: at most ~200k samples
    for begin, end in gaps:
        t = begin + min(sample, end - begin) / 2
        while t < end:
            chain = covering(t)
            named = [c[2] for c in chain if c[3] == _NAMED]
            ops = [c[2] for c in chain if c[3] != _NAMED]
            by_range[named[-1] if named else "(no range)"] += sample
            by_op[ops[-1] if ops else "(python, no op)"] += sample
            by_chain[" > ".join(named[-3:]) + (" | " + ops[-1] if ops else "")] += sample
            if (begin, end) in big and t + sample >= end:
                big_gaps.append({
                    "at_ms": round((begin - window[0]) / 1e3, 3), "us": round(end - begin, 1),
                    "host_at_end": " > ".join(c[2] for c in chain[-6:]),
                })  # fmt: skip
            t += sample
    # Host time per step of each named range (inclusive), the host's waits for the GPU (synchronisations), the
    # torch ops and kernel launches under each range, each op's self time, and the compiled regions entered.
    range_ms: collections.Counter[str] = collections.Counter()
    range_n: collections.Counter[str] = collections.Counter()
    waits: collections.Counter[str] = collections.Counter()
    ops_in: collections.Counter[str] = collections.Counter()
    launches_in: collections.Counter[str] = collections.Counter()
    op_self: collections.Counter[str] = collections.Counter()
    compiled: collections.Counter[str] = collections.Counter()
    stack: list[tuple[float, float, str, str]] = []
    for b, e, name, cat in mine:
        stack = [m for m in stack if m[1] > b]
        named = [m[2] for m in stack if m[3] == _NAMED]
        where = named[-1] if named else "(no range)"
        if cat == _NAMED:
            range_ms[name] += (e - b) / 1e3
            range_n[name] += 1
        if cat == "cuda_runtime" and ("ynchronize" in name or (name.startswith("cudaMemcpy") and e - b > 50)):
            waits[f"{name} in {where}"] += e - b
        if cat == "cuda_runtime" and "Launch" in name:
            launches_in[where] += 1
        if cat == "cpu_op":
            if not stack or stack[-1][3] == _NAMED:  # a top-level op (not called by another op)
                ops_in[where] += 1
            if stack and stack[-1][3] == "cpu_op":
                op_self[stack[-1][2]] -= e - b  # the caller's self time excludes this op
            op_self[name] += e - b
            if name.startswith("Torch-Compiled Region"):
                compiled[name] += 1
        stack.append((b, e, name, cat))

    def per_step(counter: collections.Counter[str], n: int = 25) -> dict[str, float]:
        return {k: round(v / 1e3 / steps, 3) for k, v in counter.most_common(n)}

    wall = (window[1] - window[0]) / 1e3
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall / steps, 3),
        "gpu_busy_ms_per_step": round(sum(e - b for b, e in busy) / 1e3 / steps, 3),
        "gpu_idle_ms_per_step": round(idle / 1e3 / steps, 3),
        "gpu_idle_incl_short_gaps_ms_per_step": round((wall - sum(e - b for b, e in busy) / 1e3) / steps, 3),
        "host_waits_ms_per_step": per_step(waits, 10),
        "idle_gaps_per_step": round(len(gaps) / steps, 1),
        "idle_by_range_ms_per_step": per_step(by_range),
        "idle_by_op_ms_per_step": per_step(by_op),
        "idle_by_chain_ms_per_step": per_step(by_chain, 30),
        "host_range_ms_per_step": {k: round(v / steps, 3) for k, v in range_ms.most_common(45)},
        "host_range_calls_per_step": {k: round(range_n[k] / steps, 1) for k, _ in range_ms.most_common(45)},
        "top_level_ops_per_step_by_range": {k: round(v / steps, 1) for k, v in ops_in.most_common(20)},
        "kernel_launches_per_step_by_range": {k: round(v / steps, 1) for k, v in launches_in.most_common(20)},
        "op_self_host_ms_per_step": per_step(op_self, 30),
        "compiled_regions_per_step": {k: round(v / steps, 1) for k, v in compiled.most_common(20)},
        "largest_gaps": big_gaps,
    }


def brief(summary: dict[str, Any]) -> str:
    """A few lines of :func:`analyze`'s summary (what a run's last output lines should hold)."""

    def top(key: str, n: int) -> str:
        return ", ".join(f"{k}={v}" for k, v in list(summary.get(key, {}).items())[:n])

    head = {k: summary.get(k) for k in ("variant", "wall_ms_per_step", "gpu_busy_ms_per_step", "gpu_idle_ms_per_step")}
    lines = [
        f"== {head}",
        f"  waits: {top('host_waits_ms_per_step', 4)}",
        f"  idle by range: {top('idle_by_range_ms_per_step', 10)}",
        f"  idle by op: {top('idle_by_op_ms_per_step', 8)}",
        f"  host ranges ms: {top('host_range_ms_per_step', 30)}",
        f"  top-level ops: {top('top_level_ops_per_step_by_range', 10)}",
        f"  launches: {top('kernel_launches_per_step_by_range', 8)}",
        f"  op self ms: {top('op_self_host_ms_per_step', 14)}",
        f"  compiled: {top('compiled_regions_per_step', 10)}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    path, steps = argv[0], int(argv[1]) if len(argv) > 1 else 3
    opener: Callable[..., Any] = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        print(json.dumps(analyze(json.load(f), steps), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
