"""Hugging Face config -> :class:`~lightning_megatron.ModelConfig` fields, for the families of
:mod:`lightning_megatron.gpt.hf.registry`.

:func:`model_fields` is what ``ModelConfig.from_hf`` builds from: the fields every family shares (sizes, norms, RoPE)
here, the family's own from its adapter; anything ``ModelConfig`` cannot express raises ``ValueError`` naming it. The
config class imports this module, so neither it nor the family adapters import model code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_megatron.gpt.hf.registry import ARCHITECTURES, BY_MODEL_TYPE, family_of_hf

# What Megatron's Llama-3 RoPE scaling hard-codes (RotaryEmbedding._apply_scaling); only its factor is a parameter.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def pretrained_config(hf_config: Any) -> Any:
    """A transformers ``PretrainedConfig`` from a config, a config.json dict or a model directory."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, str | Path):
        config_file = Path(hf_config) / "config.json"
        if config_file.is_file() and json.loads(config_file.read_text()).get("model_type") not in CONFIG_MAPPING:
            return pretrained_config(json.loads(config_file.read_text()))  # e.g. Kimi-K2: remote code's model_type
        return AutoConfig.from_pretrained(str(hf_config))
    if isinstance(hf_config, Mapping):
        model_type = hf_config.get("model_type")
        if model_type in CONFIG_MAPPING:
            # from_dict fills what config.json leaves out with the architecture's defaults, as transformers does.
            return CONFIG_MAPPING[model_type].from_dict(dict(hf_config))
        # A model_type of remote code (Kimi-K2's "kimi_k2") on a supported architecture: read with that
        # architecture's config class, as its remote code subclasses it; no remote code runs.
        names = list(hf_config.get("architectures") or [])
        if not names or names[0] not in ARCHITECTURES:
            raise ValueError(_unsupported(f"model_type={model_type!r}"))
        import transformers

        return getattr(transformers, family_of_hf(names[0]).config_class).from_dict(dict(hf_config))
    raise TypeError(f"hf_config must be a PretrainedConfig, a config.json dict or a directory, got {type(hf_config)}")


def _unsupported(what: str) -> str:
    try:
        import megatron.bridge  # noqa: F401
    except Exception as error:  # any import failure means the same: no bridge here
        bridge = (
            f"Megatron-Bridge's AutoBridge (more architectures) is not importable here ({type(error).__name__}: "
            f"{error}); it needs Transformer Engine and `pip install megatron-bridge`"
        )
    else:
        bridge = (
            "megatron.bridge is installed, but from_hf does not delegate to its AutoBridge (it builds Transformer "
            "Engine layer specs, not the local spec this module trains); convert with AutoBridge directly"
        )
    return f"{what} is not supported; supported architectures: {', '.join(ARCHITECTURES)}. {bridge}"


def architecture(hf_config: Any) -> str:
    """The supported architecture name of an HF config; raises ValueError for any other."""
    cfg = pretrained_config(hf_config)
    names = list(getattr(cfg, "architectures", None) or [])
    name = names[0] if names else BY_MODEL_TYPE.get(getattr(cfg, "model_type", ""), "")
    if name not in ARCHITECTURES:
        raise ValueError(_unsupported(f"architecture {name or cfg.model_type!r}"))
    return name


def model_fields(hf_config: Any, *, seq_length: int | None = None) -> dict[str, Any]:
    """:class:`~lightning_megatron.ModelConfig` fields of an HF config of a supported architecture.

    ``seq_length`` defaults to ``max_position_embeddings``, capped by a sliding attention window (the local
    attention is full causal attention, exact only for sequences that fit in the window).
    """
    cfg = pretrained_config(hf_config)
    arch = architecture(cfg)
    heads, family = cfg.num_attention_heads, family_of_hf(arch)
    # Biases on o_proj / the MLP have no Megatron counterpart here (GLM's attention_bias is q/k/v only).
    for flag in ("mlp_bias",) if family.qkv_attention_bias else ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise ValueError(f"{arch} with {flag}=True is not supported (only q/k/v biases are)")
    if cfg.hidden_act not in ("silu", "gelu"):
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; 'silu' or 'gelu'")
    return {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": getattr(cfg, "num_key_value_heads", None) or heads,
        "kv_channels": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "ffn_hidden_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "seq_length": _seq_length(cfg, seq_length),
        "normalization": "RMSNorm",
        "norm_epsilon": float(cfg.rms_norm_eps),
        "activation": cfg.hidden_act,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings),
        "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0)),
        "init_method_std": float(getattr(cfg, "initializer_range", 0.02)),
        **({} if family.own_rope else _rope_fields(cfg, partial=family.partial_rope)),
        **family.fields(cfg),
    }


def _seq_length(cfg: Any, requested: int | None) -> int:
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type.startswith("qwen") and not getattr(cfg, "use_sliding_window", False):
        window = None  # Qwen configs carry a window size that only applies with use_sliding_window
    if requested is None:
        return min(cfg.max_position_embeddings, window or cfg.max_position_embeddings)
    if window is not None and requested > window:
        raise ValueError(
            f"seq_length={requested} exceeds the model's sliding attention window ({window}); Megatron's local "
            f"attention here is full causal attention, which equals the windowed one only up to {window} tokens: "
            f"use seq_length <= {window}"
        )
    return requested


def _rope_fields(cfg: Any, *, partial: bool) -> dict[str, Any]:
    """RoPE fields; ``partial``: the family's attention rotates the first ``partial_rotary_factor`` of each head
    (rotate-half, frequencies over those dims: Megatron's ``rotary_percent``), which others do not honour."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:  # transformers < 5: rope_theta and rope_scaling
        params = {**(getattr(cfg, "rope_scaling", None) or {}), "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
    if factor != 1.0 and not (partial and 0.0 < factor < 1.0):
        raise ValueError(f"partial_rotary_factor={factor} is not supported for {type(cfg).__name__}")
    theta = float(params.get("rope_theta", 10000.0))
    if not theta.is_integer():
        raise ValueError(f"rope_theta={theta} is not an integer; ModelConfig.rotary_base is an int")
    fields: dict[str, Any] = {"rotary_base": int(theta), **({"rotary_percent": factor} if factor != 1.0 else {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return fields
    if rope_type == "linear":
        return {**fields, "seq_len_interpolation_factor": float(params["factor"])}
    if rope_type == "llama3":
        differ = {k: params.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if float(params.get(k, v)) != v}
        if differ:
            raise ValueError(
                f"llama3 RoPE scaling with {differ} is not supported: Megatron's implementation fixes "
                f"{MEGATRON_LLAMA3_ROPE}"
            )
        return {**fields, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: 'default', 'linear', 'llama3'")
