"""The gradient of Multi-Latent Attention's shared RoPE key under tensor parallelism, with Megatron's
column-parallel key/value down projection; ``register.py`` lists it.

Megatron-Core 0.19's ``MLASelfAttention`` gathers that projection's output over TP and splits it into the latent and
the RoPE key ``k_pos_emb``, which every rank's heads then read whole. Each rank's heads give ``k_pos_emb`` a partial
gradient, and nothing sums them over TP (the latent's gradient is summed by the up projection's backward): the
RoPE key's projection rows, and everything before them, get only the heads of the rank that holds those rows.
Forward values are right (validation and exports equal one process), training at ``tp > 1`` is not.
:class:`SummedRopeKeyGradient` gathers the output itself and passes it on whole, which Megatron reads as a duplicated
projection's output: under sequence parallelism scattered back over the sequence (Megatron then gathers the RoPE key
over it, whose backward sums the heads' partial gradients over TP), else with the RoPE key's gradient all-reduced.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)


class SummedRopeKeyGradient:
    """Mixin placed before Megatron's ``MLASelfAttention`` in a subclass's bases."""

    config: Any
    tp_group: Any

    def _qkv_down_projection(self, hidden_states: Any) -> Any:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)  # type: ignore[misc]
        latent, rope = self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == latent + rope:  # a duplicated projection (or tp=1): Megatron's path is right
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [latent, rope], dim=-1)
        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        return q_compressed, torch.cat([kv_compressed, k_pos_emb], dim=-1)
