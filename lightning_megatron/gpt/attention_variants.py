"""Attention variants of a GPT's layers -- sliding windows, attention sinks, logit soft-capping, a query scale --
checked before anything is built, and the ``TransformerConfig`` fields they set. The kernels are in
:mod:`lightning_megatron.kernels.variants`. This module reads a config through :class:`VariantRequest` (it imports
no config)."""

from __future__ import annotations

from typing import Any, Protocol

from lightning_megatron.validation import check_choice

__all__ = ["VariantRequest", "check_variants", "check_variants_parallel", "has_variants", "variant_fields"]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


class VariantRequest(Protocol):
    """The ``ModelConfig`` fields checked here."""

    num_layers: int
    kernels: str
    multi_latent_attention: bool
    window_size: tuple[int, int] | None
    window_attn_skip_freq: int | tuple[int, ...] | None
    softmax_type: str
    softmax_scale: float | None
    attn_logit_softcapping: float | None


def has_variants(config: VariantRequest) -> bool:
    """Whether the model needs a variant kernel (window, sinks or soft-capping; a query scale is plain SDPA's)."""
    windowed = config.window_size is not None
    return windowed or config.softmax_type != "vanilla" or config.attn_logit_softcapping is not None


def check_variants(config: VariantRequest) -> None:
    """Raise ``ValueError`` naming the field and its value for an attention variant that cannot be built (YAML and
    JSON lists of the window fields become tuples first)."""
    for name in ("window_size", "window_attn_skip_freq"):
        if isinstance(getattr(config, name), list):
            setattr(config, name, tuple(getattr(config, name)))
    check_choice("softmax_type", config.softmax_type, SOFTMAX_TYPES)
    for name in ("softmax_scale", "attn_logit_softcapping"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value} must be > 0, or None (softmax_scale None: 1/sqrt(kv_channels))")
    _check_window(config)
    if config.attn_logit_softcapping is not None and config.kernels in ("te", "local"):
        raise ValueError(
            f"attn_logit_softcapping={config.attn_logit_softcapping} with kernels={config.kernels!r}: Megatron's "
            "attention has no soft-capping; use kernels='torch' or 'auto'"
        )
    if config.multi_latent_attention:
        for name, value in _set_fields(config):
            raise ValueError(
                f"{name}={value!r} with multi_latent_attention=True: MLA sets its own softmax scale and its core "
                f"attention runs no attention variants here; leave {name} at its default with MLA"
            )


def _check_window(config: VariantRequest) -> None:
    window, freq = config.window_size, config.window_attn_skip_freq
    if window is None:
        if freq is not None:
            raise ValueError(
                f"window_attn_skip_freq={freq!r} picks the sliding-window layers, and window_size=None has no window; "
                "set window_size=(W, 0) or window_attn_skip_freq=None"
            )
        return
    if len(window) != 2 or not all(isinstance(n, int) for n in window) or window[0] < 0 or window[1] != 0:
        raise ValueError(
            f"window_size={window!r}: causal sliding windows are window_size=(W, 0), a query attending itself and "
            "the W tokens before it (HF's sliding_window is W + 1)"
        )
    if isinstance(freq, int) and freq < 2:
        raise ValueError(
            f"window_attn_skip_freq={freq}: an int N makes every N-th layer full attention and the others windowed "
            "(N >= 2); None: every layer windowed; or one 0/1 per layer (1: windowed)"
        )
    if isinstance(freq, tuple) and (len(freq) != config.num_layers or not set(freq) <= {0, 1}):
        raise ValueError(
            f"window_attn_skip_freq={freq!r}: one 0 (full attention) or 1 (sliding window) per layer, "
            f"num_layers={config.num_layers} of them"
        )


def _set_fields(config: VariantRequest) -> list[tuple[str, Any]]:
    defaults = {"window_size": None, "softmax_type": "vanilla", "softmax_scale": None, "attn_logit_softcapping": None}
    return [(name, getattr(config, name)) for name, default in defaults.items() if getattr(config, name) != default]


def check_variants_parallel(config: VariantRequest, cp: int) -> None:
    """Raise ``ValueError`` for variants Transformer Engine would run under context parallelism (``kernels='te'``:
    not run here, and its CP attention does not take every window or softmax type); the torch kernels run them at
    any CP."""
    if cp == 1 or config.kernels != "te":
        return
    for name, value in _set_fields(config):
        if name != "softmax_scale":  # a scale is any attention's own argument
            raise ValueError(
                f"{name}={value!r} with cp={cp} and kernels='te': attention variants under context parallelism run "
                "on the torch kernels; use kernels='torch' or 'auto'"
            )


def variant_fields(config: VariantRequest) -> dict[str, Any]:
    """``TransformerConfig`` fields of the variants (Megatron's names; its attention reads them per layer)."""
    freq = config.window_attn_skip_freq
    return {
        "window_size": config.window_size,
        # Megatron's is_layer_window_attention tells a per-layer pattern by isinstance(list).
        "window_attn_skip_freq": list(freq) if isinstance(freq, tuple) else freq,
        "softmax_type": config.softmax_type,
        "softmax_scale": config.softmax_scale,
    }


def window_layers(config: VariantRequest) -> tuple[bool, ...]:
    """Whether each (0-based, global) layer has a sliding window (HF's ``layer_types``: 'sliding_attention')."""
    from megatron.core.transformer.utils import is_layer_window_attention

    fields = variant_fields(config)
    window, freq = fields["window_size"], fields["window_attn_skip_freq"]
    return tuple(is_layer_window_attention(window, freq, i + 1) for i in range(config.num_layers))
