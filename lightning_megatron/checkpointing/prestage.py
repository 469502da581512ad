"""Host buffers staged when a fit starts, from what its checkpoint callbacks will save."""

from __future__ import annotations

from functools import partial
from typing import Any

from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_megatron.checkpointing import sharded
from lightning_megatron.checkpointing.writer import CheckpointWriter


def prestage(writer: CheckpointWriter, trainer: Any, module: Any, optimizer: Any, scheduler: Any) -> None:
    """:meth:`.writer.CheckpointWriter.prestage` of what the Trainer's checkpoint callbacks will save: the optimizer
    state too unless every one saves weights only (``ModelCheckpoint(save_weights_only=True)``), and the weights of
    weights-only saves where full saves leave them out (``save_model_weights=False``); nothing without a
    checkpoint callback but ``OnExceptionCheckpoint``, nor with ``fast_dev_run`` (saves, if any, then allocate their
    buffers themselves). Collective."""
    # An OnExceptionCheckpoint saves only after a failure, and fast_dev_run saves nothing: neither is worth host
    # memory held for the whole fit.
    callbacks = [
        callback for callback in trainer.checkpoint_callbacks if not isinstance(callback, OnExceptionCheckpoint)
    ]
    if not callbacks or trainer.fast_dev_run:
        return
    weights_only = [getattr(callback, "save_weights_only", False) for callback in callbacks]
    full, weights = not all(weights_only), any(weights_only)
    # The templates are Lightning's checkpoint dicts: "optimizer_states" is there unless the save is weights-only.
    templates: list[dict[str, Any]] = [{"optimizer_states": []}] if full else []
    # A weights-only save holds the bf16 weights: a full save's tensors already, unless save_model_weights=False left
    # them out (not a LoRA run's trainable weights, which every save holds as weights).
    full_saves_hold_weights = writer.config.save_model_weights or bool(module.frozen_base())
    if weights and not (full and full_saves_hold_weights):
        templates.append({})
    writer.prestage(*(partial(sharded.module_state, template, module, optimizer, scheduler) for template in templates))
