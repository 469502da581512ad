"""Megatron's parallel linears with the weight gradient accumulated straight into the fp32 ``main_grad``.

Megatron's ``gradient_accumulation_fusion`` does this with apex's ``fused_weight_gradient_mlp_cuda`` extension;
without apex its layers compute a bf16 weight gradient and Megatron's DDP hook adds it to ``main_grad`` (a GEMM
plus a read-modify-write of every fp32 gradient, per micro-batch). Here one GEMM with an fp32 output accumulates
in place (``torch.addmm(..., out_dtype=torch.float32, out=main_grad)``, a CUDA op of torch >= 2.11). The layers
are drop-in subclasses used in the layer spec: same parameters, names and checkpoints; the forward math and the
tensor-/sequence-parallel communication are those of Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``.
The fp8 subclasses run the same layers' three GEMMs in fp8 (:mod:`lightning_megatron.kernels.fp8`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import Tensor, nn

from lightning_megatron.compat import class_swap
from lightning_megatron.kernels.fp8 import E4M3, E5M2, gemm_shapes_ok, quantize_pair, quantize_weight, scaled_mm


@functools.cache
def mixed_dtype_addmm_available() -> bool:
    """Whether this torch runs ``addmm`` with bf16 inputs into an fp32 output on CUDA (torch >= 2.11)."""
    if not torch.cuda.is_available():
        return False
    try:
        out = torch.ones(2, 2, device="cuda")  # ones: an op that overwrote `out` instead of adding would give 2
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(out[0, 0].item() == 3.0)


def accumulate_wgrad(main_grad: Tensor, grad_output: Tensor, input: Tensor) -> None:
    """``main_grad += grad_output^T @ input`` in one GEMM: [out, in] += [N, out]^T [N, in]."""
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)
    else:  # CPU has no mixed-dtype GEMM: an upcast GEMM (only when asked for, e.g. in tests)
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), input.to(main_grad.dtype))


def _all_gather(input: Tensor, group: dist.ProcessGroup, async_op: bool = False) -> tuple[Tensor, Any]:
    """All-gather along dim 0 (the sequence, under SP): [S/tp, B, H] -> [S, B, H]."""
    out = torch.empty((input.shape[0] * group.size(), *input.shape[1:]), dtype=input.dtype, device=input.device)
    return out, dist.all_gather_into_tensor(out, input.contiguous(), group=group, async_op=async_op)


def _reduce_dgrad(
    grad_input: Tensor, input_shape: torch.Size, allreduce: bool, sequence_parallel: bool, group: Any
) -> tuple[Tensor, Any]:
    """Start the input gradient's TP reduction (returns it and the handle to wait on after the wgrad GEMM): an
    all-reduce, or under SP a reduce-scatter back to this rank's [S/tp, B, in]; neither without TP communication."""
    if allreduce:
        return grad_input, dist.all_reduce(grad_input, group=group, async_op=True)
    if sequence_parallel:
        scattered = torch.empty(input_shape, dtype=grad_input.dtype, device=grad_input.device)
        return scattered, dist.reduce_scatter_tensor(scattered, grad_input.contiguous(), group=group, async_op=True)
    return grad_input, None


def _placeholder(weight: Tensor) -> Tensor:
    """What reaches the weight's AccumulateGrad node once its gradient is already in ``main_grad``.

    Megatron's DDP hook runs on that node, so a gradient must still reach it (it starts the bucket's reduction);
    grad_added_to_main_grad tells the hook not to add the placeholder -- unless the weight also gets a real
    gradient elsewhere (tied embeddings on one stage: Megatron marks them zero_out_wgrad, and the hook adds the
    sum), where the placeholder must be zeros.
    """
    weight.grad_added_to_main_grad = True
    shared = getattr(weight, "zero_out_wgrad", False)
    return torch.zeros_like(weight) if shared else torch.empty_like(weight)


def _has_main_grad(weight: Tensor) -> bool:
    return getattr(weight, "main_grad", None) is not None and hasattr(weight, "grad_added_to_main_grad")


class _LinearIntoMainGrad(torch.autograd.Function):
    """``input @ weight.t() + bias`` whose backward accumulates the weight gradient into ``weight.main_grad``.

    Communication as in Megatron: under SP the input is all-gathered over TP (again in backward, to save its
    memory) and the input gradient reduce-scattered; with ``allreduce_dgrad`` the input gradient is all-reduced,
    overlapped with the weight-gradient GEMM.

    ``batch_first`` (the LM head): the output [S, B, out] is laid out [B, S, out] in memory, a transposed view.
    GPTModel turns the logits batch-first with ``transpose(0, 1).contiguous()``, which is then free instead of a
    copy of the largest activation of the step (0.5 GB for 4 x 2048 tokens of a 32k vocabulary, and twice more in
    backward, where the gradient arrived transposed). The GEMMs then copy the [S, B, in] input instead, ``out / in``
    times smaller.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None,
        batch_first: bool = False,
    ) -> Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias, ctx.allreduce_dgrad, ctx.sequence_parallel = bias is not None, allreduce_dgrad, sequence_parallel
        ctx.tp_group, ctx.batch_first = tp_group, batch_first
        total = _all_gather(input, tp_group)[0] if sequence_parallel else input
        if batch_first:  # [B, S, in] @ [in, out] -> [B, S, out], returned as its [S, B, out] view
            output = torch.matmul(total.transpose(0, 1), weight.t()).transpose(0, 1)
        else:
            output = torch.matmul(total, weight.t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        total, gather = (_all_gather(input, ctx.tp_group, async_op=True)) if ctx.sequence_parallel else (input, None)
        if ctx.batch_first:  # the gradient in the output's layout: [B, S, out] in memory, contiguous as such
            grad_output, total = grad_output.transpose(0, 1), total.transpose(0, 1)
        grad_input = grad_output.matmul(weight)
        if ctx.batch_first:  # [B, S, in] -> [S, B, in], contiguous for the reduction
            grad_input = grad_input.transpose(0, 1).contiguous()
        if gather is not None:
            gather.wait()
        grad_input, handle = _reduce_dgrad(
            grad_input, input.shape, ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group
        )
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [S*B, out] ([B*S, out] if batch_first)
        accumulate_wgrad(weight.main_grad, grad_2d, total.reshape(-1, total.shape[-1]))  # [S*B, in], same order
        grad_weight = _placeholder(weight)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _Fp8Linear(torch.autograd.Function):
    """``input @ weight.t() + bias`` with fp8 forward, input-gradient and weight-gradient GEMMs: input and weight
    in e4m3, the output gradient in ``grad_dtype``.

    Communication as Megatron's: under SP the input is all-gathered over TP (kept in fp8 for backward) and the
    input gradient reduce-scattered; with ``allreduce_dgrad`` the input gradient is all-reduced. The weight
    gradient goes into ``weight.main_grad`` when Megatron's DDP gave the weight one, else into ``weight.grad``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None,
        grad_dtype: torch.dtype,
    ) -> Tensor:
        total = _all_gather(input, tp_group)[0] if sequence_parallel else input
        shape = total.shape
        # Each operand in both layouts (fp8_triton): row-major here, the transposes kept for backward's GEMMs.
        x8, x8t, x_inv = quantize_pair(total.reshape(-1, shape[-1]), E4M3)  # [S*B, in], [in, S*B]
        w8, w8t, w_inv = quantize_weight(weight, E4M3)  # [out, in], [in, out]; kept between micro-batches
        output = scaled_mm(x8, x_inv, w8.t(), w_inv, total.dtype).view(*shape[:-1], weight.shape[0])
        ctx.save_for_backward(x8t, x_inv, w8t, w_inv, weight)
        ctx.meta = (bias is not None, allreduce_dgrad, sequence_parallel, tp_group, input.shape, total.dtype)
        ctx.grad_dtype = grad_dtype
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        x8t, x_inv, w8t, w_inv, weight = ctx.saved_tensors
        has_bias, allreduce_dgrad, sequence_parallel, tp_group, input_shape, dtype = ctx.meta
        g = grad_output.reshape(-1, grad_output.shape[-1])  # [S*B, out]
        g8, g8t, g_inv = quantize_pair(g, ctx.grad_dtype)  # [S*B, out], [out, S*B]
        grad_input = scaled_mm(g8, g_inv, w8t.t(), w_inv, dtype)  # [S*B, out] @ [out, in]
        grad_input = grad_input.view(*grad_output.shape[:-1], weight.shape[1])
        grad_input, handle = _reduce_dgrad(grad_input, input_shape, allreduce_dgrad, sequence_parallel, tp_group)
        wgrad = scaled_mm(g8t, g_inv, x8t.t(), x_inv, torch.float32)  # [out, S*B] @ [S*B, in]
        grad_weight = _into_main_grad(weight, wgrad)
        grad_bias = g.sum(dim=0) if has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _into_main_grad(weight: Tensor, wgrad: Tensor) -> Tensor:
    """Add the fp32 weight gradient to Megatron's ``main_grad`` and return the placeholder its DDP hook expects
    (:func:`_placeholder`), or return the gradient itself for a weight without ``main_grad``."""
    if not _has_main_grad(weight):
        return wgrad.to(weight.dtype)
    weight.main_grad.add_(wgrad)
    return _placeholder(weight)


def _forward(
    megatron_impl: Callable[..., Tensor],
    input: Tensor,
    weight: Tensor,
    fp8_grad_dtype: torch.dtype | None,
    batch_first: bool,
    **kwargs: Any,
) -> Tensor:
    """fp8 GEMMs (``fp8_grad_dtype``: the output gradients' fp8 type; None: no fp8) or the fused weight gradient
    where they apply, else Megatron's own path. ``batch_first``: the LM head's output laid out [B, S, out] (see
    :class:`_LinearIntoMainGrad`), in training and inference."""
    megatron_only = (
        not weight.requires_grad  # frozen: Megatron's input-gradient-only path
        or kwargs.get("grad_output_buffer") is not None  # deferred embedding wgrad: Megatron's own bookkeeping
        or kwargs.get("gtp_remat_size", 1) > 1
    )
    if megatron_only:
        return megatron_impl(input, weight, **kwargs)
    sequence_parallel, allreduce_dgrad = kwargs["sequence_parallel"], kwargs["allreduce_dgrad"]
    tp_group = kwargs.get("tp_group")
    if tp_group is None and (sequence_parallel or allreduce_dgrad):
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    args = (input, weight, kwargs.get("bias"), allreduce_dgrad, sequence_parallel, tp_group)
    tokens = input.numel() // input.shape[-1] * (tp_group.size() if sequence_parallel else 1)
    if fp8_grad_dtype is not None:
        # shapes _scaled_mm cannot take (or an MoE expert without tokens): Megatron's bf16 path
        fits = tokens > 0 and gemm_shapes_ok(tokens, *weight.shape)
        return _Fp8Linear.apply(*args, fp8_grad_dtype) if fits else megatron_impl(input, weight, **kwargs)
    if torch.is_grad_enabled() and _has_main_grad(weight):
        return _LinearIntoMainGrad.apply(*args, batch_first)
    if batch_first and not torch.is_grad_enabled():  # forward only: the same GEMM, and communication, as Megatron's
        return _LinearIntoMainGrad.apply(*args, True)
    return megatron_impl(input, weight, **kwargs)


def _keywords_only(args: tuple[Any, ...]) -> None:
    if args:  # megatron-core 0.19 passes everything after the weight by keyword; a change must not pass silently
        raise TypeError(f"_forward_impl got {len(args)} positional arguments after the weight; expected keywords")


class FusedWgradColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with the weight gradient accumulated into ``main_grad`` in one GEMM."""

    fp8 = False
    """Whether the GEMMs run in fp8 (per class; an instance may set its own, e.g. a probe keeping one in bf16)."""
    fp8_grad_dtype = E5M2
    """The output gradients' fp8 type when ``fp8``."""
    batch_first = False  # the output's memory layout (see _LinearIntoMainGrad): the LM head's

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        _keywords_only(args)
        grad_dtype = self.fp8_grad_dtype if self.fp8 else None
        return _forward(super()._forward_impl, input, weight, grad_dtype, self.batch_first, **kwargs)


class FusedWgradRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` with the weight gradient accumulated into ``main_grad`` in one GEMM."""

    fp8 = False
    """As :attr:`FusedWgradColumnParallelLinear.fp8`."""
    fp8_grad_dtype = E5M2
    """As :attr:`FusedWgradColumnParallelLinear.fp8_grad_dtype`."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        _keywords_only(args)
        grad_dtype = self.fp8_grad_dtype if self.fp8 else None
        return _forward(super()._forward_impl, input, weight, grad_dtype, False, **kwargs)


class FusedWgradLMHead(FusedWgradColumnParallelLinear):
    """GPTModel's LM head: :class:`FusedWgradColumnParallelLinear` whose logits come out laid out batch-first
    (see :class:`_LinearIntoMainGrad`)."""

    batch_first = True


class Fp8ColumnParallelLinear(FusedWgradColumnParallelLinear):
    """``ColumnParallelLinear`` whose three GEMMs run in fp8 (:mod:`lightning_megatron.kernels.fp8`): the
    "hybrid" format, output gradients in e5m2."""

    fp8 = True


class Fp8RowParallelLinear(FusedWgradRowParallelLinear):
    """``RowParallelLinear`` whose three GEMMs run in fp8, as :class:`Fp8ColumnParallelLinear`."""

    fp8 = True


class Fp8E4M3ColumnParallelLinear(Fp8ColumnParallelLinear):
    """:class:`Fp8ColumnParallelLinear` in the "e4m3" format: output gradients in e4m3 too."""

    fp8_grad_dtype = E4M3


class Fp8E4M3RowParallelLinear(Fp8RowParallelLinear):
    """:class:`Fp8RowParallelLinear` in the "e4m3" format: output gradients in e4m3 too."""

    fp8_grad_dtype = E4M3


FP8_LINEARS: dict[str, tuple[type[ColumnParallelLinear], type[RowParallelLinear]]] = {
    "hybrid": (Fp8ColumnParallelLinear, Fp8RowParallelLinear),
    "e4m3": (Fp8E4M3ColumnParallelLinear, Fp8E4M3RowParallelLinear),
}
"""The column- and row-parallel fp8 linears of each ``ModelConfig.fp8`` format (Megatron's names for them)."""


def fuse_lm_head(layer: nn.Module) -> None:
    """Give GPTModel's LM head (a ``ColumnParallelLinear`` GPTModel builds itself, outside any layer spec) the
    fused weight gradient and batch-first logits: its class becomes :class:`FusedWgradLMHead`, which holds no
    state of its own and only overrides ``_forward_impl``. Other output layers (e.g. a value head) are left as
    they are. (The LM head stays in bf16 under fp8, as fp8 recipes keep it.)"""
    if type(layer) is ColumnParallelLinear:
        class_swap.swap_class(layer, FusedWgradLMHead)
