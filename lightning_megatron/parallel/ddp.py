"""Megatron DDP around the model chunks, and the hooks its overlapped communication needs in the schedule."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig


def wrap(
    chunks: list[nn.Module], ddp_config: DistributedDataParallelConfig | None, use_distributed_optimizer: bool
) -> list[nn.Module]:
    """Wrap each model chunk in Megatron's DDP (contiguous grad buffers, bucketed reduce-scatter/all-reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    base = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    base = replace(base, use_distributed_optimizer=use_distributed_optimizer)
    wrapped = []
    for index, chunk in enumerate(chunks):
        # Only the first chunk gets buckets for overlap; Megatron does the same with VPP.
        ddp = DistributedDataParallel(chunk.config, base, chunk, disable_bucketing=index > 0)
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


def sync_params(chunks: list[Any]) -> None:
    """Finish the parameter all-gather now when it is overlapped with the next forward (before a checkpoint or
    when training ends, where no forward follows)."""
    for chunk in chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
