"""The fp8 cast on GPU as one Triton kernel that writes a tensor in both layouts ``torch._scaled_mm`` needs.

Each fp8 operand of a linear takes part in two GEMMs, once row-major and once column-major (the activation in the
forward and weight-gradient GEMMs, the weight in the forward and input-gradient ones, the output gradient in the
input- and weight-gradient ones). Casting once and copying the transpose afterwards is a strided 1-byte copy, slow
on every GPU (on an H200: 263 us for an [8192, 5632] tensor, against 52 us for this kernel doing cast and
transpose from the same registers). The kernel also turns the amax into the scale and its inverse, which took four
one-element kernels before it (a launch each, and in eager mode the host time of each). Imported only on CUDA
(Triton comes with torch's CUDA builds, not the CPU ones), and by CPU tests that run these kernels in Triton's
interpreter (its fp8 conversion rounds differently from the GPU's: the tests there check everything but the bits).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 64  # 32/64/128 measured within 10% of each other on the H200; 64 keeps the masked edge tiles small
_AMAX_BLOCK = 4096  # elements per program and loop iteration: 16 per thread at 8 warps


@triton.jit
def _amax(x_ptr, amax_ptr, active_ptr, numel, BLOCK: tl.constexpr, GATED: tl.constexpr):
    # Each program takes every num_programs-th block of x, then folds its max |x| into the one-element fp32 at
    # amax_ptr (zeroed by the caller) with one atomic. GATED: as in _cast_transpose, nothing is read while the flag
    # is 0 (the amax stays 0; the cast it feeds is skipped by the same flag).
    live = numel
    if GATED:
        live = tl.where(tl.load(active_ptr) != 0, numel, 0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # int64 loop (its start sets the type): an int32 one would wrap for tensors within a grid's stride of 2**31
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, live, tl.num_programs(0) * BLOCK):
        offsets = tl.arange(0, BLOCK) + start
        x = tl.load(x_ptr + offsets, mask=offsets < live, other=0.0).to(tl.float32)
        # NaN counts as inf (a max would drop it): the scale becomes 0 and the GEMMs non-finite, as with
        # torch's max-norm, which returns NaN.
        acc = tl.maximum(acc, tl.where(x != x, float("inf"), tl.abs(x)))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _cast_transpose(
    x_ptr, amax_ptr, active_ptr, q_ptr, qt_ptr, inv_ptr, M, N,
    FMAX: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    # GATED: nothing is stored while the one-element flag at active_ptr is 0 (a graph-captured weight cast that
    # the replay skips: kernels/fp8.py), as if the tensor had no rows.
    rows_live = M
    if GATED:
        rows_live = tl.where(tl.load(active_ptr) != 0, M, 0)
    # The scale as kernels/fp8.py:_scale computes it on the CPU: IEEE divisions (div_rn; Triton's `/` on fp32 is
    # the approximate one), the amax clamped from below -- with a where, not tl.maximum, which drops a NaN amax
    # for the bound: the inverse scale would then be finite, and a NaN in x, clamped too, would vanish.
    top = tl.load(amax_ptr).to(tl.float32)
    scale = tl.math.div_rn(FMAX, tl.where(top < 1e-12, 1e-12, top))
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    tl.store(inv_ptr, tl.math.div_rn(1.0, scale), mask=first & (rows_live > 0))
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # int64: offsets of >2**31 elements
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (rows[:, None] < rows_live) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(x * scale, -FMAX, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (TRITON_INTERPRET=1: CPU tests) takes CPU tensors
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count * 4


def amax(x: Tensor, active: Tensor | None = None) -> Tensor:
    """``max(|x|)`` of a contiguous CUDA tensor as a one-element fp32 tensor (exact: a max rounds nothing).

    One read of ``x`` by a fixed number of programs (4 per SM). ``active``: a one-element int32 tensor; where it
    holds 0 when the kernel runs, ``x`` is not read and the result is 0.
    """
    _check(x)
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    numel = x.numel()
    grid = (max(1, min(triton.cdiv(numel, _AMAX_BLOCK), _programs(x.device))),)
    gate = active if active is not None else out  # not read when GATED is off
    _amax[grid](x, out, gate, numel, BLOCK=_AMAX_BLOCK, GATED=active is not None, num_warps=8)
    return out


def _check(x: Tensor) -> None:
    # The kernels index x as a dense row-major block; an empty one would leave the inverse scale unwritten (the
    # CPU cast raises on it too).
    if not x.is_contiguous() or x.numel() == 0:
        raise ValueError(f"fp8 casts take a contiguous, non-empty tensor; got shape {tuple(x.shape)}, {x.stride()=}")


def cast_transpose(
    x: Tensor,
    x_amax: Tensor,
    dtype: torch.dtype,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
    active: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``clamp(x * scale)`` cast to fp8 ``dtype``, as [M, N] and as its transpose [N, M], both row-major, and the
    inverse scale (a 0-dim fp32 tensor), where ``scale`` maps ``x_amax`` (a one-element tensor: :func:`amax`) to
    ``dtype``'s largest value.

    ``x``: a contiguous 2-D CUDA tensor. ``out``: the three tensors to write into, else new ones. ``active``: a
    one-element int32 tensor; where it holds 0 when the kernel runs, nothing is written (``out`` keeps its values).
    """
    _check(x)
    m, n = x.shape
    if out is None:
        out = (
            torch.empty((m, n), dtype=dtype, device=x.device),
            torch.empty((n, m), dtype=dtype, device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device),
        )
    q, qt, inv = out
    grid = (triton.cdiv(m, _BLOCK), triton.cdiv(n, _BLOCK))
    gate = active if active is not None else inv  # not read when GATED is off
    fmax = torch.finfo(dtype).max
    _cast_transpose[grid](x, x_amax, gate, q, qt, inv, m, n, FMAX=fmax, BLOCK=_BLOCK, GATED=active is not None)
    return q, qt, inv
