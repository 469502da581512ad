"""Mixtral (``MixtralForCausalLM``): Llama's attention, every layer an MoE of SwiGLU experts ``w1``/``w3``/``w2``
under ``block_sparse_moe``, top-k routing renormalised over the chosen experts."""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.moe import MoEFamily
from lightning_megatron.gpt.hf.params import ModelShape
from lightning_megatron.gpt.moe.config import moe_layer_pattern


class Mixtral(MoEFamily):
    """Mixtral 8x7B-style: router ``block_sparse_moe.gate``, experts ``block_sparse_moe.experts.{e}.w1/w3/w2``."""

    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    export_architecture = "MixtralForCausalLM"
    config_class = "MixtralConfig"
    block = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    def fields(self, hf: Any) -> dict[str, Any]:
        sparse = (True,) * hf.num_hidden_layers
        moe = self.moe_fields(hf, experts=hf.num_local_experts, sparse=sparse, renormalise=True)
        return {"add_qkv_bias": False, "qk_layernorm": False, **moe}

    def matches(self, c: ModelShape) -> bool:
        if c.num_moe_experts is None or c.add_qkv_bias or c.qk_layernorm or c.moe_router_pre_softmax:
            return False
        every_layer = all(moe_layer_pattern(c.num_layers, c.moe_layer_freq))
        # One intermediate_size: the experts' (there are no dense layers).
        one_size = c.moe_ffn_hidden_size in (None, c.effective_ffn_hidden_size)
        return every_layer and one_size and c.moe_shared_expert_intermediate_size is None

    def hf_config_kwargs(self, c: ModelShape) -> dict[str, Any]:
        return {"num_local_experts": c.num_moe_experts, "num_experts_per_tok": c.moe_router_topk}
