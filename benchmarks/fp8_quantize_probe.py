"""fp8 probe (one GPU): what the casts of one linear's operands cost, at the 1B and 3B shapes' sizes.

    python benchmarks/fp8_quantize_probe.py

For bf16 tensors of the sizes the linears cast -- activations and output gradients at 8192 (1B) and 4096 (3B)
tokens, and weights -- microseconds per call of: the amax as torch's max-norm (``vector_norm(x, inf)``) and as the
Triton kernel ``fp8_triton.amax`` (gated on and off), whether the two agree exactly, the Triton cast into both
layouts given the amax, ``quantize_pair`` (amax and cast), and the same replayed from a CUDA graph (no launch cost).
Prints one JSON line per tensor.

Caveats: back-to-back calls timed with CUDA events, so eager numbers include the host's launch cost, and inputs up
to the L2 cache's size (50 MB) stay cached between calls.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: benchmarks.*
from benchmarks.recorders import elapsed_ms  # noqa: E402
from lightning_megatron.kernels import fp8  # noqa: E402
from lightning_megatron.kernels.fp8_triton import amax, cast_transpose  # noqa: E402

SHAPES = {
    "1b_x": (8192, 2048), "1b_fc2_in": (8192, 5632), "1b_fc1_w": (11264, 2048),
    "3b_x": (4096, 3072), "3b_fc1_grad": (4096, 16384), "3b_fc1_w": (16384, 3072), "3b_fc2_w": (3072, 8192),
}  # fmt: skip


def bench(fn: Callable[[], object], n: int = 50) -> float:
    """Mean microseconds per call over ``n`` calls after 5 warm-up calls (CUDA events)."""
    for _ in range(5):
        fn()
    return round(elapsed_ms(fn, n, torch.device("cuda")) * 1000, 1)


def graphed(fn: Callable[[], object], n: int = 20) -> float:
    """Microseconds per call of ``fn`` captured ``n`` times in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return round(bench(graph.replay, 10) / n, 1)


def probe(m: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    on, off = torch.ones((), dtype=torch.int32, device="cuda"), torch.zeros((), dtype=torch.int32, device="cuda")
    r: dict = {"shape": [m, k], "mbytes": round(x.numel() * 2 / 1e6, 1)}
    r["amax_equal"] = bool(amax(x).item() == torch.linalg.vector_norm(x, float("inf")).float().item())
    r["amax_vector_norm"] = bench(lambda: torch.linalg.vector_norm(x, float("inf")))
    r["amax_triton"] = bench(lambda: amax(x))
    r["amax_vector_norm_graphed"] = graphed(lambda: torch.linalg.vector_norm(x, float("inf")))
    r["amax_triton_graphed"] = graphed(lambda: amax(x, on))
    r["amax_triton_gated_off_graphed"] = graphed(lambda: amax(x, off))
    a = amax(x)
    r["cast_transpose_graphed"] = graphed(lambda: cast_transpose(x, a, fp8.E4M3))
    r["quantize_pair"] = bench(lambda: fp8.quantize_pair(x, fp8.E4M3))
    r["quantize_pair_graphed"] = graphed(lambda: fp8.quantize_pair(x, fp8.E4M3))
    return r


if __name__ == "__main__":
    for name, (m, k) in SHAPES.items():
        print(json.dumps({"tensor": name, **probe(m, k)}), flush=True)
