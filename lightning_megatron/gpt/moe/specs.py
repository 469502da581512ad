"""The MoE layer spec: Megatron's MoE layer spec with this package's router, experts and dispatcher swapped in."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


def with_moe_parts(spec: Any, fuse_wgrad: bool = False) -> Any:
    """Copy of an MoE layer spec whose router is :class:`~lightning_megatron.gpt.moe.router.StepRouter` (Megatron's,
    counting the micro-batches whose losses it logs) and whose experts are the grouped experts of
    :mod:`lightning_megatron.kernels.experts` (one ``[experts, out, in]`` weight per projection on every device;
    grouped GEMMs or a loop is the module's runtime choice); ``fuse_wgrad``: their weight gradients accumulate into
    ``main_grad``. Its shared expert (with its gate) is Megatron's ``SharedExpertMLP``, from the same spec. The layer
    is :class:`~lightning_megatron.gpt.moe.dispatch.QueuedCountsMoELayer` (Megatron's ``MoELayer``, its all-gather
    dispatcher waiting less for the host)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    # Here, not at the top: gpt/specs.py imports this module for dense models too, which need no MoE classes.
    from lightning_megatron.gpt.moe.dispatch import QueuedCountsMoELayer
    from lightning_megatron.gpt.moe.router import StepRouter

    mlp = spec.submodules.mlp
    if not (isinstance(mlp, functools.partial) and mlp.func is MoELayer):
        raise TypeError(f"with_moe_parts needs an MoE layer spec (functools.partial(MoELayer, ...)), got {mlp!r}")
    parts = dataclasses.replace(mlp.keywords["submodules"], router=StepRouter, experts=grouped_experts(fuse_wgrad))
    mlp = functools.partial(QueuedCountsMoELayer, *mlp.args, **{**mlp.keywords, "submodules": parts})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def grouped_experts(fuse_wgrad: bool = False) -> Any:
    """The experts builder of :func:`lightning_megatron.kernels.expert_mlp.grouped_mlp_spec`."""
    from megatron.core.transformer.spec_utils import build_module

    from lightning_megatron.kernels.expert_mlp import grouped_mlp_spec

    # MoELayer calls its experts builder as builder(num_local_experts, config, pg_collection=..., name=...).
    return functools.partial(build_module, grouped_mlp_spec(fuse_wgrad=fuse_wgrad))
