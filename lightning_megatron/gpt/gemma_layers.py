"""The modules of Gemma's decoder layers that Megatron-Core 0.19's ``TransformerLayer`` lacks: a norm on the output
of self-attention and of the MLP before each residual add (HF's ``post_attention_layernorm`` /
``post_feedforward_layernorm``), as subclasses put into the layer spec (not a fork of the layer); and the scaling of
the embeddings by sqrt(hidden_size). Settings: :mod:`lightning_megatron.gpt.gemma`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from torch import Tensor, nn

from lightning_megatron.kernels.norms import TorchNorm


class PostNormSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` with ``post_layernorm`` on its output: the layer's residual add then takes
    ``norm(attention(x))``, as Gemma's layers do."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = TorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(*args, **kwargs)
        if bias is not None:  # a bias must be inside the norm; ModelConfig builds Gemma without biases
            output, bias = output + bias, None
        return self.post_layernorm(output), bias


class PostNormMLP(MLP):
    """Megatron's dense ``MLP`` with ``post_layernorm`` on its output (Gemma's ``post_feedforward_layernorm``)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = TorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(*args, **kwargs)
        if bias is not None:
            output, bias = output + bias, None
        return self.post_layernorm(output), bias


POST_NORM_MODULES: dict[type, type] = {SelfAttention: PostNormSelfAttention, MLP: PostNormMLP}
"""The classes :func:`~lightning_megatron.gpt.specs.replace_modules` swaps for a layer spec with post norms."""


def with_post_norm_mlp(spec: Any) -> Any:
    """Copy of a (dense, local/torch) layer spec, its classes already swapped (:data:`POST_NORM_MODULES`), whose
    MLP ends in a norm."""
    mlp = spec.submodules.mlp
    # Megatron's local spec names the dense MLP as a partial of the classmethod MLP.as_mlp_submodule, which builds
    # ``cls``: the same partial on our subclass builds it.
    if isinstance(mlp, functools.partial) and getattr(mlp.func, "__self__", None) is MLP:
        mlp = functools.partial(PostNormMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    return spec


def scale_embeddings(chunk: nn.Module) -> None:
    """Multiply the embedding output of a first-stage ``GPTModel`` chunk by sqrt(hidden_size), rounded to the
    embeddings' dtype first as Gemma does (8.0 stays 8.0; sqrt(2304) = 48 is exact in bf16 too, 53.4 is not)."""
    scale = chunk.config.hidden_size**0.5

    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        return output * torch.tensor(scale, dtype=output.dtype, device=output.device)

    chunk.embedding.register_forward_hook(hook)


def softcap_logits(chunk: nn.Module, cap: float) -> None:
    """``cap * tanh(logits / cap)`` on the output layer of a last-stage ``GPTModel`` chunk (Gemma 2's final logit
    soft-capping): elementwise, so each tensor-parallel rank caps its vocabulary shard, before the loss, the
    log-probs and the predictions read the logits."""

    def hook(module: nn.Module, args: Any, output: tuple[Tensor, Tensor | None]) -> tuple[Tensor, Tensor | None]:
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias

    chunk.output_layer.register_forward_hook(hook)
