"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight): Multi-Latent Attention, dense first
layers (``first_k_dense_replace``), then MoE layers with one ungated shared MLP (``n_shared_experts`` experts' worth)
and the sigmoid router with ``e_score_correction_bias``, group-limited top-k and ``routed_scaling_factor``.

HF's attention projections map one to one onto Megatron's ``MLASelfAttention``: both lay ``q_b_proj`` out per head
as [nope; rope], ``kv_a_proj_with_mqa`` as [latent; the shared RoPE key] and ``kv_b_proj`` per head as [nope key;
value]; HF's interleaved RoPE (``rope_interleave=True``) is what Megatron's MLA always applies.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.sigmoid_moe import (
    SigmoidMoEFamily,
    router_config_kwargs,
    router_fields,
    warn_mtp_skipped,
)
from lightning_megatron.gpt.hf.params import Param

ARCH = "DeepseekV3ForCausalLM"


class DeepseekV3(SigmoidMoEFamily):
    """DeepSeek-V3: Multi-Latent Attention, then :class:`SigmoidMoEFamily`'s router, experts and shared experts."""

    architectures = (ARCH,)
    model_types = ("deepseek_v3",)
    export_architecture = ARCH
    config_class = "DeepseekV3Config"
    latent_attention = True
    own_rope = True

    def fields(self, hf: Any) -> dict[str, Any]:
        if not getattr(hf, "rope_interleave", True):
            raise ValueError(f"{ARCH} with rope_interleave=False is not supported (Megatron's MLA interleaves)")
        warn_mtp_skipped(hf, ARCH)
        mla = {
            "multi_latent_attention": True,
            "num_query_groups": None,
            "kv_channels": None,
            "qk_layernorm": True,
            "q_lora_rank": hf.q_lora_rank,
            "kv_lora_rank": hf.kv_lora_rank,
            "qk_head_dim": hf.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf.qk_rope_head_dim,
            "v_head_dim": hf.v_head_dim,
        }
        return {"add_qkv_bias": False, **mla, **mla_rope_fields(hf), **router_fields(hf, ARCH)}

    def matches(self, c: Any) -> bool:
        return super().matches(c) and c.multi_latent_attention and c.qk_layernorm

    def attention_params(self, c: Any, m: str, att: str) -> list[Param]:
        """MLA's projections and latent norms (all split over TP by rows but the output projection)."""
        hidden, heads, m = c.hidden_size, c.num_attention_heads, m + "self_attention."
        q_out = heads * (c.qk_head_dim + c.qk_pos_emb_head_dim)
        if c.q_lora_rank is None:
            params = [Param(m + "linear_q_proj.weight", ((att + "q_proj.weight", (q_out, hidden)),), "rows")]
        else:
            params = [
                Param(m + "linear_q_down_proj.weight", ((att + "q_a_proj.weight", (c.q_lora_rank, hidden)),), "rows"),
                Param(m + "q_layernorm.weight", ((att + "q_a_layernorm.weight", (c.q_lora_rank,)),), "copy"),
                Param(m + "linear_q_up_proj.weight", ((att + "q_b_proj.weight", (q_out, c.q_lora_rank)),), "rows"),
            ]
        kv_down = ((att + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_pos_emb_head_dim, hidden)),)
        kv_up = ((att + "kv_b_proj.weight", (heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank)),)
        return params + [
            Param(m + "linear_kv_down_proj.weight", kv_down, "rows"),
            Param(m + "kv_layernorm.weight", ((att + "kv_a_layernorm.weight", (c.kv_lora_rank,)),), "copy"),
            Param(m + "linear_kv_up_proj.weight", kv_up, "rows"),
            Param(m + "linear_proj.weight", ((att + "o_proj.weight", (hidden, heads * c.v_head_dim)),), "cols"),
        ]

    def hf_config_kwargs(self, c: Any) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(c.rotary_base)}
        if c.rope_type == "yarn":
            rope = {
                **rope,
                "rope_type": "yarn",
                "factor": c.rotary_scaling_factor,
                "beta_fast": c.beta_fast,
                "beta_slow": c.beta_slow,
                "mscale": c.mscale,
                "mscale_all_dim": c.mscale_all_dim,
                "original_max_position_embeddings": c.original_max_position_embeddings,
            }
        return {
            **router_config_kwargs(c),
            "q_lora_rank": c.q_lora_rank,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_head_dim,
            "qk_rope_head_dim": c.qk_pos_emb_head_dim,
            "v_head_dim": c.v_head_dim,
            "rope_parameters": rope,
            "rope_interleave": True,
        }


def mla_rope_fields(hf: Any) -> dict[str, Any]:
    """RoPE on MLA's rope slice: 'default' or YaRN with DeepSeek's mscale pair (transformers scales cos/sin by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else by mscale(factor, 1): Megatron's
    formula with mscale 1 and mscale_all_dim 0, which only leaves the softmax scale unchanged too)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", 10000.0))
    if not theta.is_integer():
        raise ValueError(f"rope_theta={theta} is not an integer; ModelConfig.rotary_base is an int")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return {"rotary_base": int(theta), "rope_type": "rope"}
    if rope_type != "yarn":
        raise ValueError(f"{ARCH} with rope_type={rope_type!r} is not supported; 'default' or 'yarn'")
    for name, ok in (
        ("attention_factor", params.get("attention_factor") is None),
        ("truncate", params.get("truncate", True)),
    ):
        if not ok:
            raise ValueError(f"{ARCH} with YaRN {name}={params.get(name)!r} is not supported")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):
        if all_dim:
            raise ValueError(f"{ARCH} with YaRN mscale={mscale!r} and mscale_all_dim={all_dim!r} is not supported")
        mscale, all_dim = 1.0, 0.0
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or hf.max_position_embeddings / original
    return {
        "rotary_base": int(theta),
        "rope_type": "yarn",
        "rotary_scaling_factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "mscale": float(mscale),
        "mscale_all_dim": float(all_dim),
    }
