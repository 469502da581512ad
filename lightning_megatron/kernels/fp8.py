"""fp8 GEMMs for Megatron's parallel linears without Transformer Engine: per-tensor dynamic scaling.

Each of a linear's three GEMMs runs in fp8 through ``torch._scaled_mm``: activations and weights in e4m3, output
gradients in e5m2 (Megatron's "hybrid" format) or e4m3 (its "e4m3" format), every tensor scaled by its own amax
just before the GEMM (no amax history, hence nothing to checkpoint: checkpoints are those of a bf16 run, master
weights and optimizer unchanged). The weight gradient leaves the GEMM in fp32 and is added to ``main_grad``.

No amax is reduced across ranks: under tensor parallelism every GEMM is a rank's own (a weight shard, its input
-- replicated or all-gathered for column-parallel, the rank's slice for row-parallel -- and its output-gradient
shard), and partial results are summed in bf16 as without fp8, so a per-shard scale is exact for that shard.

Each fp8 tensor is cast once into both of its layouts (:func:`quantize_pair`): ``_scaled_mm`` takes its first
operand row-major and its second column-major, and each tensor enters one of its two GEMMs as itself and the other
transposed, so it is needed in both physical layouts.

A weight's cast is kept between calls (:func:`quantize_weight`) and reused while the weight is unchanged: a model
chunk's first micro-batch of a step casts its weights, the later ones (and evaluation between steps) reuse the casts.
A cast is current while the weight keeps its storage, shape and autograd version counter (``Tensor._version``, bumped
by in-place ops on the parameter itself) and no :func:`weights_changed` came since it was made. Megatron's optimizer
writes the updated weights through other tensors -- the DDP parameter buffer (distributed optimizer: main shards
copied into it, then all-gathered) or ``param.data`` (``Float16OptimizerWithFloat16Params``) -- which leave the
parameter's version counter as it was, so the strategy has the optimizer-step wrapper (``training/optim.py``)
call :func:`weights_changed` after each update. The kept casts take 2 bytes per weight element of GPU memory until the
strategy's teardown or ``offload()`` drops them (:func:`forget_weight_casts`).

``_scaled_mm`` needs every GEMM dimension divisible by 16; a call with other shapes (e.g. a token budget's odd
micro-batch) runs that linear in bf16 instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

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


def quantize_pair(
    x: Tensor, dtype: torch.dtype, out: tuple[Tensor, Tensor, Tensor] | None = None, active: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """A 2-D ``x`` cast as :func:`_quantize` does, in both layouts: ``(q [M, N], q.t() [N, M] row-major, inverse
    scale)`` -- the row- and the column-major operand of the two GEMMs each fp8 tensor takes part in.

    On GPU the amax (one read of ``x``), then a Triton kernel writing both layouts and the inverse scale
    (:mod:`lightning_megatron.kernels.fp8_triton`); elsewhere :func:`_quantize` and a transposed copy.
    ``out``: the three tensors to write into (else new ones); ``active`` (GPU only): a one-element int32 tensor,
    neither read nor written while it holds 0 (a graph-captured cast that replays may skip).
    """
    x = x.detach().contiguous()
    if not x.is_cuda:
        if out is not None or active is not None:
            raise ValueError("quantize_pair writes into given tensors (out, active) on GPU only")
        q, inv = _quantize(x, dtype)
        return q, q.t().contiguous(), inv
    from lightning_megatron.kernels.fp8_triton import amax, cast_transpose

    if active is None and not torch.cuda.is_current_stream_capturing():
        # Eager: torch's max-norm (exact too) launches in half the Triton launcher's host time (15 against
        # 30 us on an H200), which an eager fp8 step, host-bound, pays 3 times per linear.
        return cast_transpose(x, torch.linalg.vector_norm(x, float("inf")), dtype, out)
    # Captured: the Triton kernel (its launch cost gone) reads x faster (7 against 13 us for 25 MB on an H200),
    # and can be gated for the weight casts that replays skip.
    return cast_transpose(x, amax(x, active), dtype, out, active)


@dataclass
class _WeightCast:
    layout: tuple[int, torch.Size, torch.dtype, torch.dtype]
    """The weight's address, shape and dtype and the fp8 dtype the cast was made for: another means new tensors."""
    casts: tuple[Tensor, Tensor, Tensor]
    """:func:`quantize_pair`'s three tensors (on GPU written in place by each new cast)."""
    version: int
    """The weight's ``_version`` when the cast was made: an in-place change of the parameter bumps it."""
    generation: int
    """:attr:`_WeightCasts.generation` when the cast was made: reused only within the same one."""


@dataclass
class _WeightCasts:
    """The weights' kept casts (weakly keyed by the weight) and what marks them stale."""

    generation: int = 0
    """Counts :func:`weights_changed` calls: a cast made before the last one is never reused."""
    casts: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    stale: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    """GPU weights -> a one-element int32 view into :attr:`flag_blocks`: 1 while a graph replay must cast the weight,
    0 once one did. Made at the weight's first eager cast, so that a later graph capture can read it."""
    flag_blocks: list[Tensor] = field(default_factory=list)
    """The flags' storage, blocks of :data:`_FLAGS_PER_BLOCK`: :func:`weights_changed` sets them with one fill each."""
    flags_handed_out: dict[torch.device, int] = field(default_factory=dict)


_FLAGS_PER_BLOCK = 256
_WEIGHTS = _WeightCasts()


def weights_changed() -> None:
    """Every kept cast is stale from now on: the next :func:`quantize_weight` of each weight casts it again, eagerly
    or in a CUDA-graph replay. Called after each optimizer update (the strategy's ``after_update``); code that
    changes weights without bumping their version counter (through ``.data`` or a buffer they view) calls it too."""
    _WEIGHTS.generation += 1
    for block in _WEIGHTS.flag_blocks:
        block.fill_(1)


def _stale_flag(weight: Tensor) -> Tensor:
    """The graph-replay flag of a GPU ``weight`` (:attr:`_WeightCasts.stale`), made outside any capture."""
    flag = _WEIGHTS.stale.get(weight)
    if flag is None:
        handed_out = _WEIGHTS.flags_handed_out.get(weight.device, 0)  # never reused: a dead weight's flag stays
        if handed_out % _FLAGS_PER_BLOCK == 0:
            _WEIGHTS.flag_blocks.append(torch.ones(_FLAGS_PER_BLOCK, dtype=torch.int32, device=weight.device))
        block = [b for b in _WEIGHTS.flag_blocks if b.device == weight.device][-1]
        flag = _WEIGHTS.stale[weight] = block[handed_out % _FLAGS_PER_BLOCK]
        _WEIGHTS.flags_handed_out[weight.device] = handed_out + 1
    return flag


def quantize_weight(weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`quantize_pair` of a weight, or its kept result while that is current (see the module docstring).

    The cast lives in tensors kept for the weight (2 bytes per weight element), on GPU overwritten by each new
    cast, so that a captured CUDA graph reads and writes fixed addresses. In a graph capture the cast is recorded
    gated by the weight's stale flag, followed by clearing the flag: each replay casts only after a
    :func:`weights_changed` (graphs run fixed shapes, so every micro-batch of a step takes the same fp8 path).
    """
    layout = (weight.data_ptr(), weight.shape, weight.dtype, dtype)
    entry = _WEIGHTS.casts.get(weight)
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        flag = _WEIGHTS.stale.get(weight)  # None (never cast eagerly): every replay casts
        if entry is None or entry.layout != layout:
            entry = _WeightCast(layout, quantize_pair(weight, dtype), weight._version, _WEIGHTS.generation)
            _WEIGHTS.casts[weight] = entry
        else:
            quantize_pair(weight, dtype, entry.casts, flag)
        if flag is not None:
            flag.fill_(0)
        return entry.casts
    if weight.is_cuda:
        _stale_flag(weight)
    if entry is not None and entry.layout == layout:
        if entry.version == weight._version and entry.generation == _WEIGHTS.generation:
            return entry.casts
        # In place on GPU: a captured graph's addresses. A pending backward of an earlier micro-batch may hold the
        # old cast only if the weight changed within a step, which training does not do.
        entry.casts = quantize_pair(weight, dtype, entry.casts if weight.is_cuda else None)
    else:
        entry = _WeightCast(layout, quantize_pair(weight, dtype), weight._version, _WEIGHTS.generation)
        _WEIGHTS.casts[weight] = entry
    entry.version, entry.generation = weight._version, _WEIGHTS.generation
    return entry.casts


def forget_weight_casts(modules: Iterable[torch.nn.Module]) -> None:
    """Drop the casts kept for the parameters of ``modules`` (their memory), e.g. when the weights leave the GPU."""
    for module in modules:
        for weight in module.parameters():
            _WEIGHTS.casts.pop(weight, None)


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
