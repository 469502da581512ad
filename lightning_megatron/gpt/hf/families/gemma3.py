"""Gemma 3, text only (``Gemma3ForCausalLM`` / ``Gemma3TextConfig``): sliding-window and full attention layers
(``layer_types``) with a RoPE base each (``rope_parameters``' two entries), q/k RMSNorms, four norms per layer
(before and after attention, before and after the MLP), Gemma's RMSNorm ``x * (1 + w)``, embeddings scaled by
sqrt(hidden_size), GeGLU with tanh GELU, tied embeddings and the ``query_pre_attn_scalar`` softmax scale.

HF's ``sliding_window`` S attends a query to itself and the S - 1 keys before it: ``window_size=(S - 1, 0)``. The
norms' gains are stored as ``w`` in HF and here (``layernorm_zero_centered_gamma``), so they copy unchanged.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.base import Family
from lightning_megatron.gpt.hf.params import ModelShape, Param
from lightning_megatron.gpt.hf.rope import rope_fields

ARCH = "Gemma3ForCausalLM"
LAYER_TYPES = {"sliding_attention": 1, "full_attention": 0}
"""HF's layer types -> Megatron's ``window_attn_skip_freq`` entries (1: windowed)."""


class Gemma3(Family):
    """Gemma 3 (text): the base attention with q/k norms, a dense GeGLU MLP, and Gemma's norms around both."""

    architectures = (ARCH,)
    model_types = ("gemma3_text",)
    export_architecture = ARCH
    config_class = "Gemma3TextConfig"
    own_rope = True
    windowed = True
    gemma_layout = True

    unsupported: tuple[str, ...] = ("use_bidirectional_attention", "attn_logit_softcapping")
    """HF settings refused (transformers' Gemma 3 attention does not apply attn_logit_softcapping: mapping it
    would change the model)."""
    qk_norms = True

    def fields(self, hf: Any) -> dict[str, Any]:
        arch = self.architectures[0]
        for name in self.unsupported:
            if getattr(hf, name, None):
                raise ValueError(f"{arch} with {name}={getattr(hf, name)!r} is not supported")
        kinds = list(hf.layer_types)
        if set(kinds) - set(LAYER_TYPES):
            raise ValueError(f"{arch} with layer_types={kinds!r}: only {list(LAYER_TYPES)} are supported")
        windowed = [LAYER_TYPES[kind] for kind in kinds]
        cap = getattr(hf, "final_logit_softcapping", None)
        fields: dict[str, Any] = {
            "add_qkv_bias": False, "qk_layernorm": self.qk_norms, "layernorm_zero_centered_gamma": True,
            "post_sublayer_norms": True, "scale_embeddings": True,
            "softmax_scale": float(hf.query_pre_attn_scalar) ** -0.5,
            "final_logit_softcapping": float(cap) if cap else None,
            **_rope(hf),
        }  # fmt: skip
        if any(windowed):
            fields["window_size"] = (int(hf.sliding_window) - 1, 0)
            fields["window_attn_skip_freq"] = None if all(windowed) else tuple(windowed)
            fields.update(self.window_rope(hf))
        return fields

    def window_rope(self, hf: Any) -> dict[str, Any]:
        """The sliding layers' own RoPE base (Gemma 3's second ``rope_parameters`` entry)."""
        return {"local_rotary_base": _local_base(hf)}

    def matches(self, c: ModelShape) -> bool:
        plain = getattr(c, "attn_logit_softcapping", None) is None  # HF's Gemma 3 would ignore it
        return gemma_layer(c) and c.qk_layernorm and plain

    def hf_config_kwargs(self, c: Any) -> dict[str, Any]:
        from lightning_megatron.gpt.attention_variants import window_layers

        scalar = (c.softmax_scale or c.effective_kv_channels**-0.5) ** -2
        full = {"rope_type": "default", "rope_theta": float(c.rotary_base)}
        if c.seq_len_interpolation_factor is not None:
            full = {**full, "rope_type": "linear", "factor": c.seq_len_interpolation_factor}
        local = float(c.local_rotary_base or c.rotary_base)
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": [("sliding_attention" if w else "full_attention") for w in window_layers(c)],
            "sliding_window": c.window_size[0] + 1 if c.window_size is not None else c.seq_length,
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
            "final_logit_softcapping": c.final_logit_softcapping,
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
            },
        }

    def layer_params(self, c: ModelShape, local: int, layer: int, experts: range | None = None) -> list[Param]:
        """Attention, MLP, then the four norms, as HF orders them."""
        m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
        norms = (
            ("input_layernorm", "input_layernorm"),
            ("self_attention.post_layernorm", "post_attention_layernorm"),
            ("pre_mlp_layernorm", "pre_feedforward_layernorm"),
            ("mlp.post_layernorm", "post_feedforward_layernorm"),
        )
        params = [*self.attention_params(c, m, h + "self_attn."), *self.mlp_params(c, m, h, layer, experts)]
        for ours, theirs in norms:
            params.append(Param(f"{m}{ours}.weight", ((f"{h}{theirs}.weight", (c.hidden_size,)),), "copy"))
        return params


def gemma_layer(c: ModelShape) -> bool:
    """Whether ``c`` has the layer Gemma 2 and 3 share: dense, zero-centred gains and post norms, scaled embeddings,
    tanh GeGLU, no q/k/v biases."""
    gemma = all(getattr(c, name, False) for name in ("layernorm_zero_centered_gamma", "post_sublayer_norms"))
    dense = c.num_moe_experts is None and not getattr(c, "multi_latent_attention", False)
    act = getattr(c, "activation", None) == "gelu_tanh" and getattr(c, "scale_embeddings", False)
    return gemma and dense and act and not c.add_qkv_bias


def _rope(hf: Any) -> dict[str, Any]:
    """The full-attention layers' RoPE (default or linear scaling): ``rotary_base`` and its scaling."""
    params = dict(hf.rope_parameters or {})
    full = params.get("full_attention", params)  # a flat dict: one RoPE for both kinds (transformers < 5)
    return rope_fields(hf, partial=False, params=dict(full))


def _local_base(hf: Any) -> int:
    """The sliding layers' RoPE base; only unscaled RoPE there (Gemma 3 scales the global layers only)."""
    params = dict(hf.rope_parameters or {})
    local = params.get("sliding_attention") or {"rope_theta": getattr(hf, "rope_local_base_freq", 10000.0)}
    rope_type = local.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{ARCH} with rope_parameters['sliding_attention'] rope_type={rope_type!r}: only 'default'")
    theta = float(local["rope_theta"])
    if not theta.is_integer():
        raise ValueError(f"{ARCH} with a sliding-layer rope_theta={theta}: ModelConfig.local_rotary_base is an int")
    return int(theta)
