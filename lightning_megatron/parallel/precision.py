"""Lightning's precision argument -> Megatron's mixed precision (Float16Module, fp32 main weights, no autocast)."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import Float16Module
from torch import nn

PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def lightning_precision(plugin: Any) -> str:
    """Lightning's precision name, if this strategy maps it onto Megatron's mixed precision."""
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision not in PRECISIONS:
        fp8 = " fp8 needs Transformer Engine's spec and recipes, which this strategy does not drive yet." * (
            "transformer-engine" in precision or "8" in precision
        )
        raise ValueError(
            f"Trainer(precision={precision!r}) is not supported by MegatronStrategy; use one of {list(PRECISIONS)}: "
            "'bf16-mixed'/'16-mixed' keep bf16/fp16 weights and activations with fp32 main weights, gradients "
            "reduced in fp32 (Megatron's own mixed precision, no autocast; fp16 with dynamic loss scaling)." + fp8
        )
    return precision


def megatron_dtype_fields(dtype: torch.dtype) -> dict[str, Any]:
    """The dtype fields that Megatron's model-parallel config and its optimizer config share."""
    return {"bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16, "params_dtype": dtype}


def wrap(chunks: list[nn.Module], dtype: torch.dtype) -> list[nn.Module]:
    """Megatron's Float16Module around each chunk for bf16/fp16: casts the weights and the first stage's inputs.

    The last stage's output stays in the compute dtype (``fp32_output=False``): loss functions upcast where they
    need to -- the fused cross entropy only inside its kernels -- instead of a float32 copy of all the logits.
    The optimizer keeps fp32 main weights.
    """
    if dtype == torch.float32:
        return chunks
    return [HalfModule(chunk.config, chunk) for chunk in chunks]


class HalfModule(Float16Module):
    """Megatron's ``Float16Module`` whose last-stage output stays in bf16/fp16 (see :func:`wrap`)."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return super().forward(*inputs, fp32_output=False, **kwargs)
