"""Megatron's ``MLASelfAttention`` taking our packed-row layout (:mod:`lightning_megatron.kernels.documents`) and
subclasses of ``ColumnParallelLinear`` (LoRA's adapted linear) as its down projections."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from lightning_megatron.compat.mla_norms import DirectQueryNorms
from lightning_megatron.compat.mla_rope_grad import SharedRopeKeyGrad
from lightning_megatron.kernels.documents import SequenceLayout

DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


class TorchMLASelfAttention(SharedRopeKeyGrad, DirectQueryNorms, MLASelfAttention):
    """``MLASelfAttention`` whose projections never see our :class:`SequenceLayout` (same parameters and names).

    Megatron treats any ``packed_seq_params`` as THD (one packed row: it squeezes the batch dimension); our layout is
    SBHD, so the projections and RoPE run as for unpacked rows and only the core attention reads the layout. RoPE at
    positions within the row instead of within each document gives the same attention: attention stays inside a
    document, and RoPE's scores depend on position differences only. A direct query projection (``q_lora_rank=None``)
    keeps its key/value latent norm without Transformer Engine (:class:`DirectQueryNorms`). At tp > 1 the shared RoPE
    key's gradient is summed over the tensor-parallel ranks' heads (:class:`SharedRopeKeyGrad`).

    Megatron picks a down projection's sharding by its exact class (``in [ColumnParallelLinear, ...]``) and refuses
    any other. A spec whose module subclasses ``ColumnParallelLinear`` (an adapted linear) is therefore built here
    after Megatron has built the plain one: with the same arguments (column-parallel, output not gathered, which
    Megatron's forward then gathers), taking over its weight under the same name (the same checkpoint keys).
    """

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        own = {name: spec for name in DOWN_PROJECTIONS if _is_subclass_spec(spec := getattr(submodules, name))}
        plain = dataclasses.replace(submodules, **dict.fromkeys(own, ColumnParallelLinear))
        super().__init__(config, plain, *args, **kwargs)
        for name, spec in own.items():
            if hasattr(self, name):  # no query latent (q_lora_rank=None): no query down projection
                setattr(self, name, _rebuilt(getattr(self, name), spec))

    def get_query_key_value_tensors(
        self,
        hidden_states: Any,
        key_value_states: Any = None,
        position_ids: Any = None,
        packed_seq_params: Any = None,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
    ) -> Any:
        if isinstance(packed_seq_params, SequenceLayout):
            packed_seq_params = None
        return super().get_query_key_value_tensors(
            hidden_states,
            key_value_states,
            position_ids,
            packed_seq_params,
            inference_context=inference_context,
            inference_params=inference_params,
        )


def _is_subclass_spec(spec: Any) -> bool:
    """Whether a down projection's spec is a strict subclass of ``ColumnParallelLinear`` (class or ModuleSpec)."""
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return isinstance(module, type) and issubclass(module, ColumnParallelLinear) and module is not ColumnParallelLinear


def _keep(weight: torch.Tensor) -> None:
    """No initialisation: the weight is the plain linear's, copied next (and no random number is drawn, so the
    model's other parameters initialise as without the subclass)."""


def _rebuilt(plain: ColumnParallelLinear, spec: Any) -> ColumnParallelLinear:
    """``spec``'s module in place of Megatron's ``plain`` down projection, built as Megatron builds that one, with its
    weight."""
    built = build_module(
        spec, plain.input_size, plain.output_size, config=plain.config, init_method=_keep, bias=False,
        gather_output=False, skip_bias_add=False, is_expert=False, tp_group=plain.tp_group,
    )  # fmt: skip
    with torch.no_grad():
        built.weight.copy_(plain.weight)
    return built
