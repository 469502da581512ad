"""The MoE experts module: Megatron's ``TEGroupedMLP`` over the grouped linears of :mod:`.experts`, whose forward
does not wait for the host to know the token counts.

``TEGroupedMLP.forward`` starts with ``tokens_per_expert.tolist()``: on a GPU, one host synchronisation per MoE
layer and micro-batch, which leaves the GPU idle while the host launches what follows. The grouped GEMMs read the
counts on the device, so :class:`GroupedMLP` hands its linears an :class:`ExpertCounts` instead: their forward
uses device offsets, and the host copy of the counts, queued with them, is read in the backward (the fp32
weight-gradient loop into ``main_grad``) or by the per-expert loop where that runs. Settings outside the plain
path (activation recompute or offloading, interleaved or non-SwiGLU fused activations) run Megatron's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.utils import get_pg_rank
from torch import Tensor

from lightning_megatron.compat import megatron_internals
from lightning_megatron.kernels.expert_counts import ExpertCounts
from lightning_megatron.kernels.experts import (
    FusedWgradGroupedColumnLinear,
    FusedWgradGroupedRowLinear,
    GroupedColumnLinear,
    GroupedRowLinear,
)

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["GroupedMLP", "grouped_mlp_spec"]


class GroupedMLP(TEGroupedMLP):
    """``TEGroupedMLP`` whose plain path passes the token counts to its linears as :class:`ExpertCounts` (see
    the module docstring). The same parameters, checkpoints and numbers as ``TEGroupedMLP``."""

    def forward(  # type: ignore[override]
        self,
        permuted_local_hidden_states: Tensor,
        tokens_per_expert: ExpertCounts | Tensor,
        permuted_probs: Tensor,
        output_buffer: Tensor | None = None,
        grad_input_buffer: Tensor | None = None,
    ) -> tuple[Tensor, None]:
        """The local experts on their rows (sorted by expert), each row's output scaled by its router probability."""
        counts = tokens_per_expert if isinstance(tokens_per_expert, ExpertCounts) else ExpertCounts(tokens_per_expert)
        biased = self.linear_fc1.bias is not None
        if not self.plain_path() or output_buffer is not None or grad_input_buffer is not None:
            if biased:  # Megatron's forward expects TE's per-expert bias lists, which these linears do not return
                raise ValueError("MoE experts with biases (add_bias_linear=True) run only the plain path: " + PLAIN)
            return super().forward(
                permuted_local_hidden_states, counts.tensor(), permuted_probs, output_buffer, grad_input_buffer
            )
        probs = permuted_probs.unsqueeze(-1)
        hidden, _ = self.linear_fc1(permuted_local_hidden_states, counts)
        expert = _row_experts(counts, hidden.shape[0], hidden.device) if biased else None
        if expert is not None:
            hidden = hidden + self.linear_fc1.bias[expert]
        output, _ = self.linear_fc2(self.activation(hidden, probs), counts)
        if expert is not None:  # p * (fc2(x) + b), as TEGroupedMLP: the probability already scaled fc2's input
            output = (output + self._output_bias(expert, probs)).to(output.dtype)
        return output, None

    def _output_bias(self, expert: Tensor, probs: Tensor) -> Tensor:
        """``p * b`` of fc2's bias per row. Under expert TP fc2's output is each rank's partial sum, which the token
        dispatcher adds up over the ranks: the bias joins expert-TP rank 0's only (once, as one process adds it). The
        other ranks add zeros that still carry the bias's gradient (each rank has every row and its output gradient,
        gathered over expert TP, so all compute rank 0's gradient and their copies stay equal), and no gradient to
        the probabilities (rank 0's reaches them, summed over the ranks by the dispatcher's gather)."""
        bias = self.linear_fc2.bias[expert]
        if get_pg_rank(self.linear_fc2.tp_group) == 0:
            return bias * probs
        term = bias * probs.detach()
        return term - term.detach()

    def plain_path(self) -> bool:
        """Whether :meth:`activation` covers this configuration (else Megatron's forward runs, waiting for the
        counts): no activation recompute or offloading, no fused TE ops, no quantization padding, probabilities
        applied after the activation, no interleaved GLU, a fused activation only for SwiGLU."""
        config = self.config
        fused = config.bias_activation_fusion or config.use_fused_weighted_squared_relu
        swiglu = config.gated_linear_unit and config.activation_func is F.silu
        return not (
            self.activation_recompute
            or self.offload_expert_fc1
            or self.offload_moe_act
            or megatron_internals.experts_use_fused_ops(self)
            or config.fp8
            or config.fp4
            or config.use_te_activation_func
            or config.moe_apply_probs_on_input
            or config.moe_paged_stash
            or (config.gated_linear_unit and config.moe_mlp_glu_interleave_size is not None)
            or (fused and not (swiglu and config.bias_activation_fusion))
        )

    def activation(self, hidden: Tensor, probs: Tensor) -> Tensor:
        """fc1's output through the activation, times each row's probability (``probs``: ``[rows, 1]``), in the
        order and dtypes of ``TEGroupedMLP``'s unfused path (or its fused weighted SwiGLU)."""
        config = self.config
        if config.bias_activation_fusion:  # SwiGLU, by plain_path
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(hidden, None, probs, config.activation_func_fp8_input_store)
        if config.gated_linear_unit:
            gate, linear = torch.chunk(hidden, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
            hidden = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            hidden = self.activation_func(hidden)
        return (hidden * probs).to(hidden.dtype)


PLAIN = (
    "no activation recompute or offloading, no fp8/fp4, moe_apply_probs_on_input=False, no interleaved GLU and no "
    "fused activation but SwiGLU's"
)


def _row_experts(counts: ExpertCounts, rows: int, device: torch.device) -> Tensor:
    """The local expert of each row (rows sorted by expert), for indexing the experts' biases."""
    experts = torch.arange(len(counts), device=device)
    return torch.repeat_interleave(experts, counts.tensor().to(device), output_size=rows)


def grouped_mlp_spec(fuse_wgrad: bool = False) -> ModuleSpec:
    """The MoE experts as :class:`GroupedMLP` over the grouped linears of :mod:`.experts` (no Transformer Engine).

    ``config.moe_grouped_gemm`` picks the grouped kernels (True, where
    :func:`~lightning_megatron.kernels.experts.grouped_mm_available`) or the per-expert loop (False); Megatron
    itself needs it True only for ``recompute_modules=["moe_act"]``. ``fuse_wgrad``: the linears accumulate their
    weight gradients straight into ``main_grad`` (as ``layer_spec(fuse_wgrad=True)``'s dense linears do).
    """
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    column, row = (
        (FusedWgradGroupedColumnLinear, FusedWgradGroupedRowLinear)
        if fuse_wgrad
        else (GroupedColumnLinear, GroupedRowLinear)
    )
    return ModuleSpec(module=GroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=column, linear_fc2=row))
