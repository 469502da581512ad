"""The format of a sharded checkpoint, through Megatron's ``dist_checkpointing``, reshardable across layouts.

A checkpoint is a directory. Model chunks, the (distributed) optimizer state and everything Lightning puts into
its checkpoint dict (loops, callbacks, LR schedule, hyper-parameters) are saved together: tensors as sharded
tensors keyed by their *global* names (layer numbers include the pipeline/VPP offset), the rest as Megatron's
common state under the keys below. Loading at another TP/PP/VPP/DP layout reads the same global tensors with other
shards. This module builds the state a save writes and a load reads into; writing it (crash-safe publish,
checksums, the writer lock) is :mod:`.save.saving`'s, reading it :mod:`.load.loading`'s, and every read starts
with :func:`.opening.open_checkpoint`.

The megatron-core 0.19 workarounds that the optimizer state needs on the torch-native Adam path (no Transformer
Engine / apex) live in :mod:`lightning_megatron.compat.mcore_fixes` and
:class:`lightning_megatron.compat.patches.KeepAdamStepOnLoad`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from torch import nn

from lightning_megatron.checkpointing import opening
from lightning_megatron.checkpointing.format import main_weights
from lightning_megatron.checkpointing.format.optimizer_state import optimizer_state
from lightning_megatron.checkpointing.integrity import checks, checksums
from lightning_megatron.checkpointing.save.staging import HostBuffers, stage_state
from lightning_megatron.compat import mcore_fixes
from lightning_megatron.training.averaging import STATE_KEY, WeightAverage

# Reshardable across TP, PP, VPP and DP: the optimizer state is gathered per parameter on save.
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_MODEL_KEY = "model{}"
OPTIMIZER_KEY = "optimizer"
"""Entry of the (distributed) optimizer's sharded state."""
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
            state[OPTIMIZER_KEY] = optimizer_state(optimizer, state, _METADATA, buffers, is_loading=is_loading)
        else:
            state[OPTIMIZER_KEY] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_METADATA)
        if not (model_weights or is_loading):
            model_states = [state[chunk_key(i)] for i in range(len(chunks))]
            main_weights.leave_out_trained_weights(model_states, optimizer, state[OPTIMIZER_KEY])
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


def model_config_dict(module: object) -> dict[str, Any] | None:
    """The module's ``ModelConfig`` (any dataclass ``config``) as a plain dict, loadable with ``weights_only``."""
    config = getattr(module, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else None
