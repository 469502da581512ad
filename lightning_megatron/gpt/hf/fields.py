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
from lightning_megatron.gpt.hf.rope import rope_fields

# Multimodal architectures whose text model is a supported one (refused with that said).
TEXT_ONLY = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# HF's hidden_act / hidden_activation -> ModelConfig.activation.
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def pretrained_config(hf_config: Any) -> Any:
    """A transformers ``PretrainedConfig`` from a config, a config.json dict or a model directory."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, str | Path):
        config_file = Path(hf_config) / "config.json"
        written = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if written and written.get("model_type") not in CONFIG_MAPPING:
            return pretrained_config(written)  # e.g. Kimi-K2: remote code's model_type
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
    if name in TEXT_ONLY:
        raise ValueError(
            f"architecture {name!r} (vision tower + language model) is not supported: import of its text model alone "
            f"is not implemented yet; a {TEXT_ONLY[name]} checkpoint (text only) imports"
        )
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
    # Gemma's configs name it hidden_activation (their hidden_act, if any, is not what the model runs).
    act_name = "hidden_activation" if getattr(cfg, "hidden_activation", None) else "hidden_act"
    act = getattr(cfg, act_name)
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"{act_name}={act!r} is not supported; one of {', '.join(map(repr, HF_ACTIVATIONS))}")
    return {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": getattr(cfg, "num_key_value_heads", None) or heads,
        "kv_channels": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "ffn_hidden_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "seq_length": _seq_length(cfg, seq_length, windowed=family.windowed),
        "normalization": "RMSNorm",
        "norm_epsilon": float(cfg.rms_norm_eps),
        "activation": HF_ACTIVATIONS[act],
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings),
        "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0)),
        "init_method_std": float(getattr(cfg, "initializer_range", 0.02)),
        **({} if family.own_rope else rope_fields(cfg, partial=family.partial_rope)),
        **family.fields(cfg),
    }


def _seq_length(cfg: Any, requested: int | None, *, windowed: bool = False) -> int:
    window = None if windowed else getattr(cfg, "sliding_window", None)  # windowed: built as window_size
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
