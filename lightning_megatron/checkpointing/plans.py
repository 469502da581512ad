"""Megatron's save strategies, one per checkpoint structure, kept across saves so that later saves skip planning.

A save of a sharded checkpoint first plans: which rank writes which replicated tensor (Megatron's fully-parallel
save: each tensor that several data-parallel ranks hold is written by one of them, the work spread evenly), where
each tensor goes in which file, and a check that the shards cover every tensor exactly once. All of it depends only
on the structure of what is saved (keys, shapes, shards, dtypes), which stays the same from one training save to the
next. Megatron caches it when told that the structure is constant (``do_cache_distribution``,
``cached_metadata``); :class:`SavePlans` tells it only when it is: strategies are kept per structure fingerprint,
and a save whose structure any rank has not saved before gets fresh ones (and the sharding check).

Megatron verifies a cached plan once more at the second save of a structure; from the third on, the planning
exchanges no metadata at all.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class SavePlans:
    """The save strategies of one strategy's checkpoints, by structure."""

    def __init__(self) -> None:
        self._by_structure: dict[str, Any] = {}
        self.made = 0
        """Strategies made so far: one per structure (a later save of the same structure adds none)."""

    def strategy_for(self, state: dict[str, Any]) -> tuple[Any, bool]:
        """Collective (one small all-gather). The save strategy for ``state``, and whether it is new (then the
        save must check the sharding: ``validate_access_integrity``)."""
        fingerprint = structure(state)
        known = [fingerprint in self._by_structure] * torch.distributed.get_world_size()
        if len(known) > 1:
            torch.distributed.all_gather_object(known, known[0])
        if all(known):
            return self._by_structure[fingerprint], False
        strategy = _new_strategy()
        self._by_structure[fingerprint] = strategy
        self.made += 1
        return strategy, True

    def reused(self) -> list[bool]:
        """For each structure saved: whether its next save reuses the cached plan (Megatron has verified it)."""
        return [bool(s.base_strategy.validated_cache_reuse) for s in self._by_structure.values()]

    def clear(self) -> None:
        self._by_structure.clear()


def structure(state: dict[str, Any]) -> str:
    """A fingerprint of what ``state`` saves and how it is sharded on this rank (not the values)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    digest = hashlib.sha256()

    def visit(path: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(f"{path}/{key}", value[key])
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                visit(f"{path}/{i}", item)
        elif isinstance(value, ShardedTensor):
            fields = (value.key, value.global_shape, value.global_offset, value.axis_fragmentations, value.dtype,
                      value.replica_id, value.flattened_range, value.prepend_axis_num)  # fmt: skip
            digest.update(f"{path}:T{fields}".encode())
        elif isinstance(value, ShardedObject):
            fields = (value.key, value.global_shape, value.global_offset, value.replica_id)
            digest.update(f"{path}:O{fields}".encode())
        else:  # common state: its values change between saves, its place does not matter for the plan
            digest.update(f"{path}:C".encode())

    visit("", state)
    return digest.hexdigest()


def _new_strategy() -> Any:
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # Over the whole world: the replicas of dense weights (data-parallel ranks) and of experts (expert-data-
    # parallel ranks) are both spread; Megatron finds who holds what from the replica ids.
    return FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy(cached_metadata=True), do_cache_distribution=True
    )
