"""A bare Megatron GPTModel of a ModelConfig on the torch-native kernels, for tests of the layers outside a Trainer
(tests/test_mla.py, tests/test_attention_variants.py), and the packed-row check they share."""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.gpt import specs
from lightning_megatron.kernels.documents import SequenceLayout


def torch_gpt(config: Any, compile_fusions: bool = False) -> torch.nn.Module:
    """``config``'s GPTModel in float32 with the ``'torch'`` kernels (``compile_fusions``: the GPU's fused paths,
    Megatron's fused MLA RoPE among them)."""
    from megatron.core.models.gpt import GPTModel

    tc = config.to_transformer_config(kernels="torch", compile_fusions=compile_fusions, params_dtype=torch.float32)
    spec = specs.block_spec(config, tc, None, "torch")
    return GPTModel(config=tc, transformer_layer_spec=spec, **config.gpt_model_kwargs("torch"))


def assert_packed_row_is_its_documents(model: torch.nn.Module, lengths: tuple[int, ...] = (5, 7, 4)) -> None:
    """One row packing documents of ``lengths`` tokens gives each document's logits alone (attention stays inside a
    document, RoPE at positions within it)."""
    tokens = torch.randint(0, 256, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    documents = (positions == 0).cumsum(1, dtype=torch.int32)
    layout = SequenceLayout(positions=positions, documents=documents, seq_length=tokens.shape[1])
    with torch.no_grad():
        packed = model(tokens, positions, None, packed_seq_params=layout)
        alone = [model(part, torch.arange(part.shape[1])[None], None) for part in tokens.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-4, atol=1e-5)
