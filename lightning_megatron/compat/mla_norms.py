"""Megatron's placement of Multi-Latent Attention's latent norms, for a direct query projection without Transformer
Engine; ``register.py`` lists it.

With ``q_lora_rank=None`` (DeepSeek-V2-Lite, Moonlight) and ``qk_layernorm=True``, Megatron-Core 0.19's resolver
(``MLASelfAttention._resolve_qk_norm_config``) asks for Transformer Engine's fused norm + linear as the query
projection and raises on the local stack, although the key/value latent's norm is a standalone module that its
forward applies either way. :class:`DirectQueryNorms` resolves that one case to a plain query projection and the
spec's standalone key/value latent norm, and leaves every other case to Megatron.
"""

from __future__ import annotations

from typing import Any

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp


class DirectQueryNorms:
    """Mixin placed before Megatron's ``MLASelfAttention`` in a subclass's bases."""

    config: Any

    def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
        config = self.config
        standalone = submodules.kv_layernorm not in (None, IdentityOp)
        l2 = getattr(config, "qk_l2_norm", False)  # Megatron refuses it for MLA: its resolver says so
        if config.q_lora_rank is not None or not config.qk_layernorm or not standalone or l2:
            return super()._resolve_qk_norm_config(submodules)  # type: ignore[misc]
        return {
            "linear_q_proj": submodules.linear_q_proj or ColumnParallelLinear,
            "linear_q_up_proj": IdentityOp,  # no query latent
            "linear_kv_up_proj": submodules.linear_kv_up_proj or ColumnParallelLinear,
            "q_layernorm": IdentityOp,  # no query latent to normalise (the layer's input norm precedes q_proj)
            "kv_layernorm": submodules.kv_layernorm,
        }
