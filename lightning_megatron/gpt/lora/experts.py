"""LoRA adapters on MoE experts: one adapter per expert on each of its two projections.

The grouped expert linears (:mod:`lightning_megatron.kernels.experts`) hold all local experts in one ``[E, out, in]``
weight; their adapted versions add ``lora_A`` ``[E, r, in]`` and ``lora_B`` ``[E, out, r]`` and compute
``W_e x + (alpha / r) B_e A_e dropout(x)`` for each expert's rows, as two more grouped GEMMs (``[T, in] -> [T, r]
-> [T, out]``). As PEFT does on a Hugging Face model's fused expert tensors (``target_parameters`` on
``experts.gate_up_proj`` / ``experts.down_proj``), a SwiGLU expert's gate and up projections share one adapter:
``linear_fc1`` gets one adapter of ``2 x ffn`` output rows ([gate; up], the base's layout), ``linear_fc2`` one on
``down_proj``. The parameters are named after those projections (``lora_A.gate_up_proj``, ``lora_B.down_proj``).
Expert biases (GPT-OSS) get no adapter: they stay frozen and are added by the MLP as without LoRA.

Each expert-parallel rank holds its experts' adapters (the expert axis sharded like the base weight, reduced over
the expert-data-parallel group like it); checkpoints store them with the global expert axis, so they load at any EP
size. Each expert's A is drawn from the LoRA seed, its layer and its global expert index (B starts at zero), so every
layout builds the same adapters.

Under expert tensor parallelism (``tp > 1``, with sequence parallelism) the token dispatcher gives every rank of the
group the same tokens, and the factor on the base's split side is split like the base: fc1's B by output rows (a
SwiGLU rank's rows are [its gate rows; its up rows], as the base's), fc2's A by input columns. The other factor (fc1's
A, fc2's B) is whole on every rank and gets a partial gradient there (from the rank's share of the output or of the
input), so it is marked ``sequence_parallel``: Megatron's ``finalize_model_grads`` sums it over TP, as for the norms.
The adapters' forward needs no communication of its own: fc1's split output is the base's, and fc2's partial output
is summed over TP by the dispatcher with the base's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import Tensor, nn

from lightning_megatron.gpt.lora.config import LoRAConfig
from lightning_megatron.kernels.expert_counts import ExpertCounts
from lightning_megatron.kernels.experts import GroupedColumnLinear, GroupedRowLinear


class _ExpertAdapter:
    """What both adapted expert linears share (mixed into a grouped linear: ``weight`` is ``[E, out, in]``)."""

    part: str
    """The HF name of the adapted projection: ``gate_up_proj`` (fc1) or ``down_proj`` (fc2)."""
    lora: LoRAConfig
    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict
    weight: nn.Parameter
    pg_collection: Any
    num_local_experts: int

    def _add_adapters(self, lora: LoRAConfig) -> None:
        self.weight.requires_grad_(False)
        experts, out, n_in = self.weight.shape  # this rank's shard: out / tp (fc1) or in / tp (fc2)
        self.lora = lora
        factory = {"dtype": self.weight.dtype, "device": self.weight.device}
        a = nn.Parameter(torch.zeros(experts, lora.rank, n_in, **factory))
        b = nn.Parameter(torch.zeros(experts, out, lora.rank, **factory))
        for param in (a, b):
            param.is_adapter = True  # kept in adapter-only checkpoints even if frozen later
            param.allreduce = self.weight.allreduce  # expert parameters: reduced over the expert-DP group
        split, whole = (b, a) if self.tp_axis == 0 else (a, b)
        set_tensor_model_parallel_attributes(split, is_parallel=True, dim=1 + self.tp_axis, stride=1)
        if get_pg_size(self.tp_group) > 1:
            whole.sequence_parallel = True  # partial gradients on each rank: summed over TP by finalize_model_grads
        self.lora_A = nn.ParameterDict({self.part: a})
        self.lora_B = nn.ParameterDict({self.part: b})
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return get_pg_rank(self.pg_collection.ep) * self.num_local_experts

    def reset_adapter(self, seed: int) -> None:
        """Each expert's A from ``seed`` and its global expert index (Kaiming-uniform over the full input, as PEFT
        draws it; this rank's columns of it under TP); B zeros."""
        a, b = self.lora_A[self.part], self.lora_B[self.part]
        tp = get_pg_size(self.tp_group) if self.tp_axis == 1 else 1  # fc2's A is split over TP
        n_in = a.shape[2] * tp
        bound = 1.0 / math.sqrt(n_in)
        with torch.no_grad():
            for e in range(a.shape[0]):
                generator = torch.Generator().manual_seed((seed * 1_000 + self.first_expert + e) % 2**63)
                draw = torch.empty(a.shape[1], n_in, device=generator.device).uniform_(
                    -bound, bound, generator=generator
                )
                a[e].copy_(draw.chunk(tp, dim=1)[get_pg_rank(self.tp_group) if tp > 1 else 0])
            b.zero_()

    def delta_weight(self, expert: int | None = None) -> Tensor:
        """``scaling * B_e A_e`` per expert: ``[E, out, in]``, laid out like the base weight; of local expert
        ``expert`` alone (``[out, in]``) when given."""
        a, b = self.lora_A[self.part], self.lora_B[self.part]
        if expert is not None:
            return b[expert] @ a[expert] * self.lora.scaling
        return torch.bmm(b, a) * self.lora.scaling

    def expert_gemms(self, rows: Tensor, counts: ExpertCounts, grouped: bool) -> Tensor:
        out = self.grouped_linear(rows, self.weight, counts, grouped)  # type: ignore[attr-defined]
        # The grouped kernel needs 16-byte rows: r a multiple of 8 in bf16; else the adapters loop over experts.
        adapter_grouped = grouped and self.lora.rank % 8 == 0
        hidden = self.grouped_linear(self.lora_dropout(rows), self.lora_A[self.part], counts, adapter_grouped)  # type: ignore[attr-defined]
        delta = self.grouped_linear(hidden, self.lora_B[self.part], counts, adapter_grouped)  # type: ignore[attr-defined]
        return out + delta * self.lora.scaling

    def adapter_sharded_state_dict(self, prefix: str, sharded_offsets: tuple) -> dict[str, Any]:
        """The factors as sharded tensors of their full shape, the global expert axis after the parents' axes
        (layers); one writer among the expert-data-parallel replicas."""
        keys = {
            f"{prefix}{kind}.{self.part}": factors[self.part]
            for kind, factors in [("lora_A", self.lora_A), ("lora_B", self.lora_B)]
        }
        return {key: self._factor_state(key, param, sharded_offsets) for key, param in keys.items()}

    def _factor_state(self, key: str, param: Tensor, sharded_offsets: tuple) -> Any:
        """One factor's sharded state: the split factor as this rank's slice of it (a SwiGLU fc1's B: its gate rows
        and its up rows, through a factory), the whole one written by expert-TP rank 0."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        tp_rank, tp = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        ep, expert_dp_rank = self.pg_collection.ep, get_pg_rank(self.pg_collection.expt_dp)
        axes = len(sharded_offsets)
        split = tp > 1 and getattr(param, "tensor_model_parallel", False)
        axis = axes + 1 + self.tp_axis  # fc1's B: its output rows; fc2's A: its input columns

        def shard(key: str, data: Tensor, *tp_offsets: tuple) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                key, data, *sharded_offsets, (axes, get_pg_rank(ep), get_pg_size(ep)), *tp_offsets,
                replica_id=(0, 0 if split else tp_rank, expert_dp_rank), prepend_axis_num=axes,
            )  # fmt: skip

        if not split:
            return shard(key, param)
        if self.tp_axis == 1 or not self.config.gated_linear_unit:
            return shard(key, param, (axis, tp_rank, tp))

        def halves(key: str, data: Tensor, replica_id: Any, flattened_range: Any) -> list[ShardedTensor]:
            # [gate rows; up rows] of this rank: chunks tp_rank and tp + tp_rank of the 2 x tp chunks of the rows
            gate, up = (half.contiguous() for half in data.chunk(2, dim=1))
            return [shard(key, gate, (axis, tp_rank, 2 * tp)), shard(key, up, (axis, tp + tp_rank, 2 * tp))]

        return ShardedTensorFactory(key, param, halves, lambda pieces: torch.cat(pieces, dim=1), (0, 0, expert_dp_rank))


class LoRAGroupedColumnLinear(_ExpertAdapter, GroupedColumnLinear):
    """The experts' ``linear_fc1`` (frozen) with one adapter per expert on its whole output (gate and up)."""

    def __init__(self, *args: Any, lora: LoRAConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.part = "gate_up_proj" if self.config.gated_linear_unit else "up_proj"
        self._add_adapters(lora)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {**state, **self.adapter_sharded_state_dict(prefix, sharded_offsets)}


class LoRAGroupedRowLinear(_ExpertAdapter, GroupedRowLinear):
    """The experts' ``linear_fc2`` (frozen) with one adapter per expert (``down_proj``)."""

    def __init__(self, *args: Any, lora: LoRAConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.part = "down_proj"
        self._add_adapters(lora)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {**state, **self.adapter_sharded_state_dict(prefix, sharded_offsets)}


def is_expert_adapter(module: nn.Module) -> bool:
    return isinstance(module, _ExpertAdapter)
