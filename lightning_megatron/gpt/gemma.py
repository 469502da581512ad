"""Gemma's decoder settings -- RMSNorm gains stored zero-centred, norms after attention and after the MLP,
embeddings scaled by sqrt(hidden_size), a RoPE base of the sliding-window layers of their own, soft-capped output
logits -- checked before
anything is built. The modules are in :mod:`lightning_megatron.gpt.gemma_layers`. This module reads a config
through :class:`GemmaRequest` (it imports no config)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["GemmaRequest", "check_gemma", "gemma_layout"]


class GemmaRequest(Protocol):
    """The ``ModelConfig`` fields checked here."""

    normalization: str
    kernels: str
    position_embedding_type: str
    multi_latent_attention: bool
    num_moe_experts: int | None
    window_size: tuple[int, int] | None
    layernorm_zero_centered_gamma: bool
    post_sublayer_norms: bool
    scale_embeddings: bool
    local_rotary_base: int | None
    final_logit_softcapping: float | None


def gemma_layout(config: GemmaRequest) -> bool:
    """Whether any of Gemma's settings is on (only the Gemma families export such a model)."""
    fields = ("layernorm_zero_centered_gamma", "post_sublayer_norms", "scale_embeddings")
    return (
        any(getattr(config, name, False) for name in fields) or getattr(config, "local_rotary_base", None) is not None
    )


def check_gemma(config: GemmaRequest) -> None:
    """Raise ``ValueError`` naming the field and its value for a Gemma setting that cannot be built."""
    if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
        raise ValueError(
            f"layernorm_zero_centered_gamma=True with normalization={config.normalization!r}: the zero-centred "
            "gain (1 + w) is built for RMSNorm only"
        )
    cap = config.final_logit_softcapping
    if cap is not None and not (isinstance(cap, int | float) and cap > 0):
        raise ValueError(f"final_logit_softcapping={cap!r} must be > 0 (Gemma 2: 30.0), or None for no capping")
    if not gemma_layout(config):
        return
    on = [name for name in ("layernorm_zero_centered_gamma", "post_sublayer_norms") if getattr(config, name)]
    if config.kernels == "te" and on:
        # TE's layer spec has its own fused norms; the torch-native norms and layer parts are ours.
        raise ValueError(f"{on[0]}=True with kernels='te': built with the torch-native spec only; use 'torch'/'auto'")
    if config.post_sublayer_norms and (config.multi_latent_attention or config.num_moe_experts is not None):
        raise ValueError(
            "post_sublayer_norms=True is built for dense layers with standard attention (Gemma); "
            f"got multi_latent_attention={config.multi_latent_attention}, num_moe_experts={config.num_moe_experts}"
        )
    base = config.local_rotary_base
    if base is None:
        return
    if base <= 0:
        raise ValueError(f"local_rotary_base={base} must be > 0, or None (rotary_base on every layer)")
    if config.position_embedding_type != "rope" or config.window_size is None:
        raise ValueError(
            f"local_rotary_base={base} is the RoPE base of the sliding-window layers: it needs "
            f"position_embedding_type='rope' (got {config.position_embedding_type!r}) and window_size set "
            f"(got {config.window_size!r})"
        )
    if config.kernels in ("te", "local"):
        # Megatron's GPTModel builds one RotaryEmbedding for all layers; ours applies RoPE per layer.
        raise ValueError(
            f"local_rotary_base={base} with kernels={config.kernels!r}: a RoPE base per layer is applied inside "
            "the torch kernels' attention only; use kernels='torch' or 'auto'"
        )
