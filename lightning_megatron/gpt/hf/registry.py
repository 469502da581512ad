"""The HF architecture families :func:`~lightning_megatron.ModelConfig.from_hf`, import and export know, and how one
is found: by an HF config's architecture (:func:`family_of_hf`) or by what a model config can be (:func:`family_of`).
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.base import Family
from lightning_megatron.gpt.hf.families.deepseek_v3 import DeepseekV3
from lightning_megatron.gpt.hf.families.gemma2 import Gemma2
from lightning_megatron.gpt.hf.families.gemma3 import Gemma3
from lightning_megatron.gpt.hf.families.glm4_moe import Glm4Moe
from lightning_megatron.gpt.hf.families.gpt_oss import GptOss
from lightning_megatron.gpt.hf.families.llama import Llama
from lightning_megatron.gpt.hf.families.mixtral import Mixtral
from lightning_megatron.gpt.hf.families.qwen2 import Qwen2
from lightning_megatron.gpt.hf.families.qwen2_moe import Qwen2MoE
from lightning_megatron.gpt.hf.families.qwen3 import Qwen3
from lightning_megatron.gpt.hf.families.qwen3_moe import Qwen3MoE
from lightning_megatron.gpt.hf.params import ModelShape

FAMILIES: tuple[Family, ...] = (
    Llama(), Qwen2(), Qwen3(), Qwen3MoE(), Qwen2MoE(), Mixtral(), DeepseekV3(), Glm4Moe(), Gemma3(), Gemma2(),
    GptOss(),
)  # fmt: skip
ARCHITECTURES: tuple[str, ...] = tuple(arch for family in FAMILIES for arch in family.architectures)
BY_ARCHITECTURE: dict[str, Family] = {arch: family for family in FAMILIES for arch in family.architectures}
BY_MODEL_TYPE: dict[str, str] = {
    model_type: arch
    for family in FAMILIES
    for model_type, arch in zip(family.model_types, family.architectures, strict=True)
}


def family_of_hf(architecture: str) -> Family:
    """The family of a supported HF architecture name (``"Qwen3ForCausalLM"``); KeyError for others."""
    return BY_ARCHITECTURE[architecture]


def family_of(config: ModelShape) -> Family | None:
    """The family whose HF architecture holds a model of ``config`` (None: no HF architecture here does)."""
    from lightning_megatron.gpt.gemma import gemma_layout

    mla, gemma = bool(getattr(config, "multi_latent_attention", False)), gemma_layout(config)
    biases = bool(getattr(config, "add_bias_linear", False))
    found = [
        family
        for family in FAMILIES
        if family.latent_attention == mla
        and family.gemma_layout == gemma
        and family.linear_biases == biases
        and family.matches(config)
    ]
    assert len(found) <= 1, f"families overlap: {found}"
    return found[0] if found else None


def described(config: Any) -> str:
    """The fields that decide the family, for error messages."""
    names: tuple[str, ...] = ("add_qkv_bias", "qk_layernorm", "num_moe_experts")
    if getattr(config, "num_moe_experts", None) is not None:  # what tells the MoE families apart
        names += ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function")
    if getattr(config, "multi_latent_attention", False):
        names = ("multi_latent_attention", *names)
    return ", ".join(f"{name}={getattr(config, name)!r}" for name in names)
