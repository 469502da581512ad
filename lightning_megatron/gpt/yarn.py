"""YaRN RoPE for GPT (not MLA) models: ``position_embedding_type='yarn'`` (GPT-OSS).

Megatron's ``GPTModel`` builds its ``YarnRotaryEmbedding`` from, and its attention scales cos/sin by the YaRN
concentration factor read from, ``yarn_*`` attributes of the transformer config that ``TransformerConfig`` does not
declare (only ``MLATransformerConfig`` has YaRN fields, under other names): :func:`yarn_attributes` sets them from
the same ModelConfig fields MLA's YaRN reads. Megatron's YaRN is rotate-half, as transformers' GPT-OSS RoPE.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["check_yarn", "yarn_attributes"]


class YarnRequest(Protocol):
    """The ModelConfig fields read here."""

    position_embedding_type: str
    multi_latent_attention: bool
    rotary_percent: float
    rope_scaling: bool
    seq_len_interpolation_factor: float | None
    local_rotary_base: int | None
    rotary_scaling_factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    yarn_correction_range_round_to_int: bool


def check_yarn(config: YarnRequest) -> None:
    """Refuse YaRN settings GPTModel's YaRN does not take together, naming the field."""
    if config.position_embedding_type != "yarn":
        return
    others = {
        "rotary_percent": config.rotary_percent != 1.0,
        "rope_scaling": config.rope_scaling,
        "seq_len_interpolation_factor": config.seq_len_interpolation_factor is not None,
        "local_rotary_base": config.local_rotary_base is not None,
    }
    for name, set_ in others.items():
        if set_:
            raise ValueError(f"{name}={getattr(config, name)!r} with position_embedding_type='yarn': leave it unset")
    for name in ("rotary_scaling_factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
        if getattr(config, name) <= 0:
            raise ValueError(f"{name}={getattr(config, name)} must be > 0")
    for name in ("mscale", "mscale_all_dim"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name}={getattr(config, name)} must be >= 0")


def yarn_attributes(config: YarnRequest, transformer_config: Any) -> Any:
    """``transformer_config`` with the ``yarn_*`` attributes GPTModel's YaRN reads (unchanged without YaRN or with
    MLA, whose config has its own YaRN fields)."""
    if config.position_embedding_type != "yarn" or config.multi_latent_attention:
        return transformer_config
    attributes = {
        "yarn_rotary_scaling_factor": config.rotary_scaling_factor,
        "yarn_original_max_position_embeddings": config.original_max_position_embeddings,
        "yarn_beta_fast": config.beta_fast,
        "yarn_beta_slow": config.beta_slow,
        "yarn_mscale": config.mscale,
        "yarn_mscale_all_dim": config.mscale_all_dim,
        "yarn_correction_range_round_to_int": config.yarn_correction_range_round_to_int,
    }
    for name, value in attributes.items():
        setattr(transformer_config, name, value)
    return transformer_config
