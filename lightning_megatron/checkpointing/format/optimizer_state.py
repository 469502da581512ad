"""The distributed optimizer's state for a save, in Megatron's reshardable format, built on the GPU.

Megatron's ``DistributedOptimizer.sharded_state_dict(metadata={"distrib_optim_sharding_type":
"fully_reshardable"})`` turns each data-parallel rank's flat shard of the fp32 main weights and Adam moments into one
tensor per parameter (its model-space shape), which is what makes a checkpoint load at any other TP/PP/DP layout.
It does so on the host: every parameter's state is copied to pageable memory one tensor at a time, gathered over
the data-parallel group through the GPU and copied back (over 20 s for a 1B model on one H100). And it slices the
gathered state by offsets that count the padding at the end of earlier gradient buckets, which the gathered state
leaves out: with several padded buckets most parameters get another parameter's state.

:func:`optimizer_state` writes the same entries (keys, shapes, replica ids; the values each parameter's own, so
Megatron's loader reads them) from the GPU: each parameter's state is taken from its bucket by the bucket's own
offsets, at DP=1 as it is, else each rank's piece broadcast over the data-parallel group, and copied straight into
its host buffer (:mod:`.staging`). Optimizers it does not cover (precision-aware or hybrid-device optimizers,
Megatron-FSDP, other optimizer classes) use Megatron's own method.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.checkpointing.save.staging import HostBuffers, name_of, stage_state
from lightning_megatron.compat import megatron_internals

SHARDING_TYPE = "fully_reshardable"
_PREFIX = "optimizer.state"


def optimizer_state(
    optimizer: Any, model_state: dict[str, Any], metadata: dict[str, Any], buffers: HostBuffers,
    is_loading: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The sharded state dict Megatron's ``optimizer.sharded_state_dict(model_state, is_loading, metadata=metadata)``
    returns: for a save, its tensors staged into ``buffers``; for a load, tensors to read into, in ``buffers`` where
    a later save stages the same tensors (pinned: the copies to the GPU after reading run at the link's speed)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
    from megatron.core.optimizer import ChainedOptimizer

    if not isinstance(optimizer, ChainedOptimizer):
        return _one(optimizer, model_state, metadata, buffers, is_loading)
    if len(optimizer.chained_optimizers) == 1:
        return _one(optimizer.chained_optimizers[0], model_state, metadata, buffers, is_loading)
    # As ChainedOptimizer.sharded_state_dict: one entry per optimizer, its tensors' keys prefixed.
    megatron_internals.synchronize_steps(optimizer)  # Megatron's own step alignment (a no-op for torch's Adam)
    state = {}
    for index, member in enumerate(optimizer.chained_optimizers):
        state[index] = _one(member, model_state, metadata, buffers, is_loading)
        add_prefix_for_sharding(state[index], f"chained_{index}.")
    return state


def builds(optimizer: Any) -> bool:
    """Whether :func:`optimizer_state` builds the state of ``optimizer`` (of each optimizer it chains) itself."""
    from megatron.core.optimizer import ChainedOptimizer

    members = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return all(covered(member) for member in members)


def covered(optimizer: Any) -> bool:
    """Whether :func:`optimizer_state` builds this (non-chained) optimizer's state itself."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (
        type(optimizer) is DistributedOptimizer
        and isinstance(optimizer.optimizer, torch.optim.Optimizer)
        and type(optimizer.optimizer).__name__ != "HybridDeviceOptimizer"
        and not optimizer.config.use_precision_aware_optimizer
        and not optimizer.ddp_config.use_megatron_fsdp
    )


def _one(
    optimizer: Any, model_state: dict[str, Any], metadata: dict[str, Any], buffers: HostBuffers, is_loading: bool
) -> Any:
    if metadata.get("distrib_optim_sharding_type") != SHARDING_TYPE or not covered(optimizer):
        return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
    state = optimizer.state_dict()  # param groups and the step (DP-independent), as Megatron's method starts
    if is_loading:
        optimizer.load_state_dict(optimizer.state_dict())  # as Megatron's method does before a load
        state["param_state"] = _load_targets(optimizer, _model_tensors(model_state), buffers)
    else:
        state["param_state"] = _param_state(optimizer, _model_tensors(model_state), buffers)
    state["param_state_sharding_type"] = SHARDING_TYPE
    return state


def _load_targets(optimizer: Any, model_tensors: dict[Tensor, Any], buffers: HostBuffers) -> dict[int, Any]:
    """Megatron's load entries (every rank reads each parameter's whole state, its loader keeps its own shard),
    in the order its loader counts them; host tensors to read into (see :func:`optimizer_state`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    keys = ("param", *optimizer.optimizer_state_keys)
    state: dict[int, Any] = {}
    for buffer in optimizer.buffers:
        for param in buffer.param_index_map:
            entry, tensors = _entry(model_tensors, param), {}
            for key in keys:
                tensors[key] = target = renamed(entry, key, entry.data)  # (its data is replaced right away)
                if isinstance(entry, ShardedTensorFactory):  # loaded in pieces, then merged: a tensor of its own
                    target.data = torch.empty(entry.data.shape, dtype=torch.float32)
                else:  # the buffer the next save stages this tensor into
                    target.dtype = torch.float32
                    target.data = buffers.take(name_of(target), entry.data.shape, torch.float32, param.is_cuda)
            state[len(state)] = tensors
    return state


def _entry(model_tensors: dict[Tensor, Any], param: Tensor) -> Any:
    """The model's sharded tensor (or factory) of ``param``, which names its optimizer state."""
    entry = model_tensors.get(param)
    if entry is None:
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} the optimizer holds is not in the model's sharded state dict "
            "(every trainable parameter must be: its sharded_state_dict must keep the parameters themselves)"
        )
    if getattr(entry, "flattened_range", None) is not None:
        raise ValueError(f"{entry.key}: flattened sharded tensors are not supported by the fully_reshardable format")
    return entry


def renamed(entry: Any, key: str, data: Tensor) -> Any:
    """``entry`` (the parameter's sharded tensor or factory) as the optimizer state ``key`` holding ``data``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    changes: dict[str, Any] = dict(key=f"{_PREFIX}.{key}.{entry.key}", data=data, replica_id=entry.replica_id)
    if not isinstance(entry, ShardedTensorFactory):
        changes["dtype"] = data.dtype
    renamed = dataclasses.replace(entry, **changes)
    renamed.validate_metadata_integrity()
    return renamed


def _model_tensors(model_state: dict[str, Any]) -> dict[Tensor, Any]:
    """Each parameter's sharded tensor (or factory) in the model's sharded state dict, by parameter."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_state)
    return {item.data: item for item in nested_values(tensors)}


def _param_state(optimizer: Any, model_tensors: dict[Tensor, Any], buffers: HostBuffers) -> dict[int, Any]:
    """``{index: {state key: sharded tensor}}`` in Megatron's parameter order (its loader counts them the same
    way), each tensor staged in ``buffers`` right away (so at most one parameter's gathered state is on the device)."""
    keys = ("param", *optimizer.optimizer_state_keys)
    state: dict[int, Any] = {}
    for gbuf_index, buffer in enumerate(optimizer.buffers):
        ranges = optimizer.gbuf_ranges[gbuf_index]
        assert len(ranges) == 1, "one dtype per gradient buffer, as Megatron's own method assumes"
        local = {p: r["param"] for bucket in next(iter(ranges.values())) for p, r in bucket["param_map"].items()}
        for param, (start, end, bucket) in buffer.param_index_map.items():
            entry = _entry(model_tensors, param)
            offset = buffer.buckets[bucket].offset
            span = (start - offset, end - offset, buffer.buckets[bucket].grad_data.numel())
            mine = _state_of(optimizer, param) if param in local else {}
            # One state at a time: the device holds at most one state of one parameter beside the model.
            state[len(state)] = {key: _staged(entry, key, _whole(optimizer, mine.get(key), param, span), buffers)
                                 for key in keys}  # fmt: skip
    buffers.finish()
    return state


def _whole(optimizer: Any, mine: Tensor | None, param: Tensor, span: tuple[int, int, int]) -> Tensor:
    """One state of ``param`` as a whole flat fp32 tensor: this rank's own at DP=1, else each piece broadcast by the
    rank holding it (rank ``r`` holds ``[r, r + 1) * bucket / DP`` of the bucket; ``span`` is the parameter's
    ``(start, end)`` in its bucket and the bucket's size). ``mine``: this rank's piece, if it holds one."""
    group = optimizer.data_parallel_group
    size = group.size() if group is not None else 1
    if size == 1:
        assert mine is not None
        return mine.detach().view(-1).float()
    start, end, bucket_numel = span
    shard, rank = bucket_numel // size, group.rank()
    flat = torch.empty(end - start, dtype=torch.float32, device=param.device)
    for r in range(size):
        first, last = max(start, r * shard), min(end, (r + 1) * shard)
        if first < last:
            piece = flat[first - start : last - start]  # a contiguous slice: broadcast into it in place
            if r == rank:
                assert mine is not None
                piece.copy_(mine.detach().view(-1))
            torch.distributed.broadcast(piece, src=torch.distributed.get_global_rank(group, r), group=group)
    return flat


def _state_of(optimizer: Any, param: Tensor) -> dict[str, Tensor]:
    """This rank's fp32 main weight (``"param"``) and optimizer states of ``param``'s shard."""
    group, order = optimizer.model_param_group_index_map[param]
    main = optimizer.optimizer.param_groups[group]["params"][order]
    states = optimizer.optimizer.state[main]
    return {"param": main, **{k: v for k, v in states.items() if isinstance(v, Tensor) and k != "step"}}


def _staged(entry: Any, key: str, flat: Tensor, buffers: HostBuffers) -> Any:
    """The state ``key`` of the parameter of ``entry`` as a sharded tensor named like Megatron's
    (``optimizer.state.<key>.<name>``, the parameter's replica id), staged now, while ``flat`` is alive. A factory
    (e.g. SwiGLU's two halves) becomes its pieces, as saving it would."""
    tensors = {key: renamed(entry, key, flat.view(entry.data.shape))}
    stage_state(tensors, buffers)
    return tensors[key]
