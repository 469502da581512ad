"""Resuming an MoE run's optimizer state where Megatron splits the optimizer otherwise (another expert-parallel size).

With MoE, Megatron builds one optimizer for the dense parameters and another for the experts when their data-parallel
groups differ (``ep > 1``): a ``ChainedOptimizer``, whose checkpoint entries carry a ``chained_<i>.`` prefix, and
whose parameter groups are split by ``is_expert_parallel``. At ``ep=1`` there is one optimizer, without prefix. The
state of each parameter is the same either way (:mod:`.optimizer_state` stores it whole, under the parameter's key),
so a checkpoint of one split loads at the other:

* :func:`rekey`: every optimizer-state entry this run reads is renamed to the key the checkpoint holds it under
  (whichever optimizer held the parameter there);
* :func:`regroup`: the loaded non-tensor state (parameter groups with the step count and the learning-rate settings)
  is put in the structure this run's optimizer(s) load, each offered every saved group. Megatron pairs groups by
  their settings (``is_expert_parallel`` among them); a group the checkpoint lacks (the expert optimizer's, from a
  one-optimizer checkpoint) is the saved group of the same settings otherwise (the experts' learning rate and weight
  decay are the dense parameters').
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_PREFIX = re.compile(r"^chained_(\d+)\.")
_STATE = "optimizer.state."  # the entries of each parameter's state (.optimizer_state)


def state_keys(keys: Iterable[str]) -> list[str]:
    """The optimizer-state entries among ``keys`` (of a checkpoint's metadata or of a request)."""
    return [key for key in keys if _STATE in key]


def unchained(key: str) -> str:
    """``key`` without its ``chained_<i>.`` prefix (the optimizer that held the state), as one optimizer keys it."""
    return _PREFIX.sub("", key)


def optimizer_count(keys: Iterable[str]) -> int:
    """How many optimizers hold the state under these keys (``chained_<i>.`` prefixes; none: one)."""
    chained = {match.group(1) for key in keys if (match := _PREFIX.match(key))}
    return max(len(chained), 1)


def rekey(path: Path, request: Any, saved_keys: Iterable[str]) -> None:
    """Rename, in place, every optimizer-state entry (sharded tensor or factory) of ``request`` to the key the
    checkpoint at ``path`` holds it under; ``ValueError`` naming a parameter whose state it does not hold."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    saved = {unchained(key): key for key in state_keys(saved_keys)}
    for item in nested_values(request):
        if isinstance(item, ShardedTensor | ShardedTensorFactory):
            key = unchained(item.key)
            if key not in saved:
                raise ValueError(
                    f"checkpoint {path} holds no optimizer state {key!r}: its run trained other parameters (e.g. other "
                    "layers frozen). Resume with the same trainable parameters, or start from its weights: "
                    "YourModule.load_from_checkpoint(path), then trainer.fit without ckpt_path (a fresh optimizer)"
                )
            item.key = saved[key]


def regroup(loaded: dict[Any, Any], saved: int, wanted: int) -> Any:
    """The loaded optimizer entry (the checkpoint's non-tensor state of ``saved`` optimizers, merged with this run's
    request of ``wanted``) in the structure this run's optimizer loads: one entry, or ``{i: entry}`` if chained."""
    commons = [loaded.pop(i) for i in range(saved)] if saved > 1 else [_pop_common(loaded)]
    groups = [group for common in commons for group in common["optimizer"]["param_groups"]]
    have = {_settings(group) for group in groups}
    for group in list(groups):  # the other split's groups: the same settings (see the module docstring)
        other = {**group, "is_expert_parallel": not group.get("is_expert_parallel", False)}
        if _settings(other) not in have:
            groups.append(other)
            have.add(_settings(other))
    base = commons[0]

    def entry(param_state: Any) -> dict[str, Any]:
        return {**base, "optimizer": {**base["optimizer"], "param_groups": groups}, "param_state": param_state}

    if wanted == 1:
        return entry(loaded["param_state"])
    return {i: entry(loaded[i]["param_state"]) for i in range(wanted)}


def _pop_common(loaded: dict[Any, Any]) -> dict[str, Any]:
    return {key: loaded.pop(key) for key in list(loaded) if key != "param_state" and not isinstance(key, int)}


def _settings(group: dict[str, Any]) -> tuple:
    """What Megatron pairs a saved group with a current one by (``param_group_identifier_keys``)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys)
