"""Gradient norms from Megatron's gradient buffers, for ``on_before_optimizer_step`` (where ``p.grad`` is None).

Megatron's DDP accumulates gradients into contiguous ``main_grad`` buffers and, at the end of the schedule, reduces
them over data-parallel ranks and divides them by the global batch's token count (or leaves that division to the
optimizer's clipping: ``parallel/ddp.py``, applied here too). With the distributed optimizer
the reduction is a reduce-scatter: each data-parallel rank holds the reduced values of its own shard of every
bucket only, so a norm is summed over the shards the ranks own. Tensor-parallel shards of a parameter are summed
over the tensor-parallel group; pipeline stages (and expert-parallel ranks for experts) hold different parameters.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_megatron.parallel import ddp


def grad_norms(
    ddp_chunks: list[Any] | None, module: nn.Module, reads: GradNormReads | None = None
) -> dict[str, Tensor]:
    """Collective: L2 norms of the reduced gradients, named like Lightning's ``grad_norm(module, 2)``:
    ``grad_2.0_norm/<parameter>`` for the parameters of this rank's pipeline stage and ``grad_2.0_norm_total`` for
    the whole model (identical on every rank; equal to the norm Megatron's optimizer clips, before clipping).
    ``ddp_chunks`` is ``None`` outside a training step; ``reads`` is told that this step's gradients were read."""
    from megatron.core import parallel_state as ps

    if ddp_chunks is None:
        raise RuntimeError(
            "MegatronStrategy.grad_norms() reads a training step's gradients: call it in on_before_optimizer_step "
            "(a module's or a callback's), on every rank"
        )
    names = {param: name for name, param in module.named_parameters()}
    squares, groups = _owned_squares(ddp_chunks)
    factor = ddp.pending_token_scale(ddp_chunks)  # the buffers not yet divided by the token count (ddp.py)
    if factor is not None:
        squares = {param: value * factor**2 for param, value in squares.items()}
    _sum_over(groups, squares)  # the data-parallel shards
    tp_sharded = defaultdict(list)
    for param in squares:
        if getattr(param, "tensor_model_parallel", False):
            expert = not getattr(param, "allreduce", True)
            tp_sharded[
                ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            ].append(param)
    _sum_over(tp_sharded, squares)  # the tensor-parallel shards
    norms = {f"grad_2.0_norm/{names[p]}": value.sqrt() for p, value in squares.items()}
    norms["grad_2.0_norm_total"] = _total(squares).sqrt()
    if reads is not None:
        reads.mark_read()
    return norms


def _sum_over(groups: dict[Any, list[nn.Parameter]], squares: dict[nn.Parameter, Tensor]) -> None:
    """Sum each group's parameters' squares over that process group, one all-reduce per group (``None``: none)."""
    for group, params in groups.items():
        if group is not None and group.size() > 1:
            stacked = torch.stack([squares[p] for p in params])
            torch.distributed.all_reduce(stacked, group=group)
            squares.update(zip(params, stacked, strict=True))


def _owned_squares(ddp_chunks: list[Any]) -> tuple[dict[nn.Parameter, Tensor], dict[Any, list[nn.Parameter]]]:
    """Each parameter's sum of squared gradients over the part of the buffer this rank holds reduced, and the
    data-parallel group to sum those parts over (``None``: every rank holds all of it)."""
    squares: dict[nn.Parameter, Tensor] = {}
    groups: dict[Any, list[nn.Parameter]] = defaultdict(list)
    for chunk in ddp_chunks:
        for bucket_group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
            sharded = bucket_group.ddp_config.use_distributed_optimizer
            rank = bucket_group.intra_distributed_optimizer_instance_rank if sharded else 0
            size = bucket_group.intra_distributed_optimizer_instance_size if sharded else 1
            group = bucket_group.intra_distributed_optimizer_instance_group if sharded else None
            for bucket in bucket_group.buckets:
                shard = bucket.grad_data.numel() // size
                own_start, own_end = rank * shard, (rank + 1) * shard
                for param in bucket.params_list:
                    start, end = bucket.param_to_index[param]
                    lo, hi = max(start, own_start), min(end, own_end)
                    part = bucket.grad_data[lo:hi] if hi > lo else bucket.grad_data[:0]
                    squares[param] = part.float().square().sum()
                    groups[group].append(param)
    return squares, groups


def _total(squares: dict[nn.Parameter, Tensor]) -> Tensor:
    """Sum of every parameter's squared norm over the whole model: pipeline stages hold different parameters, and
    expert-parallel ranks different experts."""
    from megatron.core import parallel_state as ps

    device = next(iter(squares.values())).device if squares else torch.device("cpu")
    dense = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros((), dtype=torch.float32, device=device)
    for param, value in squares.items():
        if getattr(param, "shared", False):
            continue  # a tied embedding's copy on the last pipeline stage: counted once, on the first, as Megatron
        if getattr(param, "allreduce", True):
            dense = dense + value
        else:
            experts = experts + value
    if ps.get_expert_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(experts, group=ps.get_expert_model_parallel_group())
    total = dense + experts
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return total


_HOOK = "on_before_optimizer_step"


class GradNormReads:
    """Warns once (rank zero) when overridden ``on_before_optimizer_step`` hooks (the LightningModule's or a
    callback's) have run :data:`PATIENCE` training steps and none of the run's steps read the gradients through
    ``strategy.grad_norms()``. Under Megatron ``p.grad`` is None (gradients accumulate in ``main_grad`` buffers), so
    Lightning's ``grad_norm(self, 2)`` recipe there returns ``{}`` and ``self.log_dict`` of it logs nothing, without
    an error. One read in the run is enough (periodic logging, ``if step % 100 == 0``, reads at step 0).

    The strategy calls :meth:`after_hooks` after each step's hooks and passes this object to :func:`grad_norms`.
    """

    def __init__(self) -> None:
        self._read = False
        self._unread_steps = 0
        self._warned = False

    def mark_read(self) -> None:
        """The gradients were read (:func:`grad_norms` ran)."""
        self._read = True

    def after_hooks(self, module: L.LightningModule) -> None:
        """After a training step's ``on_before_optimizer_step`` hooks: warn once after :data:`PATIENCE` steps of
        overridden hooks without any read. (The hooks are looked up here, not at connect, so that the callbacks of
        the module's ``configure_callbacks`` count too.)"""
        if self._read or self._warned:
            return
        hooks = overridden_hooks(module, module.trainer.callbacks)
        self._unread_steps += bool(hooks)
        if self._unread_steps >= PATIENCE:
            self._warned = True
            rank_zero_warn(
                f"{', '.join(hooks)} ran {PATIENCE} training steps and none read the gradients through "
                "self.trainer.strategy.grad_norms(). If they read gradients: under MegatronStrategy parameters have "
                "no .grad (Megatron keeps gradients in main_grad buffers), so Lightning's grad_norm(self, 2) or "
                "p.grad there see nothing (grad_norm returns {}, log_dict logs nothing). To log gradient norms, call "
                "self.trainer.strategy.grad_norms() in on_before_optimizer_step (trainer.strategy.grad_norms() in a "
                "callback), on every rank: Lightning's grad_norm names, from Megatron's reduced buffers"
            )


PATIENCE = 4
"""Training steps of overridden ``on_before_optimizer_step`` hooks, none reading the gradients, before the warning."""


def overridden_hooks(module: L.LightningModule, callbacks: list[L.Callback]) -> list[str]:
    """``"<class>.on_before_optimizer_step"`` for ``module`` and each callback whose class overrides that hook."""
    owners: list[object] = [module, *callbacks]
    bases = [L.LightningModule] + [L.Callback] * len(callbacks)
    return [
        f"{type(owner).__name__}.{_HOOK}"
        for owner, base in zip(owners, bases, strict=True)
        if getattr(type(owner), _HOOK) is not getattr(base, _HOOK)
    ]
