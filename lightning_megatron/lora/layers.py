"""LoRA adapters on Megatron's tensor-parallel linears, sharded so that TP needs no gather of the base weights.

Column-parallel base (weight [out/tp, in]): A [r, in] replicated, B [out/tp, r] sharded like the base's rows, so the
adapter's output is sharded like the base's. Row-parallel base (weight [out, in/tp], input split over ``in``): A
[r, in/tp] sharded like the base's columns, its partial products summed over TP (an all-reduce of r values per
token), B [out, r] replicated. The base weights are frozen (Megatron's DDP then gives them no gradient buffer and
the optimizer no state).

Gradients of the replicated factors: column-parallel A gets its gradient from the rank's B shard only, so without
sequence parallelism the adapter's hidden gradient is all-reduced over TP before A (Megatron's
``copy_to_tensor_model_parallel_region``), making A's gradient and the input gradient whole on every rank; under
sequence parallelism the input gradient is reduce-scattered like the base's, and A is marked ``sequence_parallel``
so that Megatron's ``finalize_model_grads`` sums its gradient over TP (as for the norms). Row-parallel B sees the
same (all-gathered) output gradient on every rank.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from torch import Tensor, nn

from lightning_megatron.lora.config import TARGETS, LoRAConfig


def _kaiming_uniform(rows: int, cols: int, generator: torch.Generator) -> Tensor:
    """PEFT's (and nn.Linear's) init of lora_A: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(cols)
    return torch.empty(rows, cols).uniform_(-bound, bound, generator=generator)


class _Adapter:
    """What both adapted linears share: freezing the base, the factors, their seeded initialisation, and the
    checkpoint layout (the sharded factor saved as a slice of its full tensor, like the base weight)."""

    lora: LoRAConfig
    lora_A: nn.Parameter
    lora_B: nn.Parameter
    tp_axes: ClassVar[dict[str, int]]
    """Tensor-parallel axis of each sharded entry of the state dict (the rest is replicated)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        assert isinstance(self, nn.Module)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        dp_cp_group = (metadata or {})["dp_cp_group"]
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, self.tp_axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp_group
        )

    def _add_adapter(self, lora: LoRAConfig, a_shape: tuple[int, int], b_shape: tuple[int, int]) -> None:
        assert isinstance(self, nn.Module)
        for param in self.parameters(recurse=False):
            param.requires_grad_(False)
        self.lora = lora
        dtype, device = self.weight.dtype, self.weight.device
        self.lora_A = nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()

    def reset_adapter(self, seed: int, full_in: int, shard: slice) -> None:
        """A from the full [r, full_in] draw of ``seed``, cut to this rank's ``shard`` of ``in``; B zeros."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            full = _kaiming_uniform(self.lora.rank, full_in, generator)
            self.lora_A.copy_(full[:, shard])
            self.lora_B.zero_()


class LoRAColumnParallelLinear(_Adapter, ColumnParallelLinear):
    """``ColumnParallelLinear`` (frozen) plus a LoRA adapter: A replicated, B sharded like the base."""

    tp_axes: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0, "lora_B": 0}

    def __init__(self, *args: Any, lora: LoRAConfig, gated: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gated = gated  # a SwiGLU/GeGLU linear_fc1: each rank's rows are [gate shard; up shard]
        self._add_adapter(lora, (lora.rank, self.input_size), (self.output_size_per_partition, lora.rank))
        set_tensor_model_parallel_attributes(self.lora_B, is_parallel=True, dim=0, stride=1)
        if self.sequence_parallel:
            self.lora_A.sequence_parallel = True  # gradient summed over TP by finalize_model_grads

    def adapter_shard(self) -> slice:
        return slice(None)  # A is replicated

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.gated:  # B's rows are laid out like the base weight's: saved as Megatron saves that (gate, up)
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key, meta = f"{prefix}lora_B", metadata or {}
            state[key] = apply_swiglu_sharded_factory(
                state[key], sharded_offsets, meta.get("singleton_local_shards", False), tp_group=self.tp_group,
                dp_group=meta["dp_cp_group"],
            )  # fmt: skip
        return state

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None) -> Any:
        output, bias = super().forward(input_, weight, runtime_gather_output)
        x = input_
        if self.sequence_parallel:  # [S/tp, B, in] -> [S, B, in]; backward reduce-scatters (partial per rank)
            x = mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
        hidden = nn.functional.linear(self.lora_dropout(x), self.lora_A)  # [S, B, r]
        if not self.sequence_parallel:  # backward: the B shards' partial gradients summed over TP
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        delta = nn.functional.linear(hidden, self.lora_B) * self.lora.scaling  # [S, B, out/tp]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            delta = mappings.gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
        return output + delta, bias


class LoRARowParallelLinear(_Adapter, RowParallelLinear):
    """``RowParallelLinear`` (frozen) plus a LoRA adapter: A sharded like the base's input, B replicated."""

    tp_axes: ClassVar[dict[str, int]] = {"weight": 1, "lora_A": 1}

    def __init__(self, *args: Any, lora: LoRAConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_adapter(lora, (lora.rank, self.input_size_per_partition), (self.output_size, lora.rank))
        set_tensor_model_parallel_attributes(self.lora_A, is_parallel=True, dim=1, stride=1)

    def adapter_shard(self) -> slice:
        rank = self.tp_group.rank()
        return slice(rank * self.input_size_per_partition, (rank + 1) * self.input_size_per_partition)

    def forward(self, input_: Tensor) -> Any:
        output, bias = super().forward(input_)
        x = input_  # [S, B, in/tp] (the base's input is already split over in)
        hidden = nn.functional.linear(self.lora_dropout(x), self.lora_A)  # partial [S, B, r]
        hidden = mappings.reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
        delta = nn.functional.linear(hidden, self.lora_B) * self.lora.scaling  # [S, B, out]
        if self.sequence_parallel:  # the base's output is reduce-scattered over the sequence: keep our chunk
            delta = mappings.scatter_to_sequence_parallel_region(delta, group=self.tp_group)
        return output + delta, bias


def init_adapters(chunk: nn.Module, lora: LoRAConfig) -> None:
    """Freeze everything of a freshly built chunk but its adapters, and draw each adapter from a seed of
    (``lora.seed``, global layer number, linear), so that every layout builds the same adapters."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for param in chunk.parameters():
        param.requires_grad_(False)
    for layer in chunk.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        for name, module in layer.named_modules():
            if isinstance(module, _Adapter):
                leaf = name.rsplit(".", 1)[-1]
                seed = (lora.seed * 1_000_003 + layer.layer_number) * 10 + TARGETS.index(leaf)
                module.reset_adapter(seed, module.input_size, module.adapter_shard())
                module.lora_A.requires_grad_(True)
                module.lora_B.requires_grad_(True)
