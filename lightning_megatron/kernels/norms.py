"""A torch-native norm that Megatron's local (no Transformer Engine / apex) spec lacks: one that works under SP."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class TorchNorm:
    """Megatron's ``WrappedTorchNorm`` (torch ``LayerNorm``/``RMSNorm``) that also works with sequence parallelism.

    Under sequence parallelism each tensor-parallel rank normalises its own slice of the sequence, so the norm's
    weight gets a partial gradient per rank; marking the parameters ``sequence_parallel`` makes Megatron's
    ``finalize_model_grads`` all-reduce them over the tensor-parallel group (what apex/TE norms do). Query/key
    norms act on full sequences of local heads and are built with ``sequence_parallel_region=False``.
    """

    def __new__(  # a factory, like WrappedTorchNorm: returns the torch module itself
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel_region: bool = True,
        **unused: Any,
    ) -> nn.Module:
        if getattr(config, "layernorm_zero_centered_gamma", False):  # RMSNorm only (ModelConfig checks)
            norm: nn.Module = ZeroCenteredRMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            norm_cls = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}[config.normalization]
            norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel and sequence_parallel_region)
        return norm


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with the gain stored as ``w`` and applied as ``1 + w`` (Megatron's ``layernorm_zero_centered_gamma``;
    Gemma's RMSNorm, whose checkpoints store ``w``), computed in float32 and cast back as Gemma computes it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))  # zeros: the identity gain

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
