"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms), softmax top-k routing
(renormalised with ``norm_topk_prob``), no shared expert, dense layers where ``mlp_only_layers`` says."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.moe import MoEFamily, hf_layer_kwargs, qwen_sparse_layers
from lightning_megatron.gpt.hf.params import ModelShape


class Qwen3MoE(MoEFamily):
    """Qwen3-MoE: router ``mlp.gate``, experts ``mlp.experts.{e}.{gate,up,down}_proj``."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    export_architecture = "Qwen3MoeForCausalLM"
    config_class = "Qwen3MoeConfig"

    def fields(self, hf: Any) -> dict[str, Any]:
        moe = self.moe_fields(
            hf, experts=hf.num_experts, sparse=qwen_sparse_layers(hf), renormalise=bool(hf.norm_topk_prob)
        )
        return {"add_qkv_bias": False, "qk_layernorm": True, **moe}

    def matches(self, c: ModelShape) -> bool:
        shared = c.moe_shared_expert_intermediate_size is not None
        return c.num_moe_experts is not None and c.qk_layernorm and not c.add_qkv_bias and not shared

    def hf_config_kwargs(self, c: ModelShape) -> dict[str, Any]:
        return {
            "num_experts": c.num_moe_experts, "num_experts_per_tok": c.moe_router_topk,
            "moe_intermediate_size": c.moe_ffn_hidden_size or c.effective_ffn_hidden_size,
            "norm_topk_prob": not c.moe_router_pre_softmax, **hf_layer_kwargs(c),
        }  # fmt: skip
