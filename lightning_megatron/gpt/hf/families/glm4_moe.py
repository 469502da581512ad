"""GLM-4.5 (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air): GQA attention with q/k/v biases (``attention_bias``),
optional per-head q/k RMSNorms (``use_qk_norm``) and RoPE on the first ``partial_rotary_factor`` of each head, then
:class:`~lightning_megatron.gpt.hf.families.sigmoid_moe.SigmoidMoEFamily`'s dense first layers, shared experts and
sigmoid router.

transformers rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each head rotate-half style (the
two halves of that slice, not interleaved pairs), with frequencies over those dims only: Megatron's RoPE with
``rotary_percent`` (the shared mapping in :mod:`lightning_megatron.gpt.hf.fields`, ``partial_rope``). Its q/k norms
come after the biased projections and before RoPE, as Megatron's ``qk_layernorm``; ``o_proj`` has no bias whatever
``attention_bias`` says.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.sigmoid_moe import (
    SigmoidMoEFamily,
    router_config_kwargs,
    router_fields,
    warn_mtp_skipped,
)

ARCH = "Glm4MoeForCausalLM"


class Glm4Moe(SigmoidMoEFamily):
    """GLM-4.5: the base attention (fused q/k/v with their biases, ``q_norm`` / ``k_norm``), then the sigmoid MoE."""

    architectures = (ARCH,)
    model_types = ("glm4_moe",)
    export_architecture = ARCH
    config_class = "Glm4MoeConfig"
    partial_rope = True
    qkv_attention_bias = True

    def fields(self, hf: Any) -> dict[str, Any]:
        warn_mtp_skipped(hf, ARCH)
        attention = {"add_qkv_bias": bool(hf.attention_bias), "qk_layernorm": bool(hf.use_qk_norm)}
        return {**attention, **router_fields(hf, ARCH)}

    def matches(self, c: Any) -> bool:
        return super().matches(c) and not c.multi_latent_attention

    def hf_config_kwargs(self, c: Any) -> dict[str, Any]:
        return {**router_config_kwargs(c), "attention_bias": c.add_qkv_bias, "use_qk_norm": c.qk_layernorm}
