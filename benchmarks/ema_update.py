"""One EMA update of the 1B Llama shape's weights (bf16 weights, fp32 average), as MegatronEMA runs it after a step.

    python benchmarks/ema_update.py            # on a GPU: eager foreach, compiled, and offloaded to the host

Prints one JSON line per way of updating: milliseconds per update (mean of ``--iters`` after ``--warmup``; 3 after 1
for the offloaded average, ``MegatronEMA(device="cpu")``, whose update copies the weights to the host and waits) and
the bytes it moves at the least (read the average and the weights, write the average: 10 bytes per parameter) per
second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
from lightning_megatron.training import averaging  # noqa: E402


def shapes(layers: int = 16, hidden: int = 2048, ffn: int = 5632, vocab: int = 32000) -> list[tuple[int, ...]]:
    """The 1B Llama shape's parameters (fused QKV and SwiGLU fc1 as Megatron holds them)."""
    layer = [(hidden,), (3 * hidden, hidden), (hidden, hidden), (hidden,), (2 * ffn, hidden), (hidden, ffn)]
    return [(vocab, hidden), *layer * layers, (hidden,), (vocab, hidden)]


def time_update(update: object, averaged: list, current: list, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        update(averaged, current)  # type: ignore[operator]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        update(averaged, current)  # type: ignore[operator]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decay", type=float, default=0.999)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    current = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes()]
    averaged = [c.float() for c in current]
    params = sum(c.numel() for c in current)
    ways = {"eager_foreach": averaging.ema_update_eager, "compiled": averaging.ema_update}
    for name, way in ways.items():
        ms = time_update(lambda a, c, way=way: way(a, c, args.decay), averaged, current, args.warmup, args.iters)
        report(name, ms, params)
    # device="cpu": the average in pinned host memory; each update copies the weights over and waits for them.
    host = [a.to("cpu").pin_memory() for a in averaged]

    def offloaded(a: list, c: list) -> None:
        averaging.ema_update_eager(a, [t.to("cpu") for t in c], args.decay)

    report("offloaded_cpu", time_update(offloaded, host, current, 1, 3), params)


def report(name: str, ms: float, params: int) -> None:
    speed = round(10 * params / ms / 1e6, 1)
    row = {"bench": "ema_update", "way": name, "params": params, "ms": round(ms, 3),
           "gb_per_s_at_10_bytes": speed, "gpu": torch.cuda.get_device_name()}  # fmt: skip
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
