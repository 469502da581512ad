"""What ``load_from_checkpoint`` takes beyond the constructor's arguments, with Lightning's meaning or refused by name:
``map_location``, ``hparams_file``, ``weights_only`` (:func:`check_load_arguments`, :func:`hparams_from_file`) and
``strict=False`` (:func:`keep_missing_at_init`).

``strict=False`` is Lightning's ``load_state_dict(strict=False)`` for a sharded load. The load asks the checkpoint for
every entry of the chunks' sharded state dict, and the shape check refuses a checkpoint that lacks one or holds a
model of another ``ModelConfig`` (:func:`.checks.check_shapes`). Without strictness, an entry the checkpoint lacks
keeps the value the chunk was built with (its init), a tensor of the checkpoint that the module has no place for is
not read, and a warning names both; a tensor held with another shape still raises. (Megatron stores the layers of a
stack as one tensor, so another ``num_layers`` is another shape, not missing layers.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.checkpointing.format.optimizer_split import unchained
from lightning_megatron.training.averaging import KEY_PREFIX

_SHOWN = 5  # names a warning lists of each kind


def check_load_arguments(map_location: Any, weights_only: bool | None, strict: bool | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` naming a ``map_location``, ``weights_only`` or ``strict`` that cannot be
    honoured.

    ``map_location``: a device (``"cpu"``, ``"cuda:1"``, ``torch.device``) or a mapping of devices is accepted and
    changes nothing: no tensor is read here; each rank reads its shard straight onto the device of the Trainer that
    runs the module (what Lightning's Trainer does with a module loaded elsewhere: it moves it to its device),
    whatever device saved it. A callable (a storage transform) cannot be applied to a sharded read. ``weights_only``:
    checkpoints are always read weights-only, so ``False`` is refused."""
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(
            f"load_from_checkpoint(strict={strict!r}): give True, False or None (the module's strict_loading)"
        )
    if weights_only is False:
        raise ValueError(
            "load_from_checkpoint(weights_only=False): MegatronStrategy checkpoints are always read weights-only "
            "(non-tensor entries with torch.load(weights_only=True)); leave weights_only None or True, and allow a "
            "trusted class the checkpoint holds with torch.serialization.add_safe_globals([YourClass])"
        )
    if map_location is None:
        return
    devices = [*map_location.keys(), *map_location.values()] if isinstance(map_location, Mapping) else [map_location]
    for device in devices:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise TypeError(
                f"load_from_checkpoint(map_location={map_location!r}): only None, a device or a mapping of devices "
                "is accepted, and none is needed: each rank reads its shard of the weights straight onto the device "
                "of the Trainer that runs the module (choose it with Trainer(accelerator=..., devices=...)); a "
                f"callable or other storage transform cannot be applied to a sharded read ({error})"
            ) from error


def hparams_from_file(hparams_file: str | Path) -> dict[str, Any]:
    """The hyper-parameters of a ``.yaml``/``.yml`` or ``.csv`` file (Lightning's ``hparams_file``: they replace the
    checkpoint's; ``load_from_checkpoint``'s keyword arguments still override them), read with Lightning's loaders
    as plain containers (a checkpoint saved later must hold them weights-only)."""
    from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml

    path = Path(hparams_file)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".csv"):
        raise ValueError(f"hparams_file={str(hparams_file)!r}: give a .yaml, .yml or .csv file (Lightning's formats)")
    if not path.is_file():  # Lightning's loaders would warn and return {}: every saved hyper-parameter lost
        raise FileNotFoundError(f"hparams_file={str(hparams_file)!r} does not exist; pass an existing file or None")
    hparams = (
        load_hparams_from_tags_csv(path) if suffix == ".csv" else load_hparams_from_yaml(path, use_omegaconf=False)
    )
    if not isinstance(hparams, Mapping):
        raise ValueError(
            f"hparams_file={str(hparams_file)!r} holds a {type(hparams).__name__}, not a mapping of names to values"
        )
    return dict(hparams)


def keep_missing_at_init(path: Path, metadata: Any, state: Mapping[str, Any], config_diff: list[str]) -> list[str]:
    """``strict=False``: in the model's sharded request ``state`` (changed in place), replace every entry the
    checkpoint lacks by what it would load into, handed back as it is by the load (it keeps its init); warn, on rank
    zero, naming those, the checkpoint's model tensors nothing asks for (not read) and ``config_diff`` (the
    ``ModelConfig`` fields that differ). Returns the difference left for the shape check: none, as every tensor
    both hold is still compared by shape."""
    from lightning.pytorch.utilities import rank_zero_warn

    saved = metadata.state_dict_metadata
    missing: list[str] = []
    asked: set[str] = set()
    for chunk_state in state.values():
        if isinstance(chunk_state, dict):
            _keep_missing(chunk_state, saved, missing, asked)
    unread = sorted({_base_key(k) for k in saved if _is_model_key(k)} - {k.removeprefix(KEY_PREFIX) for k in asked})
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) the checkpoint lacks keep their initial values: {_some(missing)}")
    if unread:
        parts.append(
            f"{len(unread)} tensor(s) of the checkpoint this module has no place for are ignored: {_some(unread)}"
        )
    if config_diff:
        parts.append("The ModelConfig differs (" + "; ".join(config_diff) + ")")
    if parts:
        rank_zero_warn(f"load_from_checkpoint(strict=False) of {path}: " + ". ".join(parts))
    return []


def _keep_missing(chunk_state: dict[str, Any], saved: Mapping[str, Any], missing: list[str], asked: set[str]) -> None:
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    for name, item in list(chunk_state.items()):
        if isinstance(item, dict):  # a module's nested state
            _keep_missing(item, saved, missing, asked)
            continue
        if isinstance(item, ShardedObject):  # stored once per shard, under its unique key
            stored = item.unique_key in saved
        elif isinstance(item, ShardedTensor | ShardedTensorFactory):
            stored = item.key in saved
        else:
            continue
        asked.add(item.key)
        if not stored:
            chunk_state[name] = LocalNonpersistentObject(item.data)
            if item.key not in missing:  # a layer stack's or a factory's several entries: named once
                missing.append(item.key)


def _is_model_key(key: str) -> bool:
    return not unchained(key).startswith(("optimizer.", "common_state", KEY_PREFIX))


def _base_key(key: str) -> str:
    return key.split("/shard_")[0]  # a sharded object's entries: "<key>/shard_<offset>_<shape>"


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")
