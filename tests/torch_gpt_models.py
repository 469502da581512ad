"""A bare Megatron GPTModel of a ModelConfig on the torch-native kernels, for tests of the layers outside a Trainer
(tests/test_mla.py, tests/test_attention_variants.py)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.gpt import specs


def torch_gpt(config: Any, compile_fusions: bool = False) -> torch.nn.Module:
    """``config``'s GPTModel in float32 with the ``'torch'`` kernels (``compile_fusions``: the GPU's fused paths,
    Megatron's fused MLA RoPE among them)."""
    from megatron.core.models.gpt import GPTModel

    tc = config.to_transformer_config(kernels="torch", compile_fusions=compile_fusions, params_dtype=torch.float32)
    spec = specs.block_spec(config, tc, None, "torch")
    return GPTModel(config=tc, transformer_layer_spec=spec, **config.gpt_model_kwargs("torch"))
