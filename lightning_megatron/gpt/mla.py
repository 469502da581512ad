"""Multi-Latent Attention (DeepSeek-V2/V3) on the torch-native stack: checks, ``MLATransformerConfig`` fields and the
layer spec.

Megatron's ``MLASelfAttention`` builds the projections, latent norms and RoPE (so parameters, checkpoint names and
TP sharding are Megatron's); its core attention is our :class:`~lightning_megatron.kernels.attention.SDPAttention`,
which takes query/key heads of ``qk_head_dim + qk_pos_emb_head_dim`` and value heads of ``v_head_dim`` (Megatron's
local ``DotProductAttention`` assumes one head size). This module reads a config through :class:`MLARequest` (it
imports no config).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

from lightning_megatron.validation import check_choice, check_positive_int, divisors

__all__ = ["MLA_DEFAULTS", "MLARequest", "check_mla", "check_mla_parallel", "mla_fields", "with_mla_parts"]

ROPE_TYPES = ("rope", "yarn")

# The MLA-only fields and their defaults (Megatron's MLATransformerConfig's, but q_lora_rank: None there means a
# direct query projection, and a model without MLA must leave them all so).
MLA_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rope_type": "yarn",
    "rotary_scaling_factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}
# ModelConfig fields MLA does not read: Megatron would silently ignore them, so set they are refused.
_IGNORED_BY_MLA = {
    "num_query_groups": "MLA has one latent key/value per token, up-projected to every head",
    "kv_channels": "MLA's head sizes are qk_head_dim + qk_pos_emb_head_dim (query/key) and v_head_dim",
    "add_qkv_bias": "MLA's projections have no bias",
    "rope_scaling": "MLA rotates with rope_type 'rope' or 'yarn' (rotary_scaling_factor)",
    "seq_len_interpolation_factor": "MLA rotates with rope_type 'rope' or 'yarn' (rotary_scaling_factor)",
}


class MLARequest(Protocol):
    """The ``ModelConfig`` fields checked here."""

    multi_latent_attention: bool
    num_attention_heads: int
    num_query_groups: int | None
    kv_channels: int | None
    add_qkv_bias: bool
    rope_scaling: bool
    seq_len_interpolation_factor: float | None
    position_embedding_type: str
    rotary_base: int
    kernels: str
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_type: str
    rotary_scaling_factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


YARN_FIELDS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")  # fmt: skip


def check_mla(config: MLARequest) -> None:
    """Raise ``ValueError`` naming the field and its value for an MLA setting that cannot be built (or that a model
    without MLA would ignore)."""
    if not config.multi_latent_attention:
        # A GPT model's YaRN (position_embedding_type='yarn') reads MLA's YaRN fields too (lightning_megatron.gpt.yarn).
        shared = YARN_FIELDS if config.position_embedding_type == "yarn" else ()
        for name, default in MLA_DEFAULTS.items():
            if getattr(config, name) != default and name not in shared:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} is a Multi-Latent Attention setting, and "
                    f"multi_latent_attention=False; set multi_latent_attention=True or leave {name}={default!r}"
                )
        return
    for name in (
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "original_max_position_embeddings",
    ):
        check_positive_int(name, getattr(config, name))
    if config.q_lora_rank is not None:
        check_positive_int("q_lora_rank", config.q_lora_rank, " (or None: a direct query projection)")
    if config.qk_pos_emb_head_dim % 2:
        raise ValueError(f"qk_pos_emb_head_dim={config.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
    check_choice("rope_type", config.rope_type, ROPE_TYPES)
    for name in ("rotary_scaling_factor", "beta_fast", "beta_slow"):
        if getattr(config, name) <= 0:
            raise ValueError(f"{name}={getattr(config, name)} must be > 0")
    for name in ("mscale", "mscale_all_dim"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name}={getattr(config, name)} must be >= 0 (0 leaves the YaRN scale at 1)")
    if config.position_embedding_type != "rope":
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r} with multi_latent_attention=True: MLA "
            "always rotates its qk_pos_emb_head_dim slice; use position_embedding_type='rope'"
        )
    if config.kernels in ("local", "te"):
        raise ValueError(
            f"kernels={config.kernels!r} with multi_latent_attention=True: MLA's query/key and value head sizes "
            "differ, which only our torch-native core attention takes; use kernels='torch' or 'auto'"
        )
    for name, why in _IGNORED_BY_MLA.items():
        value = getattr(config, name)
        if value not in (None, False) and not (name == "num_query_groups" and value == config.num_attention_heads):
            raise ValueError(f"{name}={value!r} with multi_latent_attention=True: {why}; leave {name} at its default")


def check_mla_parallel(config: MLARequest, tp: int) -> None:
    """Raise ``ValueError`` for a tensor-parallel size MLA's down projections cannot be split by."""
    if not config.multi_latent_attention:
        return
    # The down projections are column-parallel linears whose outputs are gathered: each rank holds a slice.
    down = {"kv_lora_rank + qk_pos_emb_head_dim": config.kv_lora_rank + config.qk_pos_emb_head_dim}
    if config.q_lora_rank is not None:
        down["q_lora_rank"] = config.q_lora_rank
    for name, size in down.items():
        if size % tp:
            raise ValueError(f"{name}={size} must be divisible by tp={tp}; pick tp among {divisors(size)}")


def mla_fields(config: MLARequest) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of an MLA model (empty for a model without MLA)."""
    if not config.multi_latent_attention:
        return {}
    # MLA builds its RoPE from the transformer config's rotary_base (GPTModel's own argument does not reach it).
    fields = {name: getattr(config, name) for name in MLA_DEFAULTS}
    return {"multi_latent_attention": True, "rotary_base": config.rotary_base, **fields}


def with_mla_parts(spec: Any) -> Any:
    """Copy of a local MLA layer spec with our ``MLASelfAttention`` and Megatron's plain linears as the down
    projections: Megatron picks their sharding by the class itself (``in [ColumnParallelLinear, ...]``), which a
    fused-wgrad or fp8 subclass would fail; they are two small GEMMs of the layer."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from lightning_megatron.kernels.mla import TorchMLASelfAttention
    from lightning_megatron.kernels.norms import TorchNorm

    attention = spec.submodules.self_attention
    # Under sequence parallelism MLA scatters both latents back over the sequence before their norms (unlike the
    # per-head q/k norms of GQA, which see whole sequences): each rank's norm weights get a partial gradient, which
    # the `sequence_parallel` mark of a TorchNorm in the sequence-parallel region sums over TP.
    parts = dataclasses.replace(
        attention.submodules,
        linear_q_down_proj=ColumnParallelLinear,
        linear_kv_down_proj=ColumnParallelLinear,
        q_layernorm=sequence_parallel_norm(attention.submodules.q_layernorm, TorchNorm),
        kv_layernorm=sequence_parallel_norm(attention.submodules.kv_layernorm, TorchNorm),
    )
    attention = dataclasses.replace(attention, module=TorchMLASelfAttention, submodules=parts)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def sequence_parallel_norm(norm: Any, torch_norm: type) -> Any:
    """A latent norm of the spec as a :class:`TorchNorm` in the sequence-parallel region (``with_torch_norms``
    builds q/k norms outside it); anything else (``IdentityOp`` without ``qk_layernorm``) as it is."""
    is_torch_norm = norm is torch_norm or (isinstance(norm, functools.partial) and norm.func is torch_norm)
    return torch_norm if is_torch_norm else norm
