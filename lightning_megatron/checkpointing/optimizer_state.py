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

from lightning_megatron.checkpointing.staging import HostBuffers, name_of, stage_state

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
    optimizer._synchronize_steps()  # Megatron's own step alignment (a no-op for torch's Adam)
    state = {}
    for index, member in enumerate(optimizer.chained_optimizers):
        state[index] = _one(member, model_state, metadata, buffers, is_loading)
        add_prefix_for_sharding(state[index], f"chained_{index}.")
    return state


def covered(optimizer: Any) -> bool:
    """Whether :func:`optimizer_state` builds this (non-chained) optimizer's state itself."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (
        type(optimizer) is DistributedOptimizer
        and isinstance(optimizer.optimizer, torch.optim.Optimizer)
        and type(optimizer.optimizer).__name__ != "HybridDeviceOptimizer"
        and not optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
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
            entry, tensors = model_tensors[param], {}
            for key in keys:
                tensors[key] = target = _renamed(entry, key, torch.empty(entry.data.shape, dtype=torch.float32))
                if not isinstance(entry, ShardedTensorFactory):  # (a factory's pieces are merged: its own tensor)
                    target.data = buffers.take(name_of(target), target.data.shape, target.data.dtype, param.is_cuda)
            state[len(state)] = tensors
    return state


def _renamed(entry: Any, key: str, data: Tensor) -> Any:
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
            entry = model_tensors.get(param)
            if entry is None:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the model's sharded state dict")
            offset = buffer.buckets[bucket].offset
            span = (start - offset, end - offset, buffer.buckets[bucket].grad_data.numel())
            flats = _whole_state(optimizer, param, param in local, span, keys)
            state[len(state)] = _param_entries(entry, flats, buffers)
    buffers.finish()
    return state


def _whole_state(
    optimizer: Any, param: Tensor, held: bool, span: tuple[int, int, int], keys: tuple[str, ...]
) -> dict[str, Tensor]:
    """``{state key: the parameter's whole flat fp32 state}``: this rank's own tensors at DP=1, else each piece
    broadcast by the rank holding it (rank ``r`` holds ``[r, r + 1) * bucket / DP`` of the bucket; ``span`` is the
    parameter's ``(start, end)`` in its bucket and the bucket's size), so the device holds one parameter's state."""
    group = optimizer.data_parallel_group
    size = group.size() if group is not None else 1
    mine = _state_of(optimizer, param) if held else {}
    if size == 1:
        return {key: mine[key].detach().view(-1) for key in keys}
    start, end, bucket_numel = span
    shard, rank = bucket_numel // size, group.rank()
    flat = torch.empty(len(keys), end - start, dtype=torch.float32, device=param.device)
    for r in range(size):
        first, last = max(start, r * shard), min(end, (r + 1) * shard)
        if first >= last:
            continue
        if r == rank:
            piece = torch.stack([mine[key].detach().view(-1).float() for key in keys])
        else:
            piece = torch.empty(len(keys), last - first, dtype=torch.float32, device=param.device)
        torch.distributed.broadcast(piece, src=torch.distributed.get_global_rank(group, r), group=group)
        flat[:, first - start : last - start].copy_(piece)
    return {key: flat[i] for i, key in enumerate(keys)}


def _state_of(optimizer: Any, param: Tensor) -> dict[str, Tensor]:
    """This rank's fp32 main weight (``"param"``) and optimizer states of ``param``'s shard."""
    group, order = optimizer.model_param_group_index_map[param]
    main = optimizer.optimizer.param_groups[group]["params"][order]
    states = optimizer.optimizer.state[main]
    return {"param": main, **{k: v for k, v in states.items() if isinstance(v, Tensor) and k != "step"}}


def _param_entries(entry: Any, flats: dict[str, Tensor], buffers: HostBuffers) -> dict[str, Any]:
    """The parameter's state tensors as sharded tensors named like Megatron's (``optimizer.state.<key>.<name>``,
    the parameter's replica id), staged."""
    tensors = {key: _renamed(entry, key, flat.view(entry.data.shape)) for key, flat in flats.items()}
    stage_state(tensors, buffers)  # now, while the gathered bucket is alive
    return tensors
