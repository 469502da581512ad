"""Qwen2 (``Qwen2ForCausalLM``): Llama's layout with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.base import Family
from lightning_megatron.gpt.hf.params import ModelShape


class Qwen2(Family):
    """Qwen2 / Qwen2.5: q/k/v biases (``add_qkv_bias``), fused into Megatron's linear_qkv bias."""

    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    export_architecture = "Qwen2ForCausalLM"
    config_class = "Qwen2Config"

    def fields(self, hf: Any) -> dict[str, Any]:
        return {"add_qkv_bias": True, "qk_layernorm": False}

    def matches(self, c: ModelShape) -> bool:
        return c.add_qkv_bias and not c.qk_layernorm and c.num_moe_experts is None
