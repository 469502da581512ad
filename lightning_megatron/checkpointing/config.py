"""The checkpoint writer's settings: ``MegatronStrategy(checkpoint=CheckpointConfig(...))``, or from a LightningCLI
YAML under ``trainer.strategy.init_args.checkpoint``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How the strategy saves and loads its sharded checkpoints. Every field is checked when the config is made
    (``ValueError`` naming the field, the value and what works)."""

    async_save: bool = False
    """Write checkpoints in a background writer process per rank (started when a fit starts and kept for it) from
    host copies of the tensors: a save returns once the copies are made, and the checkpoint is published once every
    rank has written it (at the latest at the next save, before a load or at the end of the fit). Linux only (the host
    copies are ``memfd_create`` shared memory). Also ``MegatronStrategy(async_save=...)``."""
    save_model_weights: bool = True
    """Whether a checkpoint that holds the optimizer state also holds the model's trained weights. ``False``: they
    are stored once, as the optimizer's fp32 main weights, and rebuilt from those on load (the model's bf16 copy is
    their rounding, so a resume continues exactly); with bf16 weights and Adam the checkpoint is 2 of 14 bytes per
    parameter (about 14%) smaller. Weights-only saves still hold the weights; loading the weights alone from such a
    checkpoint reads the main weights. Changes made to the parameters outside the optimizer (weight averaging swapped
    into the model) are not saved. Needs the distributed optimizer (checked when the run starts)."""
    keep_host_buffers: bool = True
    """Whether the host buffers the tensors are staged in stay allocated from one save to the next, so that a later
    save allocates nothing (about 14 bytes per parameter of the rank's share, pinned, for the whole run). ``False``:
    they go back to the system once each save is written (synchronous) or published (async) and after each load, so
    host memory is taken only while a checkpoint is saved or loaded; each save then allocates and pins them again
    (seconds per 10 GB, in the step that saves), and they are not staged when the fit starts."""
    read_threads: int | None = None
    """Threads each rank reads a checkpoint's tensors with when the strategy loads one: ``None``, the CPUs this
    process may use, shared by the node's ranks, at most 8; ``1``: Megatron's own reader, one tensor after the
    other."""

    def __post_init__(self) -> None:
        for name in ("async_save", "save_model_weights", "keep_host_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CheckpointConfig({name}={getattr(self, name)!r}): give True or False")
        threads = self.read_threads
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(
                f"CheckpointConfig(read_threads={threads!r}): give a positive int (1 reads with Megatron's reader, one "
                "tensor after the other) or None (the CPUs per rank, at most 8)"
            )


def with_async_save(checkpoint: CheckpointConfig | None, async_save: bool | None) -> CheckpointConfig:
    """The settings of ``MegatronStrategy(checkpoint=..., async_save=...)``: ``async_save`` alone (``None``: not
    given) is ``CheckpointConfig(async_save=...)``; given with a ``checkpoint`` whose ``async_save`` differs, it is
    refused (``ValueError``) rather than one of the two silently winning."""
    if checkpoint is None:
        return CheckpointConfig(async_save=False if async_save is None else async_save)
    if not isinstance(checkpoint, CheckpointConfig):
        raise TypeError(
            f"MegatronStrategy(checkpoint={checkpoint!r}): give a lightning_megatron.CheckpointConfig(...) (a YAML "
            "gives its fields as a mapping under checkpoint:)"
        )
    if async_save is not None and async_save != checkpoint.async_save:
        raise ValueError(
            f"MegatronStrategy(async_save={async_save!r}, checkpoint=CheckpointConfig(async_save="
            f"{checkpoint.async_save!r}, ...)) disagree: give async_save once, best as "
            "CheckpointConfig(async_save=...)"
        )
    return checkpoint
