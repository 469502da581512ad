"""Checkpoints that store the trained weights once: as the optimizer's fp32 main weights, without the model's copy.

With the distributed optimizer, a checkpoint holds each trained parameter twice: the model's weight (bf16 in mixed
precision) and the optimizer's fp32 main weight (``optimizer.state.param.<key>``), from which the model's weight is
a rounding. :func:`leave_out_trained_weights` drops the model's copy from a save that writes the optimizer state
(2 of 14 bytes per parameter in bf16 with Adam). On load, :func:`read_from_main_weights` finds every model tensor
the checkpoint lacks and holds as a main weight: when the loading optimizer reads that main weight itself (a
resume), the model's weight is set from what it read (:func:`fill_from_optimizer`); otherwise (weights-only loads,
a frozen base, another optimizer) the model reads the main weight itself and rounds it to its own dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.checkpointing.format.optimizer_split import unchained
from lightning_megatron.checkpointing.format.optimizer_state import builds, renamed

_MAIN = "optimizer.state.param."


def trained_params(optimizer: Any) -> Iterator[Tensor]:
    """The parameters whose fp32 main weight ``optimizer`` holds, in the order of its saved state (per chained
    optimizer, per gradient buffer, as :mod:`.optimizer_state` stores them)."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    members = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for member in members:
        if isinstance(member, DistributedOptimizer):  # others keep no main weights in gradient buffers' order
            for buffer in member.buffers:
                yield from buffer.param_index_map


def _weight_key(key: str) -> str:
    """The parameter's key of a main-weight entry's key (``[chained_<i>.]optimizer.state.param.<key>``), else ""."""
    key = unchained(key)
    return key.removeprefix(_MAIN) if key.startswith(_MAIN) else ""


def leave_out_trained_weights(model_states: list[dict[str, Any]], optimizer: Any, optimizer_state: Any) -> None:
    """Save side: drop from each model chunk's sharded state the parameters whose fp32 main weight
    ``optimizer_state`` (the optimizer's sharded state being saved) stores under the parameter's key.

    Raises ``ValueError`` for an optimizer whose state this package does not build (a resume could not hand its
    main weights to the model), before anything is written."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not builds(optimizer):
        raise ValueError(
            f"CheckpointConfig(save_model_weights=False) needs the distributed optimizer over a torch optimizer "
            f"(MegatronStrategy(use_distributed_optimizer=True), without a precision-aware or CPU-offloading "
            f"optimizer); this run's {type(optimizer).__name__} is not: keep save_model_weights=True"
        )
    stored = {_weight_key(item.key) for item in nested_values(optimizer_state) if hasattr(item, "key")}
    held = {id(param) for param in trained_params(optimizer)}
    for chunk_state in model_states:
        for name, item in list(chunk_state.items()):
            if id(getattr(item, "data", None)) not in held:
                continue
            if item.key not in stored:  # every trained parameter's state is saved under its key (.optimizer_state)
                raise ValueError(f"CheckpointConfig(save_model_weights=False): no main weight saved for {item.key}")
            del chunk_state[name]


def read_from_main_weights(
    metadata: Any, model_states: list[dict[str, Any]], optimizer: Any | None, optimizer_reads: bool
) -> list[Any]:
    """Load side: model tensors the checkpoint lacks and holds as main weights. With an ``optimizer`` whose state
    is read per parameter (``optimizer_reads``), those of its parameters are dropped from ``model_states`` and
    returned as ``(chunk index, name, parameter)`` for :func:`fill_from_optimizer`; the others (every one without an
    optimizer) are read from the main weight into an fp32 tensor, which the model rounds when it loads it.
    Anything else the checkpoint lacks is left for the shape check to name."""
    saved = metadata.state_dict_metadata
    mains = {weight: key for key in saved if (weight := _weight_key(key))}
    trained = {id(p) for p in trained_params(optimizer)} if optimizer is not None else set()
    if trained and not optimizer_reads and any(_missing(state, saved, mains) for state in model_states):
        raise ValueError(
            f"the checkpoint stores the trained weights only as the optimizer's fp32 main weights (saved with "
            f"CheckpointConfig(save_model_weights=False)), and this load reads the optimizer state without handing "
            f"them to the model ({type(optimizer).__name__}); resume with the distributed optimizer over a torch "
            "optimizer (MegatronStrategy(use_distributed_optimizer=True)), or load the weights alone"
        )
    dropped = []
    for index, chunk_state in enumerate(model_states):
        for name, item in _missing(chunk_state, saved, mains):
            if id(item.data) in trained:
                dropped.append((index, name, item.data))
                del chunk_state[name]
            else:
                target = renamed(item, "param", torch.empty(item.data.shape, dtype=torch.float32))
                target.key = mains[item.key]  # under the chained optimizer's prefix where the saving run had one
                chunk_state[name] = target
    return dropped


def _missing(chunk_state: dict[str, Any], saved: Any, mains: dict[str, str]) -> list[tuple[str, Any]]:
    """``(name, entry)`` of the chunk's parameter entries the checkpoint holds only as main weights."""
    return [
        (name, item)
        for name, item in chunk_state.items()
        if isinstance(getattr(item, "data", None), Tensor) and item.key not in saved and item.key in mains
    ]


def fill_from_optimizer(
    dropped: list[Any], loaded_chunks: list[dict[str, Any]], optimizer: Any, optimizer_state: Any
) -> None:
    """Put each dropped parameter's loaded main weight into its chunk's loaded state (the model rounds it when it
    loads it). ``optimizer_state``: the optimizer's loaded state, in this run's structure (one optimizer's state,
    or one per chained optimizer)."""
    from megatron.core.optimizer import ChainedOptimizer

    if not dropped:
        return
    chained = isinstance(optimizer, ChainedOptimizer) and len(optimizer.chained_optimizers) > 1
    states = [optimizer_state[i] for i in range(len(optimizer.chained_optimizers))] if chained else [optimizer_state]
    members = optimizer.chained_optimizers if chained else [optimizer]
    main: dict[int, Tensor] = {}
    for member, state in zip(members, states, strict=True):
        params = list(trained_params(member))
        for index, param in enumerate(params):
            main[id(param)] = state["param_state"][index]["param"]
    for chunk, name, param in dropped:
        loaded_chunks[chunk][name] = main[id(param)].view(param.shape)
