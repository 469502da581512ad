"""Sharded checkpoints through Megatron's ``dist_checkpointing``, reshardable across layouts.

A checkpoint is a directory. Model chunks, the (distributed) optimizer state and everything Lightning puts into
its checkpoint dict (loops, callbacks, LR schedule, hyper-parameters) are saved together: tensors as sharded
tensors keyed by their *global* names (layer numbers include the pipeline/VPP offset), the rest as Megatron's
common state. Loading at another TP/PP/VPP/DP layout reads the same global tensors with other shards. Writing
(crash-safe publish, checksums, the writer lock) is :mod:`.saving`'s; every read starts with
:func:`.opening.open_checkpoint`.

The megatron-core 0.19 workarounds that loading needs on the torch-native Adam path (no Transformer Engine / apex)
live in :mod:`lightning_megatron.checkpointing.mcore_fixes` and :class:`lightning_megatron.patches.KeepAdamStepOnLoad`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron import patches
from lightning_megatron.checkpointing import checks, checksums, main_weights, mcore_fixes, opening, optimizer_split
from lightning_megatron.checkpointing.optimizer_state import builds, optimizer_state
from lightning_megatron.checkpointing.partial_load import keep_missing_at_init
from lightning_megatron.checkpointing.reading import Reading, ThreadedReader
from lightning_megatron.checkpointing.staging import HostBuffers, stage_state
from lightning_megatron.parallel.state import data_parallel_group
from lightning_megatron.training.averaging import KEY_PREFIX, STATE_KEY, WeightAverage, averaged_entry

# Reshardable across TP, PP, VPP and DP: the optimizer state is gathered per parameter on save.
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_MODEL_KEY = "model{}"
_OPTIMIZER_KEY = "optimizer"
MODEL_CONFIG_KEY = "model_config"
"""Common-state entry holding the module's ModelConfig (a plain dict), checked when resuming."""
CONTENTS_KEY = "megatron_contents"
"""Common-state entry naming what the checkpoint holds: ``["model"]`` (weights only) or ``["model", "optimizer"]``;
``"trainable"`` instead of ``"model"``: only the trainable weights (LoRA adapters), the frozen base is elsewhere."""
FROZEN_BASE_KEY = "megatron_frozen_base"
"""Common-state entry of a ``"trainable"`` checkpoint: where its frozen base weights come from (``{"hf": dir}`` or
``{"checkpoint": dir}``)."""
Weights = Literal["all", "trainable", "frozen"]
SCHEDULER_KEY = "megatron_lr_scheduler"
"""Common-state entry holding Megatron's LR schedule (with the optimizer state only)."""


def chunk_key(index: int) -> str:
    # Each chunk under its own key: VPP chunks' local parameter names collide.
    return _MODEL_KEY.format(index)


def sharded_state_dict(
    chunks: Sequence[nn.Module], optimizer: Any | None = None, *, is_loading: bool = False, weights: Weights = "all",
    buffers: HostBuffers | None = None, model_weights: bool = True, average: WeightAverage | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Model chunks' (and optionally the Megatron optimizer's) sharded state dict: all weights, the trainable
    parameters only (LoRA adapters count as trainable even if frozen for a while), or all but those (``weights``).
    With ``buffers`` a save stages every tensor into those host buffers (:mod:`.staging`), and a load reads the
    optimizer state into them. ``model_weights=False`` (a save with the optimizer): the parameters the optimizer
    trains are left out of the model's part, their fp32 main weights being saved (:mod:`.main_weights`). With
    ``average`` (a :class:`~lightning_megatron.training.averaging.WeightAverage` of the chunks), the average too,
    sharded as the weights."""
    if buffers is not None:
        buffers.begin()
    state: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        chunk_state = chunk.sharded_state_dict(metadata=_METADATA)  # type: ignore[operator]
        if weights != "all":
            trainable = {n for n, p in chunk.named_parameters() if p.requires_grad or getattr(p, "is_adapter", False)}
            chunk_state = {k: v for k, v in chunk_state.items() if (k in trainable) == (weights == "trainable")}
        state[chunk_key(i)] = chunk_state
    if optimizer is not None:
        # Loading into a fresh optimizer, or saving before its first step: the state it has after a step, all zeros
        # (Adam's first step from it is the same as from no state at all).
        mcore_fixes.init_adam_state(optimizer)
        if buffers is not None:  # the optimizer state built on the device, in host buffers (.optimizer_state)
            state[_OPTIMIZER_KEY] = optimizer_state(optimizer, state, _METADATA, buffers, is_loading=is_loading)
        else:
            state[_OPTIMIZER_KEY] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_METADATA)
        if not (model_weights or is_loading):
            model_states = [state[chunk_key(i)] for i in range(len(chunks))]
            main_weights.leave_out_trained_weights(model_states, optimizer, state[_OPTIMIZER_KEY])
    if average is not None:  # after the optimizer's, which maps its state to the weights' entries by their data
        average.bind(chunks)
        state[STATE_KEY] = average.sharded_state([chunk.sharded_state_dict(metadata=_METADATA) for chunk in chunks])
    if buffers is not None and not is_loading:
        stage_state(state, buffers)
        buffers.finish()
    return state


def checkpoint_state(
    checkpoint: dict[str, Any], chunks: Sequence[nn.Module], optimizer: Any | None, scheduler: Any | None,
    model_config: dict[str, Any] | None, frozen_base: dict[str, str] | None = None,
    buffers: HostBuffers | None = None, model_weights: bool = True, average: WeightAverage | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What a save writes: Lightning's checkpoint dict (loops, callbacks, hyper-parameters, its ``state_dict``: the
    module's state outside its chunks, :mod:`.module_state`; its placeholder ``optimizer_states`` dropped), the
    ``ModelConfig`` and the sharded model chunks (and their ``average``, if given) -- plus the
    optimizer state and LR schedule unless Lightning asked for weights only (its dict has no ``optimizer_states``)
    or there is no optimizer (after validate/test/predict). With ``frozen_base`` (where the frozen weights can be
    read again) only the trainable weights are written, and the reference. With ``buffers`` the tensors are host
    copies in those buffers (:mod:`.staging`), so training may change the originals while the save is written.
    ``model_weights=False``: with the optimizer state, the trained weights are saved only as its main weights.

    Raises ``ValueError`` naming an entry that loading (``weights_only``) would refuse, before anything is written.
    """
    with_optimizer = optimizer is not None and "optimizer_states" in checkpoint
    state = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    state[MODEL_CONFIG_KEY] = model_config
    state[CONTENTS_KEY] = ["trainable" if frozen_base else "model"] + (["optimizer"] if with_optimizer else [])
    state[opening.CHECKSUMS_KEY] = checksums.SCHEME  # a load then refuses it without its checksum files
    if frozen_base:
        state[FROZEN_BASE_KEY] = frozen_base
    if with_optimizer and scheduler is not None:
        state[SCHEDULER_KEY] = scheduler.state_dict()
    checks.check_loadable(state)
    weights: Weights = "trainable" if frozen_base else "all"
    optimizer = optimizer if with_optimizer else None
    model_weights = model_weights or optimizer is None or weights != "all"
    kwargs = {"weights": weights, "buffers": buffers, "model_weights": model_weights, "average": average}
    state.update(sharded_state_dict(chunks, optimizer, **kwargs))
    return state


def module_state(
    checkpoint: dict[str, Any], module: Any, optimizer: Any, scheduler: Any, buffers: HostBuffers | None = None,
    model_weights: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """:func:`checkpoint_state` of a MegatronLightningModule: its unwrapped chunks (the DDP wrappers' state-dict
    keys carry a "module." prefix), its ``ModelConfig``, where its frozen weights can be read again, and its
    weight average (``module.weight_average``, kept by a weight-averaging callback)."""
    chunks, config, base = list(module.chunks), model_config_dict(module), module.frozen_base()
    return checkpoint_state(
        checkpoint, chunks, optimizer, scheduler, config, frozen_base=base, buffers=buffers,
        model_weights=model_weights, average=module.weight_average,
    )  # fmt: skip


def load_module(
    module: Any, optimizer: Any | None, path: str | Path, scheduler: Any | None, reading: Reading | None = None
) -> dict[str, Any]:
    """Collective: :func:`load` into a MegatronLightningModule's chunks (and ``optimizer``, ``scheduler``, its
    ``weight_average``); the checkpoint's non-tensor entries, its ``state_dict`` the module's state outside the chunks
    (``None`` for a checkpoint written before that was saved)."""
    config, frozen = model_config_dict(module), module.frozen_base()
    chunks, average = list(module.chunks), module.weight_average
    # The module's strict_loading, as Lightning's load_state_dict honours it; a resume loads the optimizer state
    # too, which must match the model exactly.
    if module.trainer.state.fn != "fit":  # validate/test/predict(ckpt_path): the weights only (not into the optimizer
        optimizer = scheduler = None  # an earlier fit left, whose main weights would then overwrite them)
    strict = module.strict_loading is not False or optimizer is not None
    loaded = load(
        chunks, optimizer, path, config, scheduler=scheduler, frozen_base=frozen, reading=reading, average=average,
        strict=strict,
    )  # fmt: skip
    loaded.setdefault("state_dict", None)
    return loaded


def model_config_dict(module: object) -> dict[str, Any] | None:
    """The module's ``ModelConfig`` (any dataclass ``config``) as a plain dict, loadable with ``weights_only``."""
    config = getattr(module, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else None


def load(
    chunks: Sequence[nn.Module], optimizer: Any | None, path: str | Path, model_config: dict[str, Any] | None = None,
    *, scheduler: Any | None = None, frozen_base: dict[str, str] | None = None, weights: Weights | None = None,
    reading: Reading | None = None, average: WeightAverage | None = None, strict: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Collective: load model (and optimizer, LR schedule) state from ``path`` into ``chunks`` (``optimizer``,
    ``scheduler``). A saved weight average goes into ``average`` with the optimizer (a resume; without one saved,
    ``average`` starts over from the loaded weights), else it is loaded as the weights (Lightning's ``WeightAveraging``
    saves it as the checkpoint's model).

    Before anything is read collectively, every rank checks the files (complete, not truncated, metadata free of
    foreign pickled objects), the model's shape (the saved ``model_config`` against ``model_config``, every
    tensor's global shape) and the checksums of the stored entries it loads into the model (:mod:`.checksums`);
    a failure raises on every rank, with the failing rank's message. The optimizer state read into host buffers
    is verified while it is read, and a failure there raises on every rank before any of it is used. Non-tensor
    entries are unpickled with ``weights_only=True``. Returns the checkpoint's other (common) entries: Lightning's
    loops, callbacks, ...

    ``weights``: ``None`` loads what the checkpoint holds -- all weights, or only the trainable ones when it was
    saved so (then the chunks must already hold its frozen base: ``frozen_base`` names where theirs came from);
    ``"frozen"`` loads all but the trainable parameters (a base for LoRA adapters, which keep their own init).
    ``reading``: the host buffers of the strategy's saves, which the optimizer state is read into (then copied to
    the GPU from pinned memory; the next save reuses them), where the seconds each part took on this rank go (see
    ``CheckpointWriter.last_load``), and the threads per rank that read the tensors. ``strict=False``: what the
    checkpoint lacks keeps its value, what the chunks lack is not read (:mod:`.partial_load`).
    """
    path, reading = Path(path), reading or Reading()
    clock = _Clock(reading.timings)
    plan: dict[str, Any] = {}
    _raise_on_every_rank(
        lambda: plan.update(
            _plan(path, chunks, optimizer, (model_config, frozen_base, strict), weights, reading, clock, average)
        ),
        reading.group,
    )
    state = plan["state"]
    clock.lap("verify_s")
    loaded = _read(path, state, plan, clock, reading)
    loaded.pop(MODEL_CONFIG_KEY, None)
    loaded.pop(opening.CHECKSUMS_KEY, None)
    optimizer_state = loaded.pop(_OPTIMIZER_KEY, None)
    if optimizer is not None and plan["split"] is not None:  # saved at another expert-parallel size
        optimizer_state = optimizer_split.regroup(optimizer_state, *plan["split"])
    chunk_states = [loaded.pop(chunk_key(i)) for i in range(len(chunks))]
    main_weights.fill_from_optimizer(plan["from_optimizer"], chunk_states, optimizer, optimizer_state)
    for chunk, chunk_state in zip(chunks, chunk_states, strict=True):
        # A part of the weights: the rest stays as it is (the frozen base, or the adapters' own init).
        _, unexpected = chunk.load_state_dict(chunk_state, strict=plan["weights"] == "all")
        assert not unexpected, unexpected
    if optimizer is not None:
        # Copying into fp32 main params that require grad must not be recorded by autograd.
        with torch.no_grad(), patches.KeepAdamStepOnLoad(optimizer):
            optimizer.load_state_dict(optimizer_state)
        mcore_fixes.untie_adam_steps(optimizer)
    _load_average(average if optimizer is not None else None, loaded.pop(STATE_KEY, None), chunks)
    _load_schedule(scheduler, loaded.pop(SCHEDULER_KEY, None), path)
    clock.lap("apply_s")
    return loaded


def _load_average(average: WeightAverage | None, loaded: dict[str, Any] | None, chunks: Sequence[nn.Module]) -> None:
    """A resume's weight average: the checkpoint's, or else a new one from the weights just loaded."""
    if average is None:
        return
    if loaded is not None:
        average.load(loaded)
        return
    average.bind(chunks)
    average.copy_from_weights()
    average.num_averaged = 0


class _Clock:
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


def _read(path: Path, state: dict[str, Any], plan: dict[str, Any], clock: _Clock, reading: Reading) -> dict[str, Any]:
    """Collective: Megatron's load of ``state`` (in ``reading.threads`` threads, :mod:`.reading`, which verify the
    entries ``plan["verify_in_reader"]`` before reading them) while ``plan["verify_while_reading"]`` are verified in
    a thread of their own. Once every rank has read, a damaged entry it found -- or else a failed read -- raises on
    every rank, before anything read is used; the damage first, as it may be why the read failed. (A rank whose
    read fails inside Megatron's collective part of the load -- its exchange between data-parallel ranks -- still
    leaves the others there until the collective timeout.)"""
    from megatron.core import dist_checkpointing

    failure: BaseException | None = None
    threads, metadata, in_reader = reading.threads, plan["metadata"], plan["verify_in_reader"]
    verification = checksums.Verification(path, metadata, plan["verify_while_reading"])
    reads = patches.ThreadedShardReads(lambda directory: ThreadedReader(directory, threads, in_reader, metadata))
    try:
        with checks.weights_only(), reads if threads > 1 else contextlib.nullcontext():
            loaded = dist_checkpointing.load(state, str(path), sharded_strategy=_parallel_load(path))
    except (Exception, CheckpointException) as error:
        failure = error
    clock.lap("read_s")
    clock.note("read_parts", sum(reader.parts_read for reader in reads.readers))
    clock.note("read_bytes", sum(reader.bytes_read for reader in reads.readers))
    clock.note("read_verified_bytes", sum(reader.bytes_verified for reader in reads.readers))

    def check() -> None:
        verification.wait()
        if in_reader and reads.kept:  # Megatron kept its own reader (it verifies nothing): verified now instead
            checksums.verify(path, metadata, in_reader)
        for reader in reads.readers:
            reader.raise_damage()
        if failure is not None:
            raise ValueError(
                f"cannot load checkpoint {path}: {type(failure).__name__}: {failure}. (Objects other than tensors, "
                "containers and numbers are refused, as torch.load(weights_only=True) does; a trusted class can be "
                "allowed with torch.serialization.add_safe_globals([...]))"
            ) from failure

    _raise_on_every_rank(check, reading.group)
    clock.lap("verify_after_read_s")
    return loaded


def _load_schedule(scheduler: Any | None, scheduler_state: dict[str, Any] | None, path: Path) -> None:
    """Megatron's LR schedule from the checkpoint (with the optimizer state only); a changed schedule is refused."""
    if scheduler is not None and scheduler_state is not None:
        try:
            scheduler.num_steps = 0  # Megatron's load adds the saved step count to the current one (a mid-fit restore)
            scheduler.load_state_dict(scheduler_state)
        except AssertionError as error:  # Megatron asserts that the schedule settings match
            raise ValueError(
                f"the LR schedule saved in {path} differs from this run's ({error}); keep lr, min_lr, warmup_steps, "
                "decay_steps and decay_style (and Trainer(max_steps) when decay_steps=None) as they were, or, to "
                "train longer or change the schedule, pass MegatronLMModule(..., override_lr_schedule=True) "
                "(OptimizerSpec(override_lr_schedule=True) from your own configure_optimizers): this run's schedule "
                "then continues from the saved step"
            ) from error


def _parallel_load(path: Path) -> Any:
    """Megatron's fully-parallel load over the data-parallel (x context-parallel) group: a tensor that several of
    its ranks load (a replicated weight, the optimizer state every rank loads whole) is read by one of them and
    broadcast to the others. (Each rank verifies the checksums of the weights it loads before the read, and those of
    the optimizer state it reads itself as it reads them, :mod:`.reading`; with ``read_threads=1``, Megatron's reader,
    everything it loads before the read.)"""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)), data_parallel_group())


def _weights(
    path: Path, common: dict[str, Any], frozen_base: dict[str, str] | None, weights: Weights | None
) -> Weights:
    """Which weights to load: see :func:`load`."""
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


def _plan(
    path: Path, chunks: Sequence[nn.Module], optimizer: Any | None,
    model: tuple[dict[str, Any] | None, dict[str, str] | None, bool], weights: Weights | None, reading: Reading,
    clock: _Clock, average: WeightAverage | None,
) -> dict[str, Any]:  # fmt: skip
    """Check the files and the model (its ``ModelConfig``, frozen base, strictness) against them; the state dict
    to load into and which weights it holds."""
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
    model_state = {k: v for k, v in state.items() if k != _OPTIMIZER_KEY}
    if not strict:  # what the checkpoint lacks keeps its value, what it holds beyond the model is not read
        diff = keep_missing_at_init(path, metadata, model_state, diff)
    optimizer_request = state.get(_OPTIMIZER_KEY, {})  # a model of another shape first: the clearer error
    checks.check_shapes(path, metadata, model_state, diff, optional=optimizer_request)
    if selected == "trainable" and strict:  # adapters this module has no place for would be dropped silently
        checks.check_nothing_left_out(path, metadata, model_state)
    split = None if optimizer is None else _optimizer_split(path, metadata, optimizer, state[_OPTIMIZER_KEY], buffers)
    # Last, as it reads the shards: each rank verifies the stored entries it loads -- those read in place into the
    # model now; the optimizer state read into host buffers, which reaches the optimizer only after the read, while
    # it is read (:func:`_read`), so that the disk is read once: in a thread of its own with one data-parallel rank;
    # with several, where Megatron's fully-parallel load exchanges what each rank read, by the reading threads
    # (:mod:`.reading`), each rank its share, not reading a damaged part (a read that broke on it would leave the
    # others waiting in the exchange); with Megatron's own reader (read_threads=1) before the read.
    clock.lap("check_s")
    group = data_parallel_group()
    exchange = group is not None and torch.distributed.get_world_size(group) > 1
    later = set(_stored_items(metadata, {_OPTIMIZER_KEY: state[_OPTIMIZER_KEY]})) if reads else set()
    while_reading = set() if exchange else later
    in_reader = later if exchange and reading.threads > 1 else set()
    checksums.verify(path, metadata, items=set(_stored_items(metadata, state)) - while_reading - in_reader)
    return {"state": state, "weights": selected, "split": split, "from_optimizer": from_optimizer,
            "metadata": metadata, "verify_while_reading": while_reading, "verify_in_reader": in_reader}  # fmt: skip


def _request(
    metadata: Any, chunks: Sequence[nn.Module], optimizer: Any | None, selected: Weights, buffers: HostBuffers | None,
    average: WeightAverage | None,
) -> dict[str, Any]:  # fmt: skip
    """The state to load into; a saved weight average into ``average`` (with the optimizer), or into the weights
    themselves (without: see :func:`load`)."""
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


def _raise_on_every_rank(check: Callable[[], None], group: Any | None = None) -> None:
    """Run a local check on every rank; if it fails anywhere, raise on every rank (no rank left in a collective),
    with the failing rank's message. ``group``: the group of all ranks to agree in (``None``: the default one)."""
    error: BaseException | None = None
    try:
        check()
    except (Exception, CheckpointException) as caught:  # whatever it hit, no rank may go on into the load
        error = caught
    rank, world = (0, 1)
    if torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    messages: list[str | None] = [None if error is None else f"{type(error).__name__}: {error}"] * world
    if world > 1:
        torch.distributed.all_gather_object(messages, messages[rank], group=group)
    if error is not None:
        raise error
    if failed := [(r, m) for r, m in enumerate(messages) if m is not None]:
        r, message = failed[0]
        raise ValueError(f"rank {r} found the checkpoint unusable, nothing was loaded: {message}")
