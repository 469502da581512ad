"""The gradient of Multi-Latent Attention's shared RoPE key at tp > 1 with a column-parallel key/value down
projection; ``register.py`` lists it.

Megatron-Core 0.19's ``MLASelfAttention`` all-gathers a ``ColumnParallelLinear`` down projection's output
(``gather_from_tensor_model_parallel_region``, whose backward only keeps each rank's slice) and splits it into the
key/value latent and ``k_pos_emb``, the one RoPE key every head shares. The latent's gradient is complete on every
rank (its up projection sums over the heads), but ``k_pos_emb``'s holds only this rank's heads: the other ranks'
heads' part of it is dropped, so the down projection's RoPE rows (and everything before them) get a wrong gradient
and training leaves the one-process curve from step 2 on (NVIDIA/Megatron-LM issue 1699). Forward results are
unaffected.

:class:`SharedRopeKeyGrad` gathers the down projection's output itself and hands Megatron the whole latent, so
Megatron takes its path for a replicated down projection: under sequence parallelism it is scattered back over the
sequence and Megatron all-gathers ``k_pos_emb`` over the sequence, whose backward (a reduce-scatter) sums the heads'
parts; without it, ``k_pos_emb``'s columns pass a copy to the tensor-parallel region, whose backward all-reduces.
Parameters, their sharding and checkpoints are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)


class SharedRopeKeyGrad:
    """Mixin placed before Megatron's ``MLASelfAttention`` in a subclass's bases."""

    config: Any
    tp_group: Any

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)  # type: ignore[misc]
        latent, rope = self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == latent + rope:  # tp=1 (or a replicated projection): Megatron's path is right
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)  # [s, b, whole]
        if self.config.sequence_parallel:
            # [s / TP, b, whole]: the layout of a replicated projection's output under sequence parallelism.
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        kv_latent, k_pos_emb = torch.split(kv_combined, [latent, rope], dim=-1)
        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.tp_group)
        return q_compressed, torch.cat([kv_latent, k_pos_emb], dim=-1)
