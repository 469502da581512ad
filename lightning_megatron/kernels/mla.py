"""Megatron's ``MLASelfAttention`` taking our packed-row layout (:mod:`lightning_megatron.kernels.documents`)."""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from lightning_megatron.compat.mla_norms import DirectQueryNorms
from lightning_megatron.compat.mla_rope_grad import SharedRopeKeyGrad
from lightning_megatron.kernels.documents import SequenceLayout


class TorchMLASelfAttention(SharedRopeKeyGrad, DirectQueryNorms, MLASelfAttention):
    """``MLASelfAttention`` whose projections never see our :class:`SequenceLayout` (same parameters and names).

    Megatron treats any ``packed_seq_params`` as THD (one packed row: it squeezes the batch dimension); our layout is
    SBHD, so the projections and RoPE run as for unpacked rows and only the core attention reads the layout. RoPE at
    positions within the row instead of within each document gives the same attention: attention stays inside a
    document, and RoPE's scores depend on position differences only. A direct query projection (``q_lora_rank=None``)
    keeps its key/value latent norm without Transformer Engine (:class:`DirectQueryNorms`). At tp > 1 the shared RoPE
    key's gradient is summed over the tensor-parallel ranks' heads (:class:`SharedRopeKeyGrad`).
    """

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
