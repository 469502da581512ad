"""Probe: would fp8 grouped GEMMs speed up the MoE experts? The six grouped GEMMs of a SwiGLU expert MLP's forward
and backward (fc1 and fc2: forward, input gradient, weight gradient) in bf16 (``torch._grouped_mm``) against fp8
e4m3 with row-wise scales (``torch._scaled_grouped_mm``, the scaling it supports on Hopper), the fp8 GEMMs timed
alone and with the casts they need (row-wise for the forward and input-gradient operands, per expert and column for
the weight-gradient ones; compiled with ``torch.compile``).

    PYTHONPATH=. python benchmarks/moe_fp8_probe.py [--tokens 8192 --experts 32 --topk 8 --hidden 2048 --ffn 768]

The default is the ~1B-active MoE's micro-batch (4 x 2048 tokens) in one layer. Rows per expert are equal and
multiples of 16 (fp8 grouped GEMMs need aligned groups). Prints one JSON line per GEMM (bf16 and fp8
milliseconds by CUDA events, TFLOP/s, fp8's relative error against bf16, or the error the fp8 kernel raised), then
one with the totals and the compiled casts' time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: benchmarks.*
from benchmarks.recorders import elapsed_ms  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``t`` [M, K] scaled to e4m3's range: the fp8 tensor (row-major) and the inverse scales [M]."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (t.float() * scale).to(E4M3), (1.0 / scale).squeeze(-1)


def weight_colwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [E, N, K] as ``_scaled_grouped_mm``'s second operand [E, K, N] (column-major), scaled per output
    column: the fp8 tensor and the inverse scales [E, N]."""
    amax = w.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (w.float() * scale).to(E4M3).contiguous().transpose(-2, -1), (1.0 / scale).squeeze(-1)


def grouped_colwise(t: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [R, K] whose rows form ``groups`` equal groups, scaled per group and column, transposed to [K, R]
    row-major (the weight gradient's first operand): the fp8 tensor and the inverse scales [groups * K]."""
    rows, cols = t.shape
    blocks = t.view(groups, rows // groups, cols)
    amax = blocks.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)  # [G, 1, K]
    scale = E4M3_MAX / amax
    q = (blocks.float() * scale).to(E4M3).view(rows, cols).t().contiguous()
    return q, (1.0 / scale).reshape(-1)


def grouped_rowwise_colmajor(t: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [R, N] as the weight gradient's second operand: [R, N] column-major, scaled per group and column."""
    q, inverse = grouped_colwise(t, groups)
    return q.t(), inverse


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return elapsed_ms(fn, iters, torch.device("cuda"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    E, H, F = args.experts, args.hidden, args.ffn
    per_expert = (args.tokens * args.topk // E) // 16 * 16
    R = per_expert * E
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * per_expert
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, h = torch.randn(R, H, **bf), torch.randn(R, F, **bf)  # fc1's input, fc2's input (after SwiGLU)
    dy, dz = torch.randn(R, H, **bf), torch.randn(R, 2 * F, **bf)  # fc2's and fc1's output gradients
    w1, w2 = torch.randn(E, 2 * F, H, **bf) / H**0.5, torch.randn(E, H, F, **bf) / F**0.5

    bf16 = {  # (a, b) of each GEMM in torch._grouped_mm's layout
        "fc1_forward": (x, w1.transpose(-2, -1)),
        "fc2_forward": (h, w2.transpose(-2, -1)),
        "fc2_input_grad": (dy, w2),
        "fc1_input_grad": (dz, w1),
        "fc2_weight_grad": (dy.t(), h),
        "fc1_weight_grad": (dz.t(), x),
    }

    def casts() -> dict:
        return {
            "fc1_forward": (rowwise(x), weight_colwise(w1)),
            "fc2_forward": (rowwise(h), weight_colwise(w2)),
            "fc2_input_grad": (rowwise(dy), weight_colwise(w2.transpose(-2, -1))),
            "fc1_input_grad": (rowwise(dz), weight_colwise(w1.transpose(-2, -1))),
            "fc2_weight_grad": (grouped_colwise(dy, E), grouped_rowwise_colmajor(h, E)),
            "fc1_weight_grad": (grouped_colwise(dz, E), grouped_rowwise_colmajor(x, E)),
        }

    def fp8_mm(pair: tuple) -> torch.Tensor:
        (qa, sa), (qb, sb) = pair
        return torch._scaled_grouped_mm(qa, qb, sa, sb, offs=offs, out_dtype=torch.bfloat16)

    common = {"routed_rows": R, "num_moe_experts": E, "moe_router_topk": args.topk, "hidden_size": H,
              "moe_ffn_hidden_size": F, "device": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    compiled_casts = torch.compile(casts)
    quantized = compiled_casts()
    gemm_flops = {name: 2 * R * H * (2 * F if "fc1" in name else F) for name in bf16}
    totals = {"bf16": 0.0, "fp8": 0.0}
    for name, (a, b) in bf16.items():
        row = {"gemm": name, **common}
        row["bf16_ms"] = time_ms(lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs), args.iters, args.warmup)
        totals["bf16"] += row["bf16_ms"]
        try:
            out = fp8_mm(quantized[name]).float()
            ref = torch._grouped_mm(a, b, offs=offs).float()
            row["fp8_rel_error"] = round(float((out - ref).norm() / ref.norm()), 4)
            row["fp8_ms"] = time_ms(lambda q=quantized[name]: fp8_mm(q), args.iters, args.warmup)
            totals["fp8"] += row["fp8_ms"]
        except Exception as error:  # noqa: BLE001 -- a layout the kernel refuses is a result here
            row["fp8_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            totals["fp8"] = float("nan")  # no total: a GEMM has no fp8 time
        for key in ("bf16", "fp8"):
            if f"{key}_ms" in row:
                row[f"{key}_tflops"] = round(gemm_flops[name] / row[f"{key}_ms"] / 1e9, 1)
                row[f"{key}_ms"] = round(row[f"{key}_ms"], 3)
        print(json.dumps(row), flush=True)
    casts_ms = time_ms(compiled_casts, args.iters, args.warmup)
    fp8_total = None if totals["fp8"] != totals["fp8"] else round(totals["fp8"], 3)
    print(json.dumps({"gemm": "all six", **common, "bf16_ms": round(totals["bf16"], 3), "fp8_ms": fp8_total,
                      "fp8_casts_compiled_ms": round(casts_ms, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
