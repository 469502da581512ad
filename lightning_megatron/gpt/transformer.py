"""The ``TransformerConfig`` fields that select Megatron's torch-native implementations, and those that switch on a
resolved kernel set's fused paths. A leaf of the GPT package: ``ModelConfig.to_transformer_config`` reads it."""

from __future__ import annotations

import importlib.util
from typing import Any

from megatron.core.transformer.enums import AttnBackend

from lightning_megatron.gpt.plan import Resolved

# We build with Megatron's torch-native "local" spec (no Transformer Engine / apex, also on CPU): select the local
# implementations and turn off every fused path that needs TE or apex kernels. Defaults only: kernel_fields and the
# strategy's parallel fields may override them.
LOCAL_BACKEND: dict[str, Any] = {
    "transformer_impl": "local",
    "attention_backend": AttnBackend.local,
    "apply_rope_fusion": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
    "moe_grouped_gemm": False,
    # Megatron's default "full" means the same as None/[] but warns on every TransformerConfig.
    "cuda_graph_modules": None,
}


def kernel_fields(
    kernels: Resolved, compile_fusions: bool, *, rope: bool, activation_fusable: bool, mla_yarn: bool = False
) -> dict[str, Any]:
    """``TransformerConfig`` fields that switch on a kernel set's fused paths (on top of :data:`LOCAL_BACKEND`).

    ``compile_fusions`` turns on Megatron's torch.compile'd activation and bias-dropout-add fusions with
    ``'torch'`` (on GPU; on CPU compiling costs more than it saves), and for Multi-Latent Attention with YaRN RoPE
    where its kernels fit (``mla_yarn``: :func:`fused_mla_rope_fits`) Megatron's fused MLA RoPE: Triton
    kernels of megatron-core itself (no Transformer Engine) that rotate the query's and the shared key's RoPE slices
    and assemble the query, key and value heads in one pass each, in place of the elementwise, split and
    concatenation kernels of its unfused path.
    """
    if kernels == "te":
        return {
            "transformer_impl": "transformer_engine", "attention_backend": AttnBackend.auto,
            "apply_rope_fusion": rope, "bias_dropout_fusion": True,
            "bias_activation_fusion": activation_fusable,
            # The output layer is Megatron's own ColumnParallelLinear, whose fused wgrad needs apex's extension.
            "gradient_accumulation_fusion": importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        }  # fmt: skip
    if kernels == "torch" and compile_fusions:
        # Megatron's jit_fuser is torch.compile: these fusions need no TE/apex kernels.
        return {
            "bias_activation_fusion": activation_fusable,
            "bias_dropout_fusion": True,
            "apply_rope_fusion": mla_yarn,
        }
    return {}


def fused_mla_rope_fits(config: Any, cp: int) -> bool:
    """Whether Megatron's fused MLA RoPE kernels run ``config``'s attention (a ``ModelConfig``) at context-parallel
    size ``cp``: Multi-Latent Attention with YaRN RoPE; head sizes their Triton ranges take (powers of two for the
    query/key and value head sizes and half the RoPE slice, which must be a multiple of 4: DeepSeek-V3's 128, 128 and
    64 are); and ``cp == 1``. Under CP, Megatron-Core 0.19 caches the cos/sin table of a rank's chunks for the
    longest length seen and the kernels read it at each token's local place, so a shorter batch afterwards
    (validation, a token budget) would be rotated with another length's positions; the unfused path computes the
    table per length."""
    if not config.multi_latent_attention or config.rope_type != "yarn" or cp != 1:
        return False
    sizes = (config.qk_head_dim, config.v_head_dim, config.qk_pos_emb_head_dim // 2)
    return all(n > 0 and n & (n - 1) == 0 for n in sizes) and config.qk_pos_emb_head_dim % 4 == 0
