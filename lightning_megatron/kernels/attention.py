"""Megatron's core attention on ``F.scaled_dot_product_attention``, with rotary embeddings applied inside.

Megatron-Core's "local" spec (what runs without Transformer Engine) computes attention as baddbmm + softmax + bmm,
materialising the [B, heads, S, S] scores. :class:`SDPAttention` is a drop-in replacement on PyTorch alone (flash
or cuDNN kernels on GPU, the math kernel on CPU). With rotary position embeddings it also applies RoPE to the
queries and keys, as one compiled kernel each on GPU (Megatron's own fused RoPE needs Transformer Engine; unfused
it is ~8 elementwise kernels per tensor). The GPTModel is then built without its own rotary step
(``position_embedding_type="none"``: same parameters, same checkpoints, see ``ModelConfig.gpt_model_kwargs``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_megatron.kernels.compile import for_device
from lightning_megatron.kernels.documents import SequenceLayout, attend, gather_keys_values
from lightning_megatron.kernels.variants import Variant, attend_variant, layer_variant, sink_logits


@dataclass(frozen=True)
class Rotary:
    """RoPE settings (GPTModel arguments, not TransformerConfig fields) for :class:`SDPAttention`."""

    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: float | None = None


class SDPAttention(MegatronModule):
    """Megatron's core attention (the ``core_attention`` submodule of ``SelfAttention``) on SDPA.

    Takes Megatron's layout -- query ``[S, B, heads/tp, d]``, key/value ``[S, B, groups/tp, d]`` -- and returns
    ``[S, B, heads/tp * d_v]``, like ``DotProductAttention``. Multi-Latent Attention builds it with ``k_channels``
    (query/key head size, e.g. 128 + 64) unlike ``v_channels`` (value head size, e.g. 128), its own softmax scale and
    no ``rotary`` (MLA rotates the RoPE slice itself). Causal masking uses SDPA's ``is_causal`` (no mask
    tensor); an explicit boolean mask (True = masked out, Megatron's convention) is honoured too. With ``rotary``
    the module applies RoPE to query and key first (positions 0..S-1, Megatron's ``RotaryEmbedding`` frequencies).
    Sliding windows (``config.window_size`` on the layers ``window_attn_skip_freq`` picks), attention sinks
    (``config.softmax_type``; the ``softmax_offset`` parameter of Megatron's DotProductAttention) and ``softcap``
    run through :mod:`lightning_megatron.kernels.variants`; ``local_rotary`` replaces ``rotary`` on the
    sliding-window layers.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rotary: Rotary | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        softcap: float | None = None,
        local_rotary: Rotary | None = None,
    ) -> None:
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

        self.causal = attn_mask_type == AttnMaskType.causal
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        # Sliding window / soft-capping of this layer (None: plain attention) and the sink logits, Megatron's
        # ``softmax_offset`` (a parameter for softmax_type='learnable', zeros for 'off-by-one').
        self.variant = layer_variant(config, layer_number, softcap)
        sinks = sink_logits(config, self.tp_group)
        if isinstance(sinks, torch.nn.Parameter):
            self.register_parameter("softmax_offset", sinks)
        else:  # no state: kept out of checkpoints, moved with the module
            self.register_buffer("softmax_offset", sinks, persistent=False)
        if (self.variant is not None or sinks is not None) and not self.causal:
            raise ValueError(f"SDPAttention runs attention variants for causal attention only (got {attn_mask_type})")
        # SDPA takes the value head size from the value tensor: only the query/key size sets the default scale.
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # Megatron's DotProductAttention draws dropout from the model-parallel RNG stream except under SP.
        self.fork_rng = not config.sequence_parallel
        # A plain attribute, not a submodule: no state, and one table for every layer with these settings.
        # ``local_rotary``: the RoPE of sliding-window layers where it differs (Gemma 3's local base).
        windowed = self.variant is not None and self.variant.window is not None
        rotary = local_rotary if windowed and local_rotary is not None else rotary
        self.rope = None if rotary is None else _rope_table(rotary, head_dim)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention_bias; use kernels='local'")
        if packed_seq_params is not None:
            return self._forward_layout(query, key, value, packed_seq_params)
        seq, batch, heads, _ = query.shape
        if self.rope is not None:
            if key.shape[0] != seq:  # e.g. a KV cache: positions would no longer be 0..S-1 for both
                raise ValueError("SDPAttention applies RoPE at positions 0..S-1: query and key lengths must match")
            cos, sin = self.rope.cos_sin(seq, query.device)  # [S, 1, 1, rotary dims], float32
            rope = for_device(_rope, query.device)
            query, key = rope(query, cos, sin), rope(key, cos, sin)
        # [S, B, n, d] -> [B, n, S, d]: SDPA's layout (a strided view; the kernels accept it)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout if self.training else 0.0
        if self._has_variant:
            if attention_mask is not None:
                raise ValueError(
                    "SDPAttention's attention variants build their own causal mask: pass no attention_mask"
                )
            context = self._variant(q, k, v, None, dropout)
            return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        context = _sdpa(q, k, v, mask, dropout, self.causal and mask is None, self.softmax_scale, self.fork_rng)
        # [B, n, S, d] -> [S, B, n * d]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _forward_layout(self, query: Tensor, key: Tensor, value: Tensor, layout: Any) -> Tensor:
        """Packed documents and/or context parallelism (:mod:`lightning_megatron.kernels.documents`)."""
        if not isinstance(layout, SequenceLayout):
            raise ValueError(
                f"SDPAttention got packed_seq_params={type(layout).__name__}; packed batches reach it as "
                "position_ids in the batch (lightning_megatron.pack_sequences), not as Megatron's THD format"
            )
        seq, batch = query.shape[:2]
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(layout.seq_length, query.device)  # [S, 1, 1, rotary dims]
            # [S, r] gathered at each token's position: [B', S_local, r] -> [S_local, B', 1, r]
            cos, sin = (t.flatten(1)[layout.positions].transpose(0, 1).unsqueeze(2) for t in (cos, sin))
            rope = for_device(_rope, query.device)
            query, key = rope(query, cos, sin), rope(key, cos, sin)
        if layout.cp.size > 1:
            key, value = gather_keys_values(key, value, layout)  # [S, B, g, d]: the full rows
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [S, B, n, d] -> [B, n, S, d]
        dropout = self.dropout if self.training else 0.0
        if self._has_variant:
            context = self._variant(q, k, v, layout, dropout)
            return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)

        def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Any, causal: bool) -> Tensor:
            return _sdpa(q, k, v, mask, dropout, causal, self.softmax_scale, self.fork_rng)

        context = attend(q, k, v, layout, sdpa, dropout, self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)  # [B, n, S_local, d] -> [S_local, B, n * d]

    @property
    def _has_variant(self) -> bool:
        return self.variant is not None or self.softmax_offset is not None

    def _variant(self, q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout | None, dropout: float) -> Tensor:
        """Sliding window, soft-capping and/or sinks (:mod:`lightning_megatron.kernels.variants`)."""
        variant = self.variant or Variant()
        return attend_variant(q, k, v, layout, variant, self.softmax_offset, self.softmax_scale, dropout, self.fork_rng)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """As Megatron's DotProductAttention: a learnable ``softmax_offset`` is saved split over TP by heads."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, causal: bool, scale: float, fork_rng: bool
) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if dropout == 0.0 or not fork_rng:
        return F.scaled_dot_product_attention(q, k, v, mask, dropout, causal, scale=scale, enable_gqa=gqa)
    from megatron.core import tensor_parallel

    # Heads are split across tensor-parallel ranks: draw the dropout mask from the model-parallel RNG stream
    # (as Megatron's DotProductAttention does) so that each rank's heads get independent masks.
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return F.scaled_dot_product_attention(q, k, v, mask, dropout, causal, scale=scale, enable_gqa=gqa)


class _RopeTable:
    """cos/sin of Megatron's ``RotaryEmbedding`` frequencies per sequence length and device, computed once for all
    layers (Megatron computes them once per model forward; a per-layer ``RotaryEmbedding`` would redo them in every
    layer and its class-wide LRU cache of 32 entries thrashes beyond 32 layers)."""

    def __init__(self, rotary: Rotary, head_dim: int) -> None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.embedding = RotaryEmbedding(
            kv_channels=head_dim, rotary_percent=rotary.rotary_percent, rotary_base=rotary.rotary_base,
            rope_scaling=rotary.rope_scaling, rope_scaling_factor=rotary.rope_scaling_factor,
            seq_len_interpolation_factor=rotary.seq_len_interpolation_factor, use_cpu_initialization=True,
        )  # fmt: skip
        self.tables: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def cos_sin(self, seq: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (seq, device)
        if key not in self.tables:
            if len(self.tables) >= 64:  # many distinct lengths (variable-length predict): start over
                self.tables.clear()
            with torch.no_grad():
                # get_emb: the whole table (forward would cut it to this rank's CP chunks; we index by position)
                freqs = self.embedding.get_emb(seq).to(device)  # [S, 1, 1, rotary dims], float32
            self.tables[key] = (freqs.cos(), freqs.sin())
        return self.tables[key]


@functools.cache
def _rope_table(rotary: Rotary, head_dim: int) -> _RopeTable:
    return _RopeTable(rotary, head_dim)


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``t`` [S, B, n, d] (non-interleaved halves), in float32."""
    rot = cos.shape[-1]
    x = t[..., :rot].float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(t.dtype), t[..., rot:]), dim=-1)
