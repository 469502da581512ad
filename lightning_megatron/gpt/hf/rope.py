"""HF RoPE parameters -> :class:`~lightning_megatron.ModelConfig` RoPE fields (the mapping every family shares but
MLA's; Gemma 3 reads it per layer type). A leaf: the families and :mod:`lightning_megatron.gpt.hf.fields` import it."""

from __future__ import annotations

from typing import Any

__all__ = ["MEGATRON_LLAMA3_ROPE", "rope_fields"]

# What Megatron's Llama-3 RoPE scaling hard-codes (RotaryEmbedding._apply_scaling); only its factor is a parameter.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_fields(cfg: Any, *, partial: bool, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """RoPE fields; ``partial``: the family's attention rotates the first ``partial_rotary_factor`` of each head
    (rotate-half, frequencies over those dims: Megatron's ``rotary_percent``), which others do not honour.
    ``params``: the RoPE parameters to read (default: the config's own, e.g. one layer type's of Gemma 3)."""
    params = dict(params if params is not None else getattr(cfg, "rope_parameters", None) or {})
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
