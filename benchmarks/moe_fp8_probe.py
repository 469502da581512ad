"""Probe: would fp8 grouped GEMMs speed up the MoE experts? The six grouped GEMMs of a SwiGLU expert MLP's forward
and backward (fc1 and fc2: forward, input gradient, weight gradient) in bf16 (``torch._grouped_mm``) against fp8
e4m3 with row-wise scales (``torch._scaled_grouped_mm``, the scaling it supports on Hopper), the fp8 GEMMs timed
alone and with the casts they need (row-wise for the forward and input-gradient operands, per expert and column for
the weight-gradient ones; compiled with ``torch.compile``).

    PYTHONPATH=. python benchmarks/moe_fp8_probe.py [--tokens 8192 --experts 32 --topk 8 --hidden 2048 --ffn 768]

The default is the ~1B-active MoE's micro-batch (4 x 2048 tokens) in one layer. Rows per expert are equal and
multiples of 16 (fp8 grouped GEMMs need aligned groups). Prints one JSON line per variant: milliseconds per
forward + backward of the GEMMs (CUDA events), and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

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
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


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

    def bf16_gemms() -> None:
        torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)  # fc1 forward [R, 2F]
        torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # fc2 forward [R, H]
        torch._grouped_mm(dy, w2, offs=offs)  # fc2 input gradient [R, F]
        torch._grouped_mm(dz, w1, offs=offs)  # fc1 input gradient [R, H]
        torch._grouped_mm(dy.t(), h, offs=offs)  # fc2 weight gradient [E, H, F]
        torch._grouped_mm(dz.t(), x, offs=offs)  # fc1 weight gradient [E, 2F, H]

    def casts() -> list:
        return [
            rowwise(x), weight_colwise(w1), rowwise(h), weight_colwise(w2),  # forward
            rowwise(dy), weight_colwise(w2.transpose(-2, -1)), rowwise(dz), weight_colwise(w1.transpose(-2, -1)),
            grouped_colwise(dy, E), grouped_rowwise_colmajor(h, E), grouped_colwise(dz, E),
            grouped_rowwise_colmajor(x, E),
        ]  # fmt: skip

    compiled_casts = torch.compile(casts)

    def fp8_gemms(q: list) -> None:
        pairs = [(0, 1, offs), (2, 3, offs), (4, 5, offs), (6, 7, offs), (8, 9, offs), (10, 11, offs)]
        for a, b, o in pairs:
            (qa, sa), (qb, sb) = q[a], q[b]
            torch._scaled_grouped_mm(qa, qb, sa, sb, offs=o, out_dtype=torch.bfloat16)

    flops = 3 * 2 * R * H * 3 * F
    common = {"routed_rows": R, "num_moe_experts": E, "moe_router_topk": args.topk, "hidden_size": H,
              "moe_ffn_hidden_size": F, "device": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    quantized = compiled_casts()
    rows = {
        "bf16_grouped_mm": time_ms(bf16_gemms, args.iters, args.warmup),
        "fp8_gemms_alone": time_ms(lambda: fp8_gemms(quantized), args.iters, args.warmup),
        "fp8_casts_compiled": time_ms(compiled_casts, args.iters, args.warmup),
        "fp8_casts_and_gemms": time_ms(lambda: fp8_gemms(compiled_casts()), args.iters, args.warmup),
    }
    error = _error(quantized, x, w1, offs)
    for variant, ms in rows.items():
        row = {"variant": variant, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), **common}
        print(json.dumps(row | ({"fc1_forward_rel_error": error} if variant == "fp8_gemms_alone" else {})))


def _error(quantized: list, x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor) -> float:
    """The fp8 fc1 forward's relative error against bf16 (a check that the operands are laid out right)."""
    (qa, sa), (qb, sb) = quantized[0], quantized[1]
    fp8 = torch._scaled_grouped_mm(qa, qb, sa, sb, offs=offs, out_dtype=torch.bfloat16).float()
    ref = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).float()
    return round(float((fp8 - ref).norm() / ref.norm()), 4)


if __name__ == "__main__":
    main()
