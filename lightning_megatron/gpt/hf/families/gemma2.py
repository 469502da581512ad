"""Gemma 2 (``Gemma2ForCausalLM``): Gemma 3's layer (four norms, ``x * (1 + w)`` gains, scaled embeddings, tanh
GeGLU, tied embeddings, ``query_pre_attn_scalar``) without q/k norms, one RoPE for every layer, and soft-capping of
the attention scores (``attn_logit_softcapping``) and of the output logits (``final_logit_softcapping``), which
transformers' Gemma 2 applies both (:class:`~lightning_megatron.gpt.hf.families.gemma3.Gemma3` holds the rest)."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.gemma3 import Gemma3, gemma_layer
from lightning_megatron.gpt.hf.params import ModelShape

ARCH = "Gemma2ForCausalLM"


class Gemma2(Gemma3):
    """Gemma 2: Gemma 3's mapping without q/k norms, with both soft-cappings."""

    architectures = (ARCH,)
    model_types = ("gemma2",)
    export_architecture = ARCH
    config_class = "Gemma2Config"
    unsupported = ("use_bidirectional_attention",)
    qk_norms = False

    def fields(self, hf: Any) -> dict[str, Any]:
        cap = getattr(hf, "attn_logit_softcapping", None)
        return {**super().fields(hf), "attn_logit_softcapping": float(cap) if cap else None}

    def window_rope(self, hf: Any) -> dict[str, Any]:
        return {}  # one RoPE for the sliding and the full layers

    def matches(self, c: ModelShape) -> bool:
        one_rope = getattr(c, "local_rotary_base", None) is None
        return gemma_layer(c) and not c.qk_layernorm and one_rope

    def hf_config_kwargs(self, c: Any) -> dict[str, Any]:
        kwargs = super().hf_config_kwargs(c)
        return {**kwargs, "rope_parameters": kwargs["rope_parameters"]["full_attention"],
                "attn_logit_softcapping": c.attn_logit_softcapping}  # fmt: skip
