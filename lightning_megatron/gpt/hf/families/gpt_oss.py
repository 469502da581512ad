"""GPT-OSS (``GptOssForCausalLM``): attention with q/k/v/o biases and learnable sinks (``softmax_type='learnable'``,
HF's ``self_attn.sinks`` as ``core_attention.softmax_offset``), sliding-window and full layers (``layer_types``),
YaRN RoPE (rotate-half, as Megatron's), and every layer an MoE: a router with a bias, a softmax over the top-k
logits, experts with biases and GPT-OSS's clamped GLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
``g = clamp(gate, max=l)`` -- Megatron's GLU with ``quick_gelu`` (alpha 1.702), ``glu_linear_offset=1`` and
``activation_func_clamp_value=l``.

HF stores a layer's experts fused, transposed from ``nn.Linear`` and with gate/up columns interleaved
(``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * ffn]``, ``down_proj`` ``[E, ffn, hidden]``, and their biases); the
tables name each expert's piece (``...gate_up_proj@expert3``, kinds ``fused_*`` of
:mod:`~lightning_megatron.gpt.hf.params`). Megatron puts a bias on every linear with ``add_bias_linear``, which
is what GPT-OSS has. Its releases store the experts' two projections in MXFP4 (``gate_up_proj_blocks`` /
``_scales``, ... : :data:`GptOss.mxfp4_weights`, read and written by :mod:`lightning_megatron.gpt.hf.mxfp4`).
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.gemma3 import LAYER_TYPES
from lightning_megatron.gpt.hf.families.moe import MoEFamily
from lightning_megatron.gpt.hf.mxfp4 import mxfp4_config
from lightning_megatron.gpt.hf.params import EXPERT_PIECE, ModelShape, Param
from lightning_megatron.gpt.hf.rope import rope_fields
from lightning_megatron.gpt.moe.config import moe_layer_pattern

ARCH = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702
"""Megatron's ``quick_gelu`` constant: the only ``swiglu_alpha`` it computes."""


class GptOss(MoEFamily):
    """GPT-OSS: router ``mlp.router`` (weight and bias), fused experts ``mlp.experts.{gate_up,down}_proj[_bias]``."""

    architectures = (ARCH,)
    model_types = ("gpt_oss",)
    export_architecture = ARCH
    config_class = "GptOssConfig"
    own_rope = True
    windowed = True
    qkv_attention_bias = True  # attention_bias (q/k/v and o) is mapped by fields(), as add_bias_linear
    linear_biases = True
    yarn_rope = True
    mxfp4_weights = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

    def fields(self, hf: Any) -> dict[str, Any]:
        quant = getattr(hf, "quantization_config", None)
        quant = dict(quant.to_dict() if hasattr(quant, "to_dict") else quant or {})
        if quant and mxfp4_config({"quantization_config": quant}) is None:  # (MXFP4's settings checked there)
            raise ValueError(
                f"{ARCH} with quantization_config quant_method={quant.get('quant_method')!r} is not supported: "
                "GPT-OSS checkpoints are read in float or with MXFP4 experts (quant_method='mxfp4')"
            )
        if not getattr(hf, "attention_bias", True):
            raise ValueError(f"{ARCH} with attention_bias=False is not supported (its experts and router have biases)")
        if float(hf.swiglu_alpha) != QUICK_GELU_ALPHA:
            raise ValueError(f"{ARCH} with swiglu_alpha={hf.swiglu_alpha}: only {QUICK_GELU_ALPHA} (quick_gelu)")
        moe = self.moe_fields(hf, experts=hf.num_local_experts, sparse=(True,) * hf.num_hidden_layers, renormalise=True)
        limit = getattr(hf, "swiglu_limit", None)
        return {
            "add_qkv_bias": False, "add_bias_linear": True, "qk_layernorm": False, "softmax_type": "learnable",
            "activation": "quick_gelu", "glu_linear_offset": 1.0,
            "activation_func_clamp_value": float(limit) if limit is not None else None,
            **moe, **_windows(hf), **_rope(hf),
        }  # fmt: skip

    def matches(self, c: ModelShape) -> bool:
        if c.num_moe_experts is None or c.qk_layernorm or c.moe_router_pre_softmax:
            return False
        gpt_oss = (
            getattr(c, "activation", None) == "quick_gelu"
            and getattr(c, "glu_linear_offset", 0.0) == 1.0
            and getattr(c, "softmax_type", None) == "learnable"
        )
        every_layer = all(moe_layer_pattern(c.num_layers, c.moe_layer_freq))
        return gpt_oss and every_layer and c.moe_shared_expert_intermediate_size is None

    def hf_config_kwargs(self, c: Any) -> dict[str, Any]:
        from lightning_megatron.gpt.attention_variants import window_layers

        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(c.rotary_base)}
        if c.position_embedding_type == "yarn":
            rope = {**rope, "rope_type": "yarn", "factor": c.rotary_scaling_factor, "beta_fast": c.beta_fast,
                    "beta_slow": c.beta_slow, "truncate": c.yarn_correction_range_round_to_int,
                    "original_max_position_embeddings": c.original_max_position_embeddings}  # fmt: skip
            if (c.mscale, c.mscale_all_dim) != (1.0, 0.0):
                rope = {**rope, "mscale": c.mscale, "mscale_all_dim": c.mscale_all_dim}
        return {
            "num_local_experts": c.num_moe_experts, "num_experts_per_tok": c.moe_router_topk,
            "intermediate_size": c.moe_ffn_hidden_size or c.effective_ffn_hidden_size, "hidden_act": "silu",
            "layer_types": [("sliding_attention" if w else "full_attention") for w in window_layers(c)],
            "sliding_window": c.window_size[0] + 1 if c.window_size is not None else c.seq_length,
            "swiglu_limit": c.activation_func_clamp_value, "swiglu_alpha": QUICK_GELU_ALPHA,
            "attention_bias": True, "rope_parameters": rope,
        }  # fmt: skip

    def attention_params(self, c: ModelShape, m: str, att: str) -> list[Param]:
        """The base attention with q/k/v and o biases and the sinks (one logit per head: split like the heads)."""
        params = super().attention_params(c, m, att)
        params.append(Param(m + "self_attention.linear_qkv.bias", _qkv_bias(att, c), "qkv"))
        params.append(Param(m + "self_attention.linear_proj.bias", ((att + "o_proj.bias", (c.hidden_size,)),), "copy"))
        sinks = ((att + "sinks", (c.num_attention_heads,)),)
        params.append(Param(m + "self_attention.core_attention.softmax_offset", sinks, "rows"))
        return params

    def mlp_params(self, c: ModelShape, m: str, h: str, layer: int, experts: range | None) -> list[Param]:
        num_experts, hidden = c.num_moe_experts or 0, c.hidden_size
        ffn = c.moe_ffn_hidden_size or c.effective_ffn_hidden_size
        router = [(m + "mlp.router.weight", h + "mlp.router.weight", (num_experts, hidden))]
        router.append((m + "mlp.router.bias", h + "mlp.router.bias", (num_experts,)))
        params = [Param(ours, ((theirs, shape),), "copy") for ours, theirs, shape in router]
        pieces = (
            ("linear_fc1.weight", "gate_up_proj", (hidden, 2 * ffn), "fused_gate_up"),
            ("linear_fc1.bias", "gate_up_proj_bias", (2 * ffn,), "fused_gate_up_bias"),
            ("linear_fc2.weight", "down_proj", (ffn, hidden), "fused_down"),
            ("linear_fc2.bias", "down_proj_bias", (hidden,), "copy"),
        )
        for local, e in enumerate(experts if experts is not None else range(num_experts)):
            for ours, theirs, shape, kind in pieces:
                hf = ((f"{h}mlp.experts.{theirs}{EXPERT_PIECE}{e}", shape),)
                params.append(Param(f"{m}mlp.experts.{ours}", hf, kind, expert=local))  # type: ignore[arg-type]
        return params

    def mlp_adapter_params(self, c: Any, lora: Any, m: str, h: str, layer: int) -> list[Param]:
        """Each expert's adapters as pieces of PEFT's factors on ``mlp.experts.gate_up_proj`` / ``down_proj``
        (``target_parameters``), as the other MoE families'. PEFT's B on ``gate_up_proj`` has a row per output
        column of it, interleaved as gate0, up0, gate1, ...: ours ([gate; up] rows) is de-interleaved like the
        weight (kind ``fused_gate_up_rows``); the A factors and ``down_proj``'s read as on ``nn.Linear``'s layout,
        since PEFT's ``ParamWrapper`` takes GPT-OSS's ``[E, in, out]`` experts as transposed."""
        fc1_b = f"{m}experts.linear_fc1.lora_B.gate_up_proj"
        return [
            Param(p.megatron, p.hf, "fused_gate_up_rows", expert=p.expert) if p.megatron == fc1_b else p
            for p in super().mlp_adapter_params(c, lora, m, h, layer)
        ]


def _qkv_bias(att: str, c: ModelShape) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from lightning_megatron.gpt.hf.params import qkv

    return qkv(att, "bias", c, ())


def _windows(hf: Any) -> dict[str, Any]:
    """``layer_types`` -> the window and the windowed layers (HF's window S: the query and S - 1 keys before it)."""
    kinds = list(hf.layer_types)
    if set(kinds) - set(LAYER_TYPES):
        raise ValueError(f"{ARCH} with layer_types={kinds!r}: only {list(LAYER_TYPES)} are supported")
    windowed = [LAYER_TYPES[kind] for kind in kinds]
    if not any(windowed) or not hf.sliding_window:
        return {}
    return {"window_size": (int(hf.sliding_window) - 1, 0),
            "window_attn_skip_freq": None if all(windowed) else tuple(windowed)}  # fmt: skip


def _rope(hf: Any) -> dict[str, Any]:
    """Default RoPE, or YaRN as Megatron's ``YarnRotaryEmbedding`` computes it (transformers' formula: the same
    frequencies and cos/sin scale ``0.1 * ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim`` ratio)."""
    params = dict(hf.rope_parameters or {})
    if params.get("rope_type", "default") != "yarn":
        return rope_fields(hf, partial=False, params=params)
    if params.get("attention_factor") is not None:
        raise ValueError(f"{ARCH} with rope_parameters attention_factor={params['attention_factor']}: not supported")
    theta = float(params["rope_theta"])
    if not theta.is_integer():
        raise ValueError(f"{ARCH} with rope_theta={theta}: ModelConfig.rotary_base is an int")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or hf.max_position_embeddings / original
    both = bool(params.get("mscale")) and bool(params.get("mscale_all_dim"))
    return {
        "position_embedding_type": "yarn", "rotary_base": int(theta), "rotary_scaling_factor": float(factor),
        "original_max_position_embeddings": original, "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "mscale": float(params["mscale"]) if both else 1.0,
        "mscale_all_dim": float(params["mscale_all_dim"]) if both else 0.0,
        "yarn_correction_range_round_to_int": bool(params.get("truncate", True)),
    }  # fmt: skip
