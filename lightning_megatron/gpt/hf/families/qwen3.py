"""Qwen3 (``Qwen3ForCausalLM``): Llama's layout with RMSNorms on each head's queries and keys."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.base import Family
from lightning_megatron.gpt.hf.params import ModelShape


class Qwen3(Family):
    """Qwen3 (dense): q/k norms (``qk_layernorm``), Megatron's q_layernorm / k_layernorm."""

    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    export_architecture = "Qwen3ForCausalLM"
    config_class = "Qwen3Config"

    def fields(self, hf: Any) -> dict[str, Any]:
        return {"add_qkv_bias": False, "qk_layernorm": True}

    def matches(self, c: ModelShape) -> bool:
        return c.qk_layernorm and not c.add_qkv_bias and c.num_moe_experts is None
