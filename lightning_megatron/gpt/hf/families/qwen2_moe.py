"""Qwen2-MoE (``Qwen2MoeForCausalLM``, e.g. Qwen1.5-MoE-A2.7B): Qwen2's attention (q/k/v biases), softmax top-k
routing, and a shared expert behind a sigmoid gate in every MoE layer."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.base import dense_adapters, dense_mlp
from lightning_megatron.gpt.hf.families.moe import QwenMoEFamily
from lightning_megatron.gpt.hf.params import ModelShape, Param


class Qwen2MoE(QwenMoEFamily):
    """Qwen2-MoE: router ``mlp.gate``, experts ``mlp.experts.{e}.*_proj``, shared expert ``mlp.shared_expert.*_proj``
    with its gate ``mlp.shared_expert_gate`` (Megatron's ``moe_shared_expert_gate``)."""

    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    export_architecture = "Qwen2MoeForCausalLM"
    config_class = "Qwen2MoeConfig"

    def fields(self, hf: Any) -> dict[str, Any]:
        size = hf.shared_expert_intermediate_size
        if not size:  # transformers builds a shared expert in every MoE layer; Megatron's needs a size
            raise ValueError(f"Qwen2MoeForCausalLM with shared_expert_intermediate_size={size!r} is not supported; a "
                             "positive size")  # fmt: skip
        shared = {"moe_shared_expert_intermediate_size": size, "moe_shared_expert_gate": True}
        # q/k/v biases unless the config turns them off (``qkv_bias``, transformers >= 5; always on before)
        bias = bool(getattr(hf, "qkv_bias", True))
        return {"add_qkv_bias": bias, "qk_layernorm": False, **self.qwen_moe_fields(hf), **shared}

    def matches(self, c: ModelShape) -> bool:
        shared = c.moe_shared_expert_intermediate_size is not None and c.moe_shared_expert_gate
        return c.num_moe_experts is not None and not c.qk_layernorm and shared

    def shared_expert_params(self, c: ModelShape, m: str, hb: str) -> list[Param]:
        ffn, hidden = c.moe_shared_expert_intermediate_size or 0, c.hidden_size
        params = dense_mlp(m + "mlp.shared_experts.", hb + "shared_expert.", hidden, ffn)
        gate = ((hb + "shared_expert_gate.weight", (1, hidden)),)
        return [*params, Param(m + "mlp.shared_experts.gate_weight", gate, "copy")]

    def shared_adapter_params(self, c: Any, lora: Any, m: str, h: str) -> list[Param]:
        ffn = c.moe_shared_expert_intermediate_size or 0
        return dense_adapters(c, lora, m + "shared_experts.", h + "shared_expert.", ffn)

    def hf_config_kwargs(self, c: ModelShape) -> dict[str, Any]:
        return {**super().hf_config_kwargs(c), "shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
                "qkv_bias": c.add_qkv_bias}  # fmt: skip
