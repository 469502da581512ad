"""Megatron layer specs for a resolved kernel set, and the ``TransformerConfig`` fields each set needs.

``'local'``: Megatron's torch-native spec with norms that support sequence parallelism; ``'torch'``: the same with
:class:`~lightning_megatron.kernels.attention.SDPAttention` as core attention (RoPE inside it) and, on GPU,
Megatron's torch.compile'd activation and bias-dropout-add fusions; ``'te'``: Megatron's Transformer Engine spec.
All build the same parameters under the same names, hence the same checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from lightning_megatron.gpt.mla import with_mla_parts
from lightning_megatron.gpt.moe.specs import with_moe_parts
from lightning_megatron.gpt.plan import Resolved
from lightning_megatron.kernels.attention import Rotary, SDPAttention
from lightning_megatron.kernels.norms import TorchNorm

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_megatron.gpt.config import ModelConfig
    from lightning_megatron.gpt.lora.config import LoRAConfig


def layer_spec(
    config: ModelConfig,
    kernels: Resolved = "local",
    fuse_wgrad: bool = False,
    fp8: bool = False,
    lora: LoRAConfig | None = None,
    moe: bool | None = None,
) -> ModuleSpec:
    """The GPT layer spec of ``config`` for a resolved kernel set (see the module docstring).

    ``fuse_wgrad`` builds the parallel linears as :mod:`lightning_megatron.kernels.linear`'s subclasses, whose
    weight gradients accumulate straight into ``main_grad`` (``'torch'``/``'local'`` only); ``fp8`` builds them as
    the subclasses whose GEMMs run in fp8, in ``config.fp8``'s format; ``lora`` puts adapters on its target
    linears (which stay unfused). ``moe``: an MoE layer (:func:`~lightning_megatron.gpt.moe.specs.with_moe_parts`) or
    a dense one; None: MoE iff the model has experts.
    """
    experts = config.num_moe_experts if (moe is None or moe) else None
    if kernels == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm
        )
        return spec if experts is None else with_moe_parts(spec)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
        multi_latent_attention=config.multi_latent_attention,
    )
    spec = with_torch_norms(spec if experts is None else with_moe_parts(spec, fuse_wgrad))
    if config.post_sublayer_norms:
        from lightning_megatron.gpt.gemma_layers import POST_NORM_MODULES, with_post_norm_mlp

        spec = with_post_norm_mlp(replace_modules(spec, POST_NORM_MODULES))
    if kernels == "torch":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        spec = replace_modules(spec, {DotProductAttention: sdp_attention(config)})
    if fp8 and config.fp8 is None:
        raise ValueError("layer_spec(fp8=True) builds the linears of config.fp8's format, and config.fp8 is None")
    if fuse_wgrad or fp8:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        from lightning_megatron.kernels import linear

        column, row = (
            linear.FP8_LINEARS[config.fp8]
            if fp8
            else (linear.FusedWgradColumnParallelLinear, linear.FusedWgradRowParallelLinear)
        )
        spec = replace_modules(spec, {ColumnParallelLinear: column, RowParallelLinear: row})
    if config.multi_latent_attention:
        spec = with_mla_parts(spec)
    if lora is not None:
        spec = with_adapters(spec, lora, config)
    return spec


def sdp_attention(config: ModelConfig) -> Any:
    """The core attention of the ``'torch'`` kernels: :class:`SDPAttention`, with RoPE inside it for a rope model
    (not with MLA, which rotates its RoPE slice itself; the sliding-window layers with ``local_rotary_base``'s
    unscaled RoPE when set) and the soft-cap of ``attn_logit_softcapping``."""
    extra: dict[str, Any] = {}
    if config.attn_logit_softcapping is not None:  # no TransformerConfig field: an argument of our module
        extra["softcap"] = config.attn_logit_softcapping
    if config.position_embedding_type == "rope" and not config.multi_latent_attention:
        extra["rotary"] = Rotary(
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
            rope_scaling=config.rope_scaling,
            rope_scaling_factor=config.rope_scaling_factor,
            seq_len_interpolation_factor=config.seq_len_interpolation_factor,
        )
        if config.local_rotary_base is not None:
            extra["local_rotary"] = Rotary(rotary_percent=config.rotary_percent, rotary_base=config.local_rotary_base)
    return functools.partial(SDPAttention, **extra) if extra else SDPAttention


def with_adapters(spec: Any, lora: LoRAConfig, config: ModelConfig) -> Any:
    """Copy of a layer spec whose ``lora.target_modules`` linears are LoRA-adapted (lightning_megatron.gpt.lora)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from lightning_megatron.gpt.lora.config import adapter_parts, is_column, layer_linears
    from lightning_megatron.gpt.lora.experts import LoRAGroupedColumnLinear, LoRAGroupedRowLinear
    from lightning_megatron.gpt.lora.layers import LoRAColumnParallelLinear, LoRARowParallelLinear
    from lightning_megatron.kernels.experts import GroupedColumnLinear, GroupedRowLinear

    linears = layer_linears(config)  # an MLA spec also names the query projection it does not build: skipped

    def swap(value: Any, name: str) -> Any:
        adapted_already = value in (LoRAColumnParallelLinear, LoRARowParallelLinear)  # the new spec's own module
        if name not in linears or not lora.adapts(name) or not isinstance(value, type) or adapted_already:
            return value
        if issubclass(value, GroupedColumnLinear | GroupedRowLinear):  # MoE experts: called as a builder
            adapted = LoRAGroupedColumnLinear if issubclass(value, GroupedColumnLinear) else LoRAGroupedRowLinear
            return functools.partial(adapted, lora=lora)
        parts = adapter_parts(name, config)
        if not is_column(name):
            return ModuleSpec(module=LoRARowParallelLinear, params={"lora": lora, "part": parts[0][0]})
        # linear_fc1's gate/up halves: sized from the base (a dense layer's or a shared expert's hidden size); an MLA
        # projection's one part: the whole base
        sizes = [out if name == "linear_qkv" else None for _, _, out in parts]
        params = {
            "lora": lora,
            "parts": tuple((part, size) for (part, _, _), size in zip(parts, sizes, strict=True)),
            "query_groups": config.effective_num_query_groups if name == "linear_qkv" else None,
            "adapted": tuple(part for part, _, _ in lora.adapted_parts(name, config)),
        }
        return ModuleSpec(module=LoRAColumnParallelLinear, params=params)

    return _map_spec(spec, swap)


def block_spec(
    config: ModelConfig,
    transformer_config: TransformerConfig,
    vp_stage: int | None,
    kernels: Resolved = "local",
    fuse_wgrad: bool = False,
    fp8: bool = False,
    lora: LoRAConfig | None = None,
) -> TransformerBlockSubmodules:
    """The decoder layers of one pipeline stage / VPP chunk -- dense or MoE as ``config.moe_layers`` says for their
    global indices -- and a final norm that supports SP."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    num_layers = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage)
    kinds = config.moe_layers[offset : offset + num_layers]
    built = {moe: layer_spec(config, kernels, fuse_wgrad, fp8, lora, moe=moe) for moe in set(kinds)}
    final_norm: Any = TorchNorm
    if kernels == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    return TransformerBlockSubmodules(layer_specs=[built[moe] for moe in kinds], layer_norm=final_norm)


def with_torch_norms(spec: Any) -> Any:
    """Copy of a Megatron layer spec with every ``WrappedTorchNorm`` replaced by :class:`TorchNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(value: Any, name: str) -> Any:
        if value is not WrappedTorchNorm:
            return value
        qk = name in ("q_layernorm", "k_layernorm", "kv_layernorm")
        return functools.partial(TorchNorm, sequence_parallel_region=False) if qk else TorchNorm

    return _map_spec(spec, swap)


def replace_modules(spec: Any, mapping: dict[type, Any]) -> Any:
    """Copy of a Megatron layer spec with the module classes in ``mapping`` replaced."""
    return _map_spec(spec, lambda value, name: mapping.get(value, value) if isinstance(value, type) else value)


def _map_spec(spec: Any, fn: Any) -> Any:
    """Apply ``fn(value, field_name)`` to every module class of a spec tree (ModuleSpecs, partials, submodule
    dataclasses)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def swap(value: Any, name: str) -> Any:
        value = fn(value, name)
        if isinstance(value, ModuleSpec):
            return dataclasses.replace(value, module=fn(value.module, name), submodules=swap(value.submodules, name))
        if isinstance(value, functools.partial):  # Megatron spells the MLP and MoE specs as partials
            args = [swap(arg, name) for arg in value.args]
            return functools.partial(value.func, *args, **{k: swap(v, k) for k, v in value.keywords.items()})
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value, **{f.name: swap(getattr(value, f.name), f.name) for f in dataclasses.fields(value) if f.init}
            )
        return value

    return swap(spec, "")
