"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms), softmax top-k routing
(renormalised with ``norm_topk_prob``), no shared expert, dense layers where ``mlp_only_layers`` says."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.moe import QwenMoEFamily
from lightning_megatron.gpt.hf.params import ModelShape


class Qwen3MoE(QwenMoEFamily):
    """Qwen3-MoE: router ``mlp.gate``, experts ``mlp.experts.{e}.{gate,up,down}_proj``."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    export_architecture = "Qwen3MoeForCausalLM"
    config_class = "Qwen3MoeConfig"

    def fields(self, hf: Any) -> dict[str, Any]:
        return {"add_qkv_bias": False, "qk_layernorm": True, **self.qwen_moe_fields(hf)}

    def matches(self, c: ModelShape) -> bool:
        shared = c.moe_shared_expert_intermediate_size is not None
        return c.num_moe_experts is not None and c.qk_layernorm and not c.add_qkv_bias and not shared
