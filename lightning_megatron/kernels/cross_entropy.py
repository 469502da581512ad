"""The cross entropy of vocabulary-parallel logits, with its reductions and gradient as single compiled kernels.

Megatron's ``vocab_parallel_cross_entropy`` converts the whole micro-batch's logits to float32. Here float32 exists
only in registers on GPU and the gradient is written in the logits' dtype (eager PyTorch, with the same math, on
CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_megatron.kernels.compile import for_device


def _ce_stats(logits: Tensor, logits_max: Tensor, local_target: Tensor, in_range: Tensor) -> tuple[Tensor, Tensor]:
    """Per position: sum(exp(logit - max)) over this rank's vocabulary slice, and the target's logit (0 if the
    target lies in another rank's slice). Float32 math on ``logits`` of any dtype."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
    return sum_exp, torch.where(in_range, target_logit, 0.0)


def _ce_grad(logits: Tensor, lse: Tensor, local_target: Tensor, in_range: Tensor, grad: Tensor) -> Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad, in the logits' dtype."""
    softmax = (logits.float() - lse.unsqueeze(-1)).exp()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == local_target.unsqueeze(-1)) & in_range.unsqueeze(-1)
    return ((softmax - onehot.float()) * grad.unsqueeze(-1)).to(logits.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        rank = torch.distributed.get_rank(group) if group is not None else 0
        size = group.size() if group is not None else 1
        vocab = logits.shape[-1]
        start = rank * vocab
        in_range = (targets >= start) & (targets < start + vocab)
        local_target = torch.where(in_range, targets - start, 0)
        logits_max = logits.detach().amax(dim=-1).float()
        if size > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        sum_exp, target_logit = for_device(_ce_stats, logits.device)(logits, logits_max, local_target, in_range)
        if size > 1:
            stats = torch.stack([sum_exp, target_logit])  # one all-reduce for both
            torch.distributed.all_reduce(stats, group=group)
            sum_exp, target_logit = stats[0], stats[1]
        lse = logits_max + sum_exp.log()
        ctx.save_for_backward(logits, lse, local_target, in_range)
        return lse - target_logit

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, lse, local_target, in_range = ctx.saved_tensors
        return for_device(_ce_grad, logits.device)(logits, lse, local_target, in_range, grad.float()), None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy ``[...]`` of vocabulary-parallel logits ``[..., V/tp]`` (any float dtype) and ``targets``.

    Equal to Megatron's ``tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)`` (value and
    gradient), without a float32 copy of the logits on GPU.
    """
    from megatron.core import parallel_state

    group = None
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
