"""Inputs shared by the MoE kernel tests (tests/test_grouped_experts.py, tests/test_permute.py): a one-layer MoE
TransformerConfig on Megatron's torch-native backend and a random top-k routing."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

COUNTS = [5, 0, 7, 3]  # uneven, one expert without tokens
HIDDEN, FFN = 32, 48


def moe_config(**overrides: Any) -> Any:
    """One MoE layer of ``len(COUNTS)`` SwiGLU experts (hidden HIDDEN, ffn FFN, top-2, float32); ``overrides``:
    TransformerConfig fields."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_megatron.gpt.transformer import LOCAL_BACKEND

    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_moe_experts=len(COUNTS), moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=torch.float32, moe_grouped_gemm=True,
    )  # fmt: skip
    return TransformerConfig(**{**LOCAL_BACKEND, **fields, **overrides})


def routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k routing map [tokens, experts] (bool) and its probabilities."""
    scores = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    top = scores.topk(k, dim=-1)
    probs = torch.zeros_like(scores).scatter(1, top.indices, top.values)
    return probs > 0, probs
