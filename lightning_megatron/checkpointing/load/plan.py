"""What a load reads and how, decided on every rank before anything is read collectively (:class:`LoadPlan`).

:func:`plan_load` opens the checkpoint (:func:`.opening.open_checkpoint`), checks it against the model (its
``ModelConfig``, frozen base, strictness, every tensor's global shape), builds the state to read into and decides
which stored entries are verified when: those read in place into the model now, the optimizer state read into host
buffers while it is read (:mod:`.loading`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_megatron.checkpointing import opening
from lightning_megatron.checkpointing.format import main_weights, optimizer_split
from lightning_megatron.checkpointing.format.optimizer_state import builds
from lightning_megatron.checkpointing.integrity import checks, checksums
from lightning_megatron.checkpointing.load.partial_load import keep_missing_at_init
from lightning_megatron.checkpointing.load.reading import Reading
from lightning_megatron.checkpointing.save.staging import HostBuffers
from lightning_megatron.checkpointing.sharded import (
    CONTENTS_KEY,
    FROZEN_BASE_KEY,
    MODEL_CONFIG_KEY,
    OPTIMIZER_KEY,
    Weights,
    chunk_key,
    sharded_state_dict,
)
from lightning_megatron.parallel.state import data_parallel_group
from lightning_megatron.training.averaging import KEY_PREFIX, WeightAverage, averaged_entry


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadPlan:
    """What :func:`plan_load` decided for one load, on this rank."""

    state: dict[str, Any]
    """The sharded state dict to read into: each chunk's entries under ``chunk_key(i)``, the optimizer's under
    ``OPTIMIZER_KEY`` (with an optimizer), a weight average's (into the average, with an optimizer)."""
    weights: Weights
    """Which weights ``state`` holds: ``"all"``, ``"trainable"`` (a checkpoint of LoRA adapters: the frozen base
    stays as it is) or ``"frozen"`` (all but the trainable ones: a base for adapters)."""
    split: tuple[int, int] | None
    """``(saved, wanted)`` optimizer counts when the checkpoint's optimizer state is split otherwise than this run's
    (MoE at another expert-parallel size: regrouped after the read, :mod:`.optimizer_split`); None for the same."""
    from_optimizer: list[Any]
    """``(chunk index, name, parameter)`` of the model tensors the checkpoint holds only as the optimizer's fp32 main
    weights (``CheckpointConfig(save_model_weights=False)``), filled from the optimizer state once it is read."""
    metadata: Any
    """The checkpoint's torch DCP metadata (where each stored entry lies)."""
    verify_while_reading: set[Any]
    """Stored entries (``metadata.storage_data`` keys) whose checksums a thread of their own verifies while
    Megatron reads (the optimizer state, with one data-parallel rank)."""
    verify_in_reader: set[Any]
    """Stored entries the reading threads verify right before reading them (each rank its share of the optimizer
    state, with several data-parallel ranks and ``read_threads > 1``)."""


class Clock:
    """Seconds since the last lap, recorded into ``timings`` (if any) under each lap's name."""

    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings, self.last = timings, time.perf_counter()

    def note(self, name: str, value: float) -> None:
        if self.timings is not None:
            self.timings[name] = value

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[name] = now - self.last
        self.last = now


def plan_load(
    path: Path, chunks: Sequence[nn.Module], optimizer: Any | None,
    model: tuple[dict[str, Any] | None, dict[str, str] | None, bool], weights: Weights | None, reading: Reading,
    clock: Clock, average: WeightAverage | None,
) -> LoadPlan:  # fmt: skip
    """Check the files and the model (its ``ModelConfig``, frozen base, strictness) against them: the
    :class:`LoadPlan` of reading ``path`` into ``chunks`` (and ``optimizer``, ``average``)."""
    (model_config, frozen_base, strict), buffers = model, reading.buffers
    metadata = opening.open_checkpoint(path)
    common = opening.read_common(path, metadata)
    if optimizer is not None and "optimizer" not in common.get(CONTENTS_KEY, ["model", "optimizer"]):
        raise KeyError(
            f"Trying to restore optimizer state but checkpoint {path} contains only the model (it was saved with "
            "weights_only=True, e.g. ModelCheckpoint(save_weights_only=True), or after validate/test/predict). "
            "It loads for validate/test/predict; to fine-tune from its weights build the module with "
            f"YourModule.load_from_checkpoint({str(path)!r}) and call trainer.fit without ckpt_path"
        )
    selected = _weights(path, common, frozen_base, weights)
    clock.lap("open_s")
    state = _request(metadata, chunks, optimizer, selected, buffers, average)
    clock.lap("state_s")
    reads = optimizer is not None and buffers is not None and builds(optimizer)  # each parameter's state, whole
    model_states = [state[chunk_key(i)] for i in range(len(chunks))]
    from_optimizer = main_weights.read_from_main_weights(metadata, model_states, optimizer, optimizer_reads=reads)
    diff = checks.config_mismatch(common.get(MODEL_CONFIG_KEY), model_config)
    model_state = {k: v for k, v in state.items() if k != OPTIMIZER_KEY}
    if not strict:  # what the checkpoint lacks keeps its value, what it holds beyond the model is not read
        diff = keep_missing_at_init(path, metadata, model_state, diff)
    optimizer_request = state.get(OPTIMIZER_KEY, {})  # a model of another shape first: the clearer error
    checks.check_shapes(path, metadata, model_state, diff, optional=optimizer_request)
    if selected == "trainable" and strict:  # adapters this module has no place for would be dropped silently
        checks.check_nothing_left_out(path, metadata, model_state)
    split = None if optimizer is None else _optimizer_split(path, metadata, optimizer, state[OPTIMIZER_KEY], buffers)
    # Last, as it reads the shards: each rank verifies the stored entries it loads -- those read in place into the
    # model now; the optimizer state read into host buffers, which reaches the optimizer only after the read, while
    # it is read (:mod:`.loading`), so that the disk is read once: in a thread of its own with one data-parallel
    # rank; with several, where Megatron's fully-parallel load exchanges what each rank read, by the reading threads
    # (:mod:`.reading`), each rank its share, not reading a damaged part (a read that broke on it would leave the
    # others waiting in the exchange); with Megatron's own reader (read_threads=1) before the read.
    clock.lap("check_s")
    group = data_parallel_group()
    exchange = group is not None and torch.distributed.get_world_size(group) > 1
    later = set(_stored_items(metadata, {OPTIMIZER_KEY: state[OPTIMIZER_KEY]})) if reads else set()
    while_reading = set() if exchange else later
    in_reader = later if exchange and reading.threads > 1 else set()
    checksums.verify(path, metadata, items=set(_stored_items(metadata, state)) - while_reading - in_reader)
    return LoadPlan(
        state=state, weights=selected, split=split, from_optimizer=from_optimizer, metadata=metadata,
        verify_while_reading=while_reading, verify_in_reader=in_reader,
    )  # fmt: skip


def _weights(
    path: Path, common: dict[str, Any], frozen_base: dict[str, str] | None, weights: Weights | None
) -> Weights:
    """Which weights to load: see :func:`.loading.load`."""
    if "trainable" not in common.get(CONTENTS_KEY, ["model"]):
        return weights or "all"
    base = common.get(FROZEN_BASE_KEY)
    if weights == "frozen":
        raise ValueError(f"{path} holds only the trainable weights (LoRA adapters), not a base model; its base: {base}")
    if frozen_base is None:
        raise ValueError(
            f"checkpoint {path} holds only the trainable weights (LoRA adapters) and their optimizer state; the frozen "
            f"base weights come from {base}: build the module on that base (from_hf(dir, lora=...) for an HF "
            f"directory), or with YourModule.load_from_checkpoint({str(path)!r}), which does it"
        )
    ours, theirs = frozen_base.get("fingerprint"), (base or {}).get("fingerprint")
    if ours and theirs and ours != theirs:
        raise ValueError(
            f"checkpoint {path} holds LoRA adapters trained on the frozen base {base}, and this module's base "
            f"{frozen_base} holds other weights (config.json or the weight files differ); build it on that base"
        )
    if not (ours and theirs) and frozen_base != base:  # no fingerprints to compare (a checkpoint base): the paths
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"checkpoint {path} was trained on the frozen base {base}; this module's base is {frozen_base}")
    return "trainable"


def _request(
    metadata: Any, chunks: Sequence[nn.Module], optimizer: Any | None, selected: Weights, buffers: HostBuffers | None,
    average: WeightAverage | None,
) -> dict[str, Any]:  # fmt: skip
    """The state to load into; a saved weight average into ``average`` (with the optimizer), or into the weights
    themselves (without: see :func:`.loading.load`)."""
    saved = metadata.state_dict_metadata
    has_average = any(key.startswith(KEY_PREFIX) for key in saved)
    into_average = average if has_average and optimizer is not None else None
    state = sharded_state_dict(
        chunks, optimizer, is_loading=True, weights=selected, buffers=buffers, average=into_average
    )
    if has_average and optimizer is None:
        for i in range(len(chunks)):
            state[chunk_key(i)] = {name: averaged_entry(entry) if KEY_PREFIX + entry.key in saved else entry
                                   for name, entry in state[chunk_key(i)].items()}  # fmt: skip
    return state


def _optimizer_split(
    path: Path, metadata: Any, optimizer: Any, request: Any, buffers: HostBuffers | None
) -> tuple[int, int] | None:
    """``(saved, wanted)`` optimizer counts when the checkpoint's optimizer state is split otherwise than this run's
    (MoE at another expert-parallel size), its entries renamed to the checkpoint's (:mod:`.optimizer_split`); None
    for the same split. Megatron's own state dicts (an optimizer :mod:`.optimizer_state` does not build) refuse."""
    saved_keys = optimizer_split.state_keys(metadata.state_dict_metadata)
    wanted_keys = optimizer_split.state_keys(_sharded_keys(request))
    if not saved_keys or not wanted_keys:
        return None
    saved, wanted = optimizer_split.optimizer_count(saved_keys), optimizer_split.optimizer_count(wanted_keys)
    if saved == wanted:
        return None
    if buffers is None or not builds(optimizer):
        raise checks.optimizer_split_error(path, saved, wanted, type(optimizer).__name__)
    optimizer_split.rekey(path, request, saved_keys)
    return saved, wanted


def _sharded_keys(state: Any) -> list[str]:
    """The keys of the sharded tensors and factories in ``state``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return [item.key for item in nested_values(state) if isinstance(item, ShardedTensor | ShardedTensorFactory)]


def _stored_items(metadata: Any, state: dict[str, Any]) -> list[Any]:
    """The entries of ``metadata.storage_data`` a load of ``state`` reads (the common state is checked apart)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    keys = {item.key for item in nested_values(state) if isinstance(item, ShardedBase)}
    # A sharded object is stored as "<key>/shard_<offset>_<shape>".
    return [index for index in metadata.storage_data if index.fqn.split("/shard_")[0] in keys]
