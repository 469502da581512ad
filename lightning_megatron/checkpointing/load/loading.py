"""Loading a sharded checkpoint (:mod:`.sharded`'s format) into a module's chunks, optimizer and LR schedule, at any
layout: planned and checked on every rank first (:mod:`.plan`), then read by Megatron's fully-parallel load
(in threads of its own, :mod:`.reading`) while what is read is verified, then applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron.checkpointing import opening
from lightning_megatron.checkpointing.format import main_weights, optimizer_split
from lightning_megatron.checkpointing.integrity import checks, checksums
from lightning_megatron.checkpointing.load.plan import Clock, LoadPlan, plan_load
from lightning_megatron.checkpointing.load.reading import Reading, ThreadedReader
from lightning_megatron.checkpointing.sharded import (
    MODEL_CONFIG_KEY,
    OPTIMIZER_KEY,
    SCHEDULER_KEY,
    Weights,
    chunk_key,
    model_config_dict,
)
from lightning_megatron.compat import mcore_fixes, patches
from lightning_megatron.parallel.state import data_parallel_group
from lightning_megatron.training.averaging import STATE_KEY, WeightAverage


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
    checkpoint lacks keeps its value, what the chunks lack is not read (:mod:`.partial_load`). What is read and
    checked when: :class:`~.plan.LoadPlan`.
    """
    path, reading = Path(path), reading or Reading()
    clock = Clock(reading.timings)
    model = (model_config, frozen_base, strict)
    plan = _raise_on_every_rank(
        lambda: plan_load(path, chunks, optimizer, model, weights, reading, clock, average), reading.group
    )
    clock.lap("verify_s")
    loaded = _read(path, plan, clock, reading)
    loaded.pop(MODEL_CONFIG_KEY, None)
    loaded.pop(opening.CHECKSUMS_KEY, None)
    optimizer_state = loaded.pop(OPTIMIZER_KEY, None)
    if optimizer is not None and plan.split is not None:  # saved at another expert-parallel size
        optimizer_state = optimizer_split.regroup(optimizer_state, *plan.split)
    chunk_states = [loaded.pop(chunk_key(i)) for i in range(len(chunks))]
    main_weights.fill_from_optimizer(plan.from_optimizer, chunk_states, optimizer, optimizer_state)
    for chunk, chunk_state in zip(chunks, chunk_states, strict=True):
        # A part of the weights: the rest stays as it is (the frozen base, or the adapters' own init).
        _, unexpected = chunk.load_state_dict(chunk_state, strict=plan.weights == "all")
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


def _read(path: Path, plan: LoadPlan, clock: Clock, reading: Reading) -> dict[str, Any]:
    """Collective: Megatron's load of ``plan.state`` (in ``reading.threads`` threads, :mod:`.reading`, which verify
    the entries ``plan.verify_in_reader`` before reading them) while ``plan.verify_while_reading`` are verified in
    a thread of their own. Once every rank has read, a damaged entry it found -- or else a failed read -- raises on
    every rank, before anything read is used; the damage first, as it may be why the read failed. (A rank whose
    read fails inside Megatron's collective part of the load -- its exchange between data-parallel ranks -- still
    leaves the others there until the collective timeout.)"""
    from megatron.core import dist_checkpointing

    failure: BaseException | None = None
    threads, metadata, in_reader = reading.threads, plan.metadata, plan.verify_in_reader
    verification = checksums.Verification(path, metadata, plan.verify_while_reading)
    reads = patches.ThreadedShardReads(lambda directory: ThreadedReader(directory, threads, in_reader, metadata))
    try:
        with checks.weights_only(), reads if threads > 1 else contextlib.nullcontext():
            loaded = dist_checkpointing.load(plan.state, str(path), sharded_strategy=_parallel_load(path))
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


def _raise_on_every_rank[T](check: Callable[[], T], group: Any | None = None) -> T:
    """Run a local check on every rank and return what it returns; if it fails anywhere, raise on every rank (no
    rank left in a collective), with the failing rank's message. ``group``: the group of all ranks to agree in
    (``None``: the default one)."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = check()
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
    return result
