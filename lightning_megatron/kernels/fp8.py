"""fp8 GEMMs for Megatron's parallel linears without Transformer Engine: per-tensor dynamic scaling.

Each of a linear's three GEMMs runs in fp8 through ``torch._scaled_mm``: activations and weights in e4m3, output
gradients in e5m2 (Megatron's "hybrid" recipe), every tensor scaled by its own amax just before the GEMM (no
amax history, hence no state: checkpoints are those of a bf16 run, master weights and optimizer unchanged). The
weight gradient leaves the GEMM in fp32 and is added to ``main_grad``.

No amax is reduced across ranks: under tensor parallelism every GEMM is a rank's own (a weight shard, its input
-- replicated or all-gathered for column-parallel, the rank's slice for row-parallel -- and its output-gradient
shard), and partial results are summed in bf16 as without fp8, so a per-shard scale is exact for that shard.

Each fp8 tensor is cast once into both of its layouts (:func:`quantize_pair`): ``_scaled_mm`` takes its first
operand row-major and its second column-major, and each tensor enters one of its two GEMMs as itself and the other
transposed, so it is needed in both physical layouts.

``_scaled_mm`` needs every GEMM dimension divisible by 16; a call with other shapes (e.g. a token budget's odd
micro-batch) runs that linear in bf16 instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` has fp8 tensor cores (compute capability >= 8.9: Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _quantize(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x`` cast to fp8 ``dtype`` with the per-tensor scale that maps its amax to fp8's largest value.

    Returns the fp8 tensor and the inverse scale (what ``_scaled_mm`` multiplies the product by).
    """
    fmax = torch.finfo(dtype).max
    scale, inv = _scale(x.abs().amax(), dtype)
    quantized = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return quantized, inv


def _scale(amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The scale mapping ``amax`` to fp8 ``dtype``'s largest value, and its inverse (as :func:`_quantize`)."""
    scale = torch.finfo(dtype).max / amax.float().clamp(min=1e-12)
    return scale, scale.reciprocal()


def quantize_pair(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """A 2-D ``x`` cast as :func:`_quantize` does, in both layouts: ``(q [M, N], q.t() [N, M] row-major, inverse
    scale)`` -- the row- and the column-major operand of the two GEMMs each fp8 tensor takes part in.

    On GPU: the amax as a max-norm (one read of ``x``), then one Triton kernel writing both layouts
    (:mod:`lightning_megatron.kernels.fp8_triton`); elsewhere :func:`_quantize` and a transposed copy.
    """
    x = x.detach().contiguous()
    if not x.is_cuda:
        q, inv = _quantize(x, dtype)
        return q, q.t().contiguous(), inv
    from lightning_megatron.kernels.fp8_triton import cast_transpose

    scale, inv = _scale(torch.linalg.vector_norm(x, float("inf")), dtype)  # the amax, exact in x's dtype
    return (*cast_transpose(x, scale, dtype), inv)


def scaled_mm(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a * a_inv) @ (b * b_inv)`` from fp8 operands: [M, K] @ [K, N] -> [M, N] in ``out_dtype``.

    ``_scaled_mm`` wants ``a`` row-major and ``b`` column-major. Callers pass them so (:func:`quantize_pair` gives
    both layouts); any other layout raises rather than being copied here, a cost that would otherwise go unseen.
    """
    if not a.is_contiguous() or b.stride(0) != 1:
        raise ValueError(
            f"scaled_mm needs a row-major first operand and a column-major second one; got strides {a.stride()} "
            f"and {b.stride()}: pass quantize_pair's other layout (its transpose) instead"
        )
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


def gemm_shapes_ok(*dims: int) -> bool:
    """Whether ``_scaled_mm`` takes GEMMs with these dimensions (all divisible by 16)."""
    return all(d % 16 == 0 for d in dims)
