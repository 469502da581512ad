"""fp8 probe (one GPU): what quantizing one tensor and getting both of its layouts costs at the 1B shape.

    python benchmarks/fp8_quantize_probe.py

For bf16 tensors of the 1B shape's sizes at 8192 tokens -- [8192, 2048] (an activation), [8192, 5632] (fc2's input)
and [5632, 2048] (fc2's weight, transposed) -- microseconds per call of: the one-layout cast
``kernels.fp8._quantize`` (compiled, amax included), the amax two ways, the transposed copy ``_scaled_mm``'s layouts
need (fp8 and bf16), the Triton kernel of ``kernels/fp8_triton.py`` writing the e4m3 tensor in both layouts given
the scale (amax not included), ``quantize_pair`` (amax, scale and that kernel), whether the kernel's bits equal the
compiled cast's, and an fp8 against a bf16 GEMM of the same size.
Everything is e4m3 (gradients are e5m2 in training: not probed). Prints one JSON line per tensor.

Caveats: back-to-back calls timed with CUDA events, so the host's launch cost counts (the Triton launcher, two
``torch.empty`` and the scale's small ops per call), and inputs stay in the L2 cache between calls.
Results: call 2 of benchmarks/results/2026-12-02-h200-fp8-cast-transpose-graphs.jsonl (one H200, torch 2.11); the
earlier ``...-fp8-cast-transpose-probe.jsonl`` is of this script's previous version (its own kernel at three tiles).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from lightning_megatron.kernels import fp8
from lightning_megatron.kernels.fp8_triton import cast_transpose

SHAPES = {"x_2048": (8192, 2048), "g_5632": (8192, 5632), "w_5632x2048": (5632, 2048)}


def bench(fn: Callable[[], object], n: int = 50) -> float:
    """Mean microseconds per call over ``n`` calls after 5 warm-up calls (CUDA events)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / n * 1000, 1)


def probe(m: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    single = torch.compile(fp8._quantize)  # the one-layout cast of the code before quantize_pair
    q, inv = single(x, fp8.E4M3)
    scale = inv.reciprocal()
    r: dict = {"shape": [m, k]}
    r["quantize_compiled"] = bench(lambda: single(x, fp8.E4M3))
    r["amax_abs_amax"] = bench(lambda: x.abs().amax())
    r["amax_vector_norm_inf"] = bench(lambda: torch.linalg.vector_norm(x, float("inf")))
    r["transpose_copy_fp8"] = bench(lambda: q.t().contiguous())
    r["transpose_copy_bf16"] = bench(lambda: x.t().contiguous())
    r["triton_ct_64"] = bench(lambda: cast_transpose(x, scale, fp8.E4M3))
    r["quantize_pair"] = bench(lambda: fp8.quantize_pair(x, fp8.E4M3))  # amax + scale + both layouts
    q64, qt64 = cast_transpose(x, scale, fp8.E4M3)
    r["triton_bits_equal"] = bool(torch.equal(q64.view(torch.uint8), q.view(torch.uint8)))
    r["triton_t_equal"] = bool(torch.equal(qt64.view(torch.uint8), q64.t().contiguous().view(torch.uint8)))
    w8 = single(torch.randn(2048, k, device="cuda", dtype=torch.bfloat16), fp8.E4M3)[0]
    r["scaled_mm_fwd_like"] = bench(
        lambda: torch._scaled_mm(q, w8.t(), scale_a=inv, scale_b=inv, out_dtype=torch.bfloat16)
    )  # [m, k] @ [k, 2048]
    r["bf16_mm_same"] = bench(lambda: x @ x[:2048].t())
    return r


if __name__ == "__main__":
    for name, (m, k) in SHAPES.items():
        print(json.dumps({"tensor": name, **probe(m, k)}), flush=True)
