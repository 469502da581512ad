"""LoRA adapters on MoE experts: one adapter per expert on each of its two projections.

The grouped expert linears (:mod:`lightning_megatron.kernels.experts`) hold all local experts in one ``[E, out, in]``
weight; their adapted versions add ``lora_A`` ``[E, r, in]`` and ``lora_B`` ``[E, out, r]`` and compute
``W_e x + (alpha / r) B_e A_e dropout(x)`` for each expert's rows, as two more grouped GEMMs (``[T, in] -> [T, r]
-> [T, out]``). As PEFT does on a Hugging Face model's fused expert tensors (``target_parameters`` on
``experts.gate_up_proj`` / ``experts.down_proj``), a SwiGLU expert's gate and up projections share one adapter:
``linear_fc1`` gets one adapter of ``2 x ffn`` output rows ([gate; up], the base's layout), ``linear_fc2`` one on
``down_proj``. The parameters are named after those projections (``lora_A.gate_up_proj``, ``lora_B.down_proj``).

Each expert-parallel rank holds its experts' adapters (the expert axis sharded like the base weight, reduced over
the expert-data-parallel group like it); checkpoints store them with the global expert axis, so they load at any EP
size. Expert tensor parallelism (``tp > 1`` with experts) is refused by :func:`~lightning_megatron.gpt.lora.config.
check_lora`. Each expert's A is drawn from the LoRA seed, its layer and its global expert index (B starts at zero),
so every layout builds the same adapters.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import Tensor, nn

from lightning_megatron.gpt.lora.config import LoRAConfig
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
        experts, out, n_in = self.weight.shape
        self.lora = lora
        factory = {"dtype": self.weight.dtype, "device": self.weight.device}
        a = nn.Parameter(torch.zeros(experts, lora.rank, n_in, **factory))
        b = nn.Parameter(torch.zeros(experts, out, lora.rank, **factory))
        for param in (a, b):
            param.is_adapter = True  # kept in adapter-only checkpoints even if frozen later
            param.allreduce = self.weight.allreduce  # expert parameters: reduced over the expert-DP group
        self.lora_A = nn.ParameterDict({self.part: a})
        self.lora_B = nn.ParameterDict({self.part: b})
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return get_pg_rank(self.pg_collection.ep) * self.num_local_experts

    def reset_adapter(self, seed: int) -> None:
        """Each expert's A from ``seed`` and its global expert index (Kaiming-uniform, as PEFT draws it); B zeros."""
        a, b = self.lora_A[self.part], self.lora_B[self.part]
        bound = 1.0 / math.sqrt(a.shape[2])
        with torch.no_grad():
            for e in range(a.shape[0]):
                generator = torch.Generator().manual_seed((seed * 1_000 + self.first_expert + e) % 2**63)
                draw = torch.empty(a.shape[1:], device=generator.device).uniform_(-bound, bound, generator=generator)
                a[e].copy_(draw)
            b.zero_()

    def delta_weight(self, expert: int | None = None) -> Tensor:
        """``scaling * B_e A_e`` per expert: ``[E, out, in]``, laid out like the base weight; of local expert
        ``expert`` alone (``[out, in]``) when given."""
        a, b = self.lora_A[self.part], self.lora_B[self.part]
        if expert is not None:
            return b[expert] @ a[expert] * self.lora.scaling
        return torch.bmm(b, a) * self.lora.scaling

    def expert_gemms(self, rows: Tensor, counts: tuple[int, ...], offs: Tensor | None) -> Tensor:
        out = self.grouped_linear(rows, self.weight, counts, offs)  # type: ignore[attr-defined]
        # The grouped kernel needs 16-byte rows: r a multiple of 8 in bf16; else the adapters loop over experts.
        adapter_offs = offs if self.lora.rank % 8 == 0 else None
        hidden = self.grouped_linear(self.lora_dropout(rows), self.lora_A[self.part], counts, adapter_offs)  # type: ignore[attr-defined]
        delta = self.grouped_linear(hidden, self.lora_B[self.part], counts, adapter_offs)  # type: ignore[attr-defined]
        return out + delta * self.lora.scaling

    def adapter_sharded_state_dict(self, prefix: str, sharded_offsets: tuple) -> dict[str, Any]:
        """The factors as sharded tensors with the global expert axis after the parents' axes (layers): one
        writer among the expert-data-parallel replicas."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep, expert_dp = self.pg_collection.ep, self.pg_collection.expt_dp
        expert_axis = (len(sharded_offsets), get_pg_rank(ep), get_pg_size(ep))
        state = {}
        for name, param in [*self.lora_A.items(), *self.lora_B.items()]:
            kind = "lora_A" if param is self.lora_A[name] else "lora_B"
            key = f"{prefix}{kind}.{name}"
            state[key] = ShardedTensor.from_rank_offsets(
                key, param, *sharded_offsets, expert_axis, replica_id=(0, 0, get_pg_rank(expert_dp)),
                prepend_axis_num=len(sharded_offsets),
            )  # fmt: skip
        return state


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
