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

from lightning_megatron.parallel.state import data_parallel_group


class SavePlans:
    """The save strategies of one strategy's checkpoints, by structure (the last few structures saved)."""

    KEPT = 4
    """Structures kept: a run saves one or two (a full save, a weights-only or adapter save)."""

    def __init__(self) -> None:
        self._by_structure: dict[str, Any] = {}
        self.made = 0
        """Strategies made so far: one per structure (a later save of the same structure adds none)."""

    def strategy_for(self, state: dict[str, Any]) -> tuple[Any, str | None]:
        """Collective (one small all-gather). The save strategy for ``state``, and, when every rank has not saved
        this structure before, its fingerprint (the save must then check the sharding, and :meth:`remember` the
        strategy once it succeeded); ``None`` for a known structure."""
        fingerprint = structure(state)
        known = [fingerprint in self._by_structure] * torch.distributed.get_world_size()
        if len(known) > 1:
            torch.distributed.all_gather_object(known, known[0])
        if all(known):
            self._by_structure[fingerprint] = self._by_structure.pop(fingerprint)  # the most recent last
            return self._by_structure[fingerprint], None
        self.made += 1
        return _new_strategy(), fingerprint

    def remember(self, fingerprint: str, strategy: Any) -> None:
        """Keep ``strategy`` for later saves of the structure ``fingerprint`` (after its first save succeeded)."""
        self._by_structure[fingerprint] = strategy
        while len(self._by_structure) > self.KEPT:
            del self._by_structure[next(iter(self._by_structure))]

    def reused(self) -> list[bool]:
        """For each structure kept: whether its next save reuses the cached plan (Megatron has verified it)."""
        return [bool(s.base_strategy.validated_cache_reuse) for s in self._by_structure.values()]

    def clear(self) -> None:
        self._by_structure.clear()


def structure(state: dict[str, Any]) -> str:
    """A fingerprint of the sharded tensors and objects ``state`` saves and how they are sharded on this rank (not
    their values, and not the common entries: Lightning's dict changes from save to save, e.g. ModelCheckpoint's
    best-k paths, and is saved as one object whatever it holds)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    digest = hashlib.sha256()
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            fields = (value.key, value.global_shape, value.global_offset, value.axis_fragmentations, value.dtype,
                      value.replica_id, value.flattened_range, value.prepend_axis_num)  # fmt: skip
            digest.update(f"T{fields}".encode())
        elif isinstance(value, ShardedObject):
            digest.update(f"O{(value.key, value.global_shape, value.global_offset, value.replica_id)}".encode())
    return digest.hexdigest()


def _new_strategy() -> Any:
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # Over the data-parallel (x context-parallel) group, where the replicas of a weight are (expert weights are
    # replicated over a part of it): each replicated tensor is written by one of its holders there.
    return FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy(cached_metadata=True), data_parallel_group(), do_cache_distribution=True
    )
