"""Megatron's column- and row-parallel linears beside a subclass with the same weights, for the kernel tests that
compare a replacement linear with Megatron's own (``test_fused_wgrad.py``, ``test_fp8.py``).

A helper module, not a test module: test modules import its names; it imports no test module.
"""

from __future__ import annotations

import torch

from lightning_megatron import tiny_gpt


def linear_pair(
    kind: str, bias: bool, classes: tuple[type, type], sizes: tuple[int, int]
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Megatron's column- or row-parallel linear and one of ``classes`` (column, row subclass) of ``sizes`` (in,
    out), with the same weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = tiny_gpt().to_transformer_config(params_dtype=torch.float32)
    base, subclass = (ColumnParallelLinear, classes[0]) if kind == "column" else (RowParallelLinear, classes[1])
    extra = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
    kwargs = dict(config=config, init_method=torch.nn.init.normal_, bias=bias, skip_bias_add=False, **extra)
    torch.manual_seed(0)
    reference, layer = base(*sizes, **kwargs), subclass(*sizes, **kwargs)
    layer.load_state_dict(reference.state_dict())
    return reference, layer
