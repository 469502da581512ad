"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight): Multi-Latent Attention, dense first
layers (``first_k_dense_replace``), then MoE layers with one ungated shared MLP (``n_shared_experts`` experts' worth)
and the sigmoid router with ``e_score_correction_bias``, group-limited top-k and ``routed_scaling_factor``.

HF's attention projections map one to one onto Megatron's ``MLASelfAttention``: both lay ``q_b_proj`` out per head
as [nope; rope], ``kv_a_proj_with_mqa`` as [latent; the shared RoPE key] and ``kv_b_proj`` per head as [nope key;
value]; HF's interleaved RoPE (``rope_interleave=True``) is what Megatron's MLA always applies.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_megatron.gpt.hf.families.base import dense_mlp
from lightning_megatron.gpt.hf.families.moe import MoEFamily
from lightning_megatron.gpt.hf.params import ModelShape, Param

ARCH = "DeepseekV3ForCausalLM"


class DeepseekV3(MoEFamily):
    """DeepSeek-V3: router ``mlp.gate`` (its ``e_score_correction_bias`` is Megatron's ``router.expert_bias``),
    experts ``mlp.experts.{e}.*_proj``, shared experts ``mlp.shared_experts.*_proj``."""

    architectures = (ARCH,)
    model_types = ("deepseek_v3",)
    export_architecture = ARCH
    config_class = "DeepseekV3Config"
    latent_attention = True
    own_rope = True

    def fields(self, hf: Any) -> dict[str, Any]:
        if not getattr(hf, "rope_interleave", True):
            raise ValueError(f"{ARCH} with rope_interleave=False is not supported (Megatron's MLA interleaves)")
        mtp = int(getattr(hf, "num_nextn_predict_layers", None) or getattr(hf, "num_mtp_layers", 0) or 0)
        if mtp:  # layers past num_hidden_layers in the checkpoint; transformers does not build them either
            n = hf.num_hidden_layers
            warnings.warn(
                f"{ARCH}: skipping num_nextn_predict_layers={mtp} multi-token-prediction layer(s) "
                f"model.layers.{n}..{n + mtp - 1} (next-token loss only)",
                stacklevel=2,
            )
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
        return {"add_qkv_bias": False, **mla, **mla_rope_fields(hf), **router_fields(hf)}

    def matches(self, c: Any) -> bool:
        shared = c.moe_shared_expert_intermediate_size is not None and not c.moe_shared_expert_gate
        sigmoid = c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
        return c.multi_latent_attention and c.num_moe_experts is not None and shared and sigmoid and c.qk_layernorm

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

    def mlp_params(self, c: ModelShape, m: str, h: str, layer: int, experts: range | None) -> list[Param]:
        params = super().mlp_params(c, m, h, layer, experts)
        if params and params[0].megatron == m + "mlp.router.weight":  # an MoE layer: the router's bias follows it
            bias = ((f"{h}{self.block}.gate.e_score_correction_bias", (c.num_moe_experts or 0,)),)
            params.insert(1, Param(m + "mlp.router.expert_bias", bias, "copy"))
        return params

    def shared_expert_params(self, c: ModelShape, m: str, hb: str) -> list[Param]:
        ffn = c.moe_shared_expert_intermediate_size or 0
        return dense_mlp(m + "mlp.shared_experts.", hb + "shared_experts.", c.hidden_size, ffn)

    def skipped(self, name: str, hf: Any) -> bool:
        """The MTP layers' tensors (``model.layers.{i}.`` for ``i >= num_hidden_layers``), which import skips."""
        parts = name.split(".")
        return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= hf.num_hidden_layers

    def hf_config_kwargs(self, c: Any) -> dict[str, Any]:
        ffn = c.moe_ffn_hidden_size or c.effective_ffn_hidden_size
        pattern = c.moe_layer_freq if isinstance(c.moe_layer_freq, tuple) else (1,) * c.num_layers
        groups = c.moe_router_num_groups or 1
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
            "n_routed_experts": c.num_moe_experts,
            "num_experts_per_tok": c.moe_router_topk,
            "moe_intermediate_size": ffn,
            "n_shared_experts": (c.moe_shared_expert_intermediate_size or 0) // ffn,
            "first_k_dense_replace": pattern.index(1) if 1 in pattern else c.num_layers,
            "n_group": groups,
            "topk_group": c.moe_router_group_topk or groups,
            "norm_topk_prob": c.moe_router_topk > 1,
            "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
            "q_lora_rank": c.q_lora_rank,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_head_dim,
            "qk_rope_head_dim": c.qk_pos_emb_head_dim,
            "v_head_dim": c.v_head_dim,
            "rope_parameters": rope,
            "rope_interleave": True,
            "num_nextn_predict_layers": 0,
        }


def router_fields(hf: Any) -> dict[str, Any]:
    """The MoE fields: Megatron's sigmoid router divides the k chosen scores by their sum exactly when k > 1, and
    picks groups by the sum of each group's top ``k // topk_group`` scores, where transformers sums its top 2."""
    experts, k, first = hf.n_routed_experts, hf.num_experts_per_tok, int(hf.first_k_dense_replace or 0)
    if bool(hf.norm_topk_prob) != (k > 1):
        raise ValueError(
            f"{ARCH} with norm_topk_prob={hf.norm_topk_prob} and num_experts_per_tok={k} is not "
            "supported: Megatron's sigmoid router renormalises the chosen scores iff top-k > 1"
        )
    if not hf.n_shared_experts:
        raise ValueError(f"{ARCH} with n_shared_experts={hf.n_shared_experts!r} is not supported; at least 1")
    groups, topk_group = int(hf.n_group or 1), int(hf.topk_group or 1)
    grouped = topk_group < groups  # all groups kept: routing is plain top-k
    if grouped and k // topk_group != 2:
        raise ValueError(
            f"{ARCH} with num_experts_per_tok={k} and topk_group={topk_group} is not supported: "
            "Megatron ranks groups by their top (top-k // topk_group) scores, transformers by their "
            "top 2; use top-k = 2 x topk_group"
        )
    if first >= hf.num_hidden_layers:
        raise ValueError(f"{ARCH} with first_k_dense_replace={first} >= num_hidden_layers has no MoE layer")
    scaling = float(hf.routed_scaling_factor)
    return {
        "num_moe_experts": experts,
        "moe_router_topk": k,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": topk_group if grouped else None,
        "moe_router_topk_scaling_factor": None if scaling == 1.0 else scaling,
        "moe_shared_expert_intermediate_size": hf.moe_intermediate_size * hf.n_shared_experts,
        "moe_layer_freq": tuple(int(i >= first) for i in range(hf.num_hidden_layers)) if first else 1,
        "moe_aux_loss_coeff": 0.0,
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
