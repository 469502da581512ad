"""Megatron DDP around the model chunks, and the hooks its overlapped communication needs in the schedule."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, override

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from torch import Tensor, nn


class TokenScaleDeferringDDP(DistributedDataParallel):
    """Megatron's DDP, whose division of the gradients by the global batch's token count can wait for the
    optimizer's gradient clipping, which then applies it in its own multiply (``patches.ForeachClipGrads``).

    With the per-token loss, Megatron's ``finalize_model_grads`` ends the schedule with ``scale_gradients(1 /
    tokens)``: a read and a write of every fp32 gradient (2.9 ms of a 195 ms step for 1B parameters on an H200),
    right before clipping multiplies every gradient again, by ``min(1, clip / norm)``. With ``defer_token_scale``
    set (:func:`defer_token_scale`) the factor is kept here instead, until :func:`take_token_scale`.
    """

    defer_token_scale = False
    deferred_token_scale: Tensor | float | None = None

    @override
    def scale_gradients(self, scaling_factor: Tensor | float) -> None:
        if self.defer_token_scale:
            self.deferred_token_scale = scaling_factor
        else:
            super().scale_gradients(scaling_factor)


def defer_token_scale(chunks: list[Any], defer: bool) -> None:
    """Whether the chunks keep the token-count division for the optimizer (see :class:`TokenScaleDeferringDDP`)."""
    for chunk in chunks:
        chunk.defer_token_scale = defer
        chunk.deferred_token_scale = None


def pending_token_scale(chunks: list[Any]) -> Tensor | float | None:
    """The factor the gradients still wait for (``None``: none; the same for every chunk of a step)."""
    return getattr(chunks[0], "deferred_token_scale", None) if chunks else None


def take_token_scale(chunks: list[Any]) -> Tensor | float | None:
    """:func:`pending_token_scale`, which the caller now applies: the chunks forget it."""
    factor = pending_token_scale(chunks)
    for chunk in chunks:
        chunk.deferred_token_scale = None
    return factor


def check_config(ddp_config: DistributedDataParallelConfig | None, use_distributed_optimizer: bool) -> None:
    """Raise ``ValueError`` for a DDP config that the strategy's ``use_distributed_optimizer`` contradicts."""
    if ddp_config is not None and ddp_config.overlap_param_gather and not use_distributed_optimizer:
        raise ValueError(
            "ddp_config.overlap_param_gather=True needs use_distributed_optimizer=True (it overlaps the "
            "distributed optimizer's parameter all-gather); set overlap_param_gather=False or keep the default"
        )


def zero_grads(chunks: list[Any], optimizer: Any) -> None:
    """Before a step's schedule run: zero the DDP gradient buffers and the optimizer's (main) gradients."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def wrap(
    chunks: list[nn.Module], ddp_config: DistributedDataParallelConfig | None, use_distributed_optimizer: bool
) -> list[nn.Module]:
    """Wrap each model chunk in Megatron's DDP (contiguous grad buffers, bucketed reduce-scatter/all-reduce)."""
    base = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    base = replace(base, use_distributed_optimizer=use_distributed_optimizer)
    wrapped = []
    for index, chunk in enumerate(chunks):
        # Only the first chunk gets buckets for overlap; Megatron does the same with VPP.
        ddp = TokenScaleDeferringDDP(chunk.config, base, chunk, disable_bucketing=index > 0)
        ddp.broadcast_params()  # replicas start identical whatever the per-rank seeds were
        wrapped.append(ddp)
    return wrapped


def set_schedule_hooks(chunks: list[Any], optimizer: Any) -> None:
    """What Megatron's schedule calls around the step, read from the first chunk's config: gradient finalisation
    (DP/TP reductions, division by the token count), the loss scale, and the overlap hooks."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    set_overlap_hooks(config, chunks)


def set_overlap_hooks(config: Any, chunks: list[Any]) -> None:
    """Tell Megatron's schedule how to defer and start gradient/parameter communication (as Megatron-LM does).

    With ``overlap_grad_reduce`` the schedule runs all but the last micro-batch under ``no_sync`` and starts each
    bucket's reduce as its gradients are ready in the last one; with ``overlap_param_gather`` (distributed
    optimizer) the updated parameters are all-gathered during the next forward instead of inside the step.
    """
    ddp_config = chunks[0].ddp_config

    def one_or_list(fns: list[Any]) -> Any:
        return fns[0] if len(fns) == 1 else fns

    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = one_or_list([chunk.no_sync for chunk in chunks])
        config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in chunks])
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        # Megatron-LM's rule: the schedule launches whole chunks' gathers only when asked to align them; otherwise
        # the DDP forward pre-hooks dispatch bucket by bucket.
        config.param_sync_func = one_or_list([chunk.start_param_sync for chunk in chunks])


_SCHEDULE_HOOKS = ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func")


def clear_hooks(config: Any) -> None:
    """Drop what fit handed the schedule: a later validate/predict must not enter a dead DDP's ``no_sync``, and the
    bound ``grad_scale_func`` would keep the whole optimizer (fp32 main weights, Adam state) alive."""
    for name in _SCHEDULE_HOOKS:
        setattr(config, name, None)


def param_gather_deferred(chunks: list[Any]) -> bool:
    """Whether the DDP-wrapped ``chunks`` defer each update's parameter all-gather to the next forward."""
    return any(chunk.ddp_config.overlap_param_gather for chunk in chunks)


def sync_params(chunks: list[Any]) -> None:
    """Finish the parameter all-gather now when it is overlapped with the next forward (before a checkpoint or
    when training ends, where no forward follows)."""
    for chunk in chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
