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

A weight's cast is kept between calls (:func:`quantize_weight`): within one run of Megatron's schedule the weights
do not change, so a model chunk's first micro-batch casts them and the later ones reuse the casts
(:func:`reuse_weight_casts`, set by ``schedule.py``). Outside a schedule run every call casts. The kept casts
take 2 bytes per weight element of GPU memory until the strategy's teardown or ``offload()`` drops them.

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
    source: tuple[int, torch.Size, torch.dtype, torch.dtype]
    """The weight's address, shape and dtype and the fp8 dtype the cast was made for: another means a new cast."""
    casts: tuple[Tensor, Tensor, Tensor]
    """:func:`quantize_pair`'s three tensors (on GPU written in place by each new cast)."""
    generation: int
    """:attr:`_WeightCasts.generation` when they were made: reused only within the same one."""


@dataclass
class _WeightCasts:
    """Process-wide: the weights' casts and which of them are current (see :func:`reuse_weight_casts`)."""

    current: frozenset[int] = frozenset()
    """``id()`` of the weights whose casts :func:`quantize_weight` returns as they are (if made in this generation)."""
    generation: int = 0
    """Counts :func:`weights_may_change` calls: a cast made before the last one is never reused."""
    casts: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    flags: dict[torch.device, Tensor] = field(default_factory=dict)
    """Per GPU, for graph-captured casts to read at replay: 0 while some casts are current, else 1 (cast)."""


_WEIGHTS = _WeightCasts()


def reuse_weight_casts(weights: frozenset[int]) -> None:
    """The weights (their ``id()``; empty: none) unchanged since their casts were last made, so that
    :func:`quantize_weight` returns those. ``schedule.run`` sets it for each micro-batch: none on a model chunk's
    first one, the chunk's parameters on the later ones, none again when the schedule returns (the optimizer then
    changes the weights; a caller outside the schedule may change them too). CUDA-graph replays of the casts read
    a device flag instead, set here with one fill when it changes: it cannot tell weights apart, so a
    graph-captured fp8 model must not run inside another fp8 model's schedule run (CUDA graphs are captured for
    one model per process anyway: Megatron keeps their state process-wide)."""
    reuse_before = bool(_WEIGHTS.current)
    _WEIGHTS.current = weights
    if bool(weights) != reuse_before:
        for flag in _WEIGHTS.flags.values():
            flag.fill_(0 if weights else 1)


def weights_may_change() -> None:
    """Start a new generation of casts (``schedule.run`` calls it when a schedule run starts and ends): casts made
    before are not reused, even for weights :func:`reuse_weight_casts` names -- e.g. a weight whose linear ran in
    bf16 on the chunk's first micro-batch (a token count fp8 cannot take) still holds the last step's cast."""
    _WEIGHTS.generation += 1
    reuse_weight_casts(frozenset())


def quantize_weight(weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`quantize_pair` of a weight, or its last result while :func:`reuse_weight_casts` names the weight.

    The cast lives in tensors kept for the weight (2 bytes per weight element), on GPU overwritten by each new
    cast, so that a captured CUDA graph reads and writes fixed addresses. In a graph capture the cast is recorded
    with the device flag, and each replay casts or skips as the flag says at that moment.
    """
    source = (weight.data_ptr(), weight.shape, weight.dtype, dtype)
    entry = _WEIGHTS.casts.get(weight)
    reuse = id(weight) in _WEIGHTS.current and entry is not None and entry.generation == _WEIGHTS.generation
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    if weight.is_cuda and not capturing and weight.device not in _WEIGHTS.flags:  # made outside any capture
        value = 0 if _WEIGHTS.current else 1
        _WEIGHTS.flags[weight.device] = torch.full((), value, dtype=torch.int32, device=weight.device)
    if entry is None or entry.source != source:
        entry = _WeightCast(source, quantize_pair(weight, dtype), _WEIGHTS.generation)
        _WEIGHTS.casts[weight] = entry
        return entry.casts
    # A graph replay cannot check the generation: graphs run fixed shapes, so every micro-batch of a step takes the
    # same (fp8 or bf16) path, and the first one casts.
    # In place: a captured graph's addresses. Autograd does not see these writes (no version bump), and a pending
    # backward (e.g. a recompute under virtual pipelining) may hold the old cast: harmless, because a recast of an
    # unchanged weight writes the same bits, and weights change only between schedule runs.
    if weight.is_cuda and (capturing or not reuse):
        quantize_pair(weight, dtype, entry.casts, _WEIGHTS.flags.get(weight.device) if capturing else None)
    elif not reuse:  # CPU: new tensors (a pending backward keeps those it saved; no graphs here)
        entry.casts = quantize_pair(weight, dtype)
    if not reuse:
        entry.generation = _WEIGHTS.generation
    return entry.casts


def weight_ids(module: torch.nn.Module) -> frozenset[int]:
    """The ``id()`` of ``module``'s parameters, for :func:`reuse_weight_casts`."""
    return frozenset(id(param) for param in module.parameters())


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
