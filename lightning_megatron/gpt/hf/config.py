"""Hugging Face config.json for a :class:`~lightning_megatron.ModelConfig` (the other way:
:mod:`lightning_megatron.gpt.hf.fields`): :func:`hf_config_dict` writes config.json for a model that was not loaded
from HF; :func:`check_exportable` refuses what no supported HF family's config can express, naming it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from lightning_megatron.gpt.hf.registry import ARCHITECTURES, described, family_of
from lightning_megatron.gpt.hf.rope import MEGATRON_LLAMA3_ROPE

if TYPE_CHECKING:
    from lightning_megatron.gpt.config import ModelConfig
    from lightning_megatron.gpt.hf.families.base import Family


def hf_config_dict(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for a model that was not loaded from HF, in the architecture of its family (Llama without
    q/k/v biases or q/k norms, Qwen2 with the biases, Qwen3 with the norms; with experts Qwen3-MoE with the norms,
    Qwen2-MoE with the biases and a gated shared expert, Mixtral with neither; GLM-4.5 with an ungated shared
    expert and the sigmoid router, DeepSeek-V3 with that and Multi-Latent Attention)."""
    import transformers

    family = check_exportable(config)
    cls, arch = getattr(transformers, family.config_class), family.export_architecture
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rope_scaling:
        rope = {**rope, **MEGATRON_LLAMA3_ROPE, "rope_type": "llama3", "factor": config.rope_scaling_factor}
    elif config.seq_len_interpolation_factor is not None:
        rope = {**rope, "rope_type": "linear", "factor": config.seq_len_interpolation_factor}
    if family.partial_rope:  # always written: GLM's config fills in 0.5 where it is left out
        rope["partial_rotary_factor"] = config.rotary_percent
    rope_kwargs: dict[str, Any] = {"rope_parameters": rope}
    if "rope_parameters" not in inspect.signature(cls.__init__).parameters:  # transformers < 5
        scaling = None if rope["rope_type"] == "default" else rope
        rope_kwargs = {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}
        if family.partial_rope:
            rope_kwargs["partial_rotary_factor"] = config.rotary_percent
    hidden_act = {"gelu_tanh": "gelu_pytorch_tanh"}.get(config.activation, config.activation)
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        intermediate_size=config.effective_ffn_hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.effective_num_query_groups, head_dim=config.effective_kv_channels,
        hidden_act=hidden_act, max_position_embeddings=config.seq_length, rms_norm_eps=config.norm_epsilon,
        tie_word_embeddings=config.share_embeddings_and_output_weights, attention_dropout=config.attention_dropout,
        initializer_range=config.init_method_std, architectures=[arch], dtype=dtype,
    )  # fmt: skip
    return cls(**{**fields, **rope_kwargs, **family.hf_config_kwargs(config)}).to_dict()


def check_exportable(config: ModelConfig) -> Family:
    """The family whose HF architecture holds this model; ValueError naming the fields if none does."""
    family = family_of(config)
    yarn = bool(family and family.yarn_rope)
    unsupported = {
        "normalization": config.normalization != "RMSNorm",
        "position_embedding_type": config.position_embedding_type not in ("rope", *(("yarn",) if yarn else ())),
        "rotary_percent": config.rotary_percent != 1.0 and not (family and family.partial_rope),
        "add_bias_linear": config.add_bias_linear and not (family and family.linear_biases),
        "gated_linear_unit": not config.gated_linear_unit,
        "apply_residual_connection_post_layernorm": config.apply_residual_connection_post_layernorm,
        "seq_len_interpolation_factor": config.rope_scaling and config.seq_len_interpolation_factor is not None,
    }
    if not (family and family.sigmoid_router):  # DeepSeek-V3's router: only its and GLM-4.5's architectures have it
        unsupported.update(
            {
                "moe_router_score_function": config.moe_router_score_function != "softmax",
                "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
                "moe_router_num_groups": config.moe_router_num_groups is not None,
                "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor is not None,
            }
        )
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        values = ", ".join(f"{name}={getattr(config, name)!r}" for name in bad)
        raise ValueError(f"{values}: no HF counterpart among {', '.join(ARCHITECTURES)}")
    if family is None:
        raise ValueError(
            f"no HF architecture holds a model with {described(config)}; supported: {', '.join(ARCHITECTURES)}"
        )
    return family
