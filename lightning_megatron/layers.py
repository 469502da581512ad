"""Torch-native layers that Megatron's local (no Transformer Engine / apex) spec lacks."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn


class TorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch ``LayerNorm``/``RMSNorm``) that also works with sequence parallelism.

    Under sequence parallelism each tensor-parallel rank normalises its own slice of the sequence, so the norm's
    weight gets a partial gradient per rank; marking the parameters ``sequence_parallel`` makes Megatron's
    ``finalize_model_grads`` all-reduce them over the tensor-parallel group (what apex/TE norms do). Query/key
    norms act on full sequences of local heads and are built with ``sequence_parallel_region=False``.
    """

    def __new__(  # a factory, like WrappedTorchNorm: returns the torch module itself
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel_region: bool = True,
        **unused: Any,
    ) -> nn.Module:
        norm_cls = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel and sequence_parallel_region)
        return norm


def with_torch_norms(spec: Any) -> Any:
    """Copy of a Megatron layer spec with every ``WrappedTorchNorm`` replaced by :class:`TorchNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(value: Any, name: str) -> Any:
        if value is not WrappedTorchNorm:
            return value
        qk = name in ("q_layernorm", "k_layernorm", "kv_layernorm")
        return functools.partial(TorchNorm, sequence_parallel_region=False) if qk else TorchNorm

    return _map_spec(spec, swap)


def replace_modules(spec: Any, mapping: dict[type, Any]) -> Any:
    """Copy of a Megatron layer spec with the module classes in ``mapping`` replaced."""
    return _map_spec(spec, lambda value, name: mapping.get(value, value) if isinstance(value, type) else value)


def _map_spec(spec: Any, fn: Any) -> Any:
    """Apply ``fn(value, field_name)`` to every module class of a spec tree (ModuleSpecs and submodule dataclasses)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def swap(value: Any, name: str) -> Any:
        value = fn(value, name)
        if isinstance(value, ModuleSpec):
            return dataclasses.replace(value, module=fn(value.module, name), submodules=swap(value.submodules, name))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value, **{f.name: swap(getattr(value, f.name), f.name) for f in dataclasses.fields(value) if f.init}
            )
        return value

    return swap(spec, "")
