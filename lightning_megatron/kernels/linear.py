"""Megatron's parallel linears with the weight gradient accumulated straight into the fp32 ``main_grad``.

Megatron's ``gradient_accumulation_fusion`` does this with apex's ``fused_weight_gradient_mlp_cuda`` extension;
without apex its layers compute a bf16 weight gradient and Megatron's DDP hook adds it to ``main_grad`` (a GEMM
plus a read-modify-write of every fp32 gradient, per micro-batch). Here one GEMM with an fp32 output accumulates
in place (``torch.addmm(..., out_dtype=torch.float32, out=main_grad)``, a CUDA op of torch >= 2.11). The layers
are drop-in subclasses used in the layer spec: same parameters, names and checkpoints; the forward math and the
tensor-/sequence-parallel communication are those of Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import Tensor, nn


@functools.cache
def mixed_dtype_addmm_available() -> bool:
    """Whether this torch runs ``addmm`` with bf16 inputs into an fp32 output on CUDA (torch >= 2.11)."""
    if not torch.cuda.is_available():
        return False
    try:
        out = torch.zeros(2, 2, device="cuda")
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(out[0, 0].item() == 2.0)


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


class _LinearIntoMainGrad(torch.autograd.Function):
    """``input @ weight.t() + bias`` whose backward accumulates the weight gradient into ``weight.main_grad``.

    Communication as in Megatron: under SP the input is all-gathered over TP (again in backward, to save its
    memory) and the input gradient reduce-scattered; with ``allreduce_dgrad`` the input gradient is all-reduced,
    overlapped with the weight-gradient GEMM.
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
    ) -> Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias, ctx.allreduce_dgrad, ctx.sequence_parallel = bias is not None, allreduce_dgrad, sequence_parallel
        ctx.tp_group = tp_group
        total = _all_gather(input, tp_group)[0] if sequence_parallel else input
        output = torch.matmul(total, weight.t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        total, gather = (_all_gather(input, ctx.tp_group, async_op=True)) if ctx.sequence_parallel else (input, None)
        grad_input = grad_output.matmul(weight)
        if gather is not None:
            gather.wait()
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        elif ctx.sequence_parallel:
            scattered = torch.empty(input.shape, dtype=grad_input.dtype, device=grad_input.device)
            handle = dist.reduce_scatter_tensor(scattered, grad_input.contiguous(), group=ctx.tp_group, async_op=True)
            grad_input = scattered
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [S*B, out]
        accumulate_wgrad(weight.main_grad, grad_2d, total.reshape(-1, total.shape[-1]))  # [S*B, in]
        # Megatron's DDP hook runs on the weight's AccumulateGrad node, so a gradient must still reach it (it
        # starts the bucket's reduction); grad_added_to_main_grad tells the hook not to add this placeholder --
        # unless the weight also gets a real gradient elsewhere (tied embeddings on one stage: Megatron marks them
        # zero_out_wgrad, and the hook adds the sum), where the placeholder must be zeros.
        weight.grad_added_to_main_grad = True
        shared = getattr(weight, "zero_out_wgrad", False)
        grad_weight = torch.zeros_like(weight) if shared else torch.empty_like(weight)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _forward(megatron_impl: Callable[..., Tensor], input: Tensor, weight: Tensor, **kwargs: Any) -> Tensor:
    """Our fused path where it applies (a trainable weight with Megatron DDP's ``main_grad``), else Megatron's."""
    fusable = (
        weight.requires_grad
        and torch.is_grad_enabled()
        and getattr(weight, "main_grad", None) is not None
        and hasattr(weight, "grad_added_to_main_grad")
        and kwargs.get("grad_output_buffer") is None  # deferred embedding wgrad: Megatron's own bookkeeping
        and kwargs.get("gtp_remat_size", 1) == 1
    )
    if not fusable:
        return megatron_impl(input, weight, **kwargs)
    tp_group = kwargs.get("tp_group")
    if tp_group is None and (kwargs["sequence_parallel"] or kwargs["allreduce_dgrad"]):
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    args = (input, weight, kwargs.get("bias"), kwargs["allreduce_dgrad"], kwargs["sequence_parallel"], tp_group)
    return _LinearIntoMainGrad.apply(*args)


def fuse_lm_head(layer: nn.Module) -> None:
    """Give GPTModel's LM head (a ``ColumnParallelLinear`` GPTModel builds itself, outside any layer spec) the
    fused weight gradient: its class becomes the subclass below, which holds no state of its own and only
    overrides ``_forward_impl``. Other output layers (e.g. a value head) are left as they are."""
    if type(layer) is ColumnParallelLinear:
        layer.__class__ = FusedWgradColumnParallelLinear


class FusedWgradColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with the weight gradient accumulated into ``main_grad`` in one GEMM."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        assert not args, "Megatron calls _forward_impl with keywords"
        return _forward(super()._forward_impl, input, weight, **kwargs)


class FusedWgradRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` with the weight gradient accumulated into ``main_grad`` in one GEMM."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        assert not args, "Megatron calls _forward_impl with keywords"
        return _forward(super()._forward_impl, input, weight, **kwargs)
