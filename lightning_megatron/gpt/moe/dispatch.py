"""Megatron's MoE layer whose all-gather token dispatcher does not stop the GPU's queue.

Megatron's ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` copies the per-expert token counts to the host
(``.cpu()``) and then selects the routed probabilities with ``masked_select``: two host synchronisations in every
MoE layer and micro-batch, each waiting until the GPU has run everything queued and leaving it idle while the host
launches what follows. When every expert is on this rank (``ep=1``, the strategy's all-gather dispatcher) and every
token has exactly ``k`` experts (dropless top-k, the only routing the strategy builds), the permuted rows number
``tokens x k`` whatever the counts are. :class:`QueuedCountsDispatcher` therefore hands the experts the counts as
an :class:`~lightning_megatron.kernels.expert_counts.ExpertCounts` (their host copy queued, not waited for) and
permutes the probabilities with the rows (:func:`lightning_megatron.kernels.permute.permute`: no
``masked_select``). The experts (:class:`~lightning_megatron.kernels.expert_mlp.GroupedMLP`) read the counts on the
device in the forward and on the host in the backward. Same rows, counts and probabilities as Megatron's
dispatcher (tests/test_permute.py).
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from torch import Tensor

from lightning_megatron.kernels import permute
from lightning_megatron.kernels.expert_counts import ExpertCounts
from lightning_megatron.kernels.expert_mlp import GroupedMLP

__all__ = ["QueuedCountsDispatcher", "QueuedCountsMoELayer"]


class QueuedCountsDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's all-gather dispatcher for a layer holding all experts, its permutation queued before the host
    waits for the token counts (see the module docstring). Tensor-parallel gathering and combining are Megatron's."""

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor) -> tuple[Tensor, Any, Tensor]:
        """``(rows sorted by expert, tokens per expert as ExpertCounts, the rows' probabilities)``: Megatron's
        values, without a host synchronisation."""
        if hidden_states.shape[0] == 0:  # no tokens: Megatron's path (the permutation here divides by them)
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        self.local_map, self.local_probs = self.routing_map, probs  # all experts are local
        counts = ExpertCounts(self.routing_map.sum(dim=0))  # its host copy starts here, read in the backward
        rows, permuted_probs, self.reversed_local_input_permutation_mapping = permute.permute(
            hidden_states, self.routing_map, self.router_topk, probs
        )
        self.routing_map = None
        return rows, counts, permuted_probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        """Each token's ``k`` expert rows summed back in token order: ``[tokens, hidden]``."""
        if not permute.has_token_order(self.reversed_local_input_permutation_mapping):  # Megatron permuted them
            return super().combine_preprocess(hidden_states)
        return permute.unpermute(
            hidden_states, self.reversed_local_input_permutation_mapping, self.hidden_shape_before_permute[0]
        )


def queued_counts_apply(config: Any, num_local_experts: int) -> bool:
    """Whether :class:`QueuedCountsDispatcher` serves a layer: every expert local, each token routed to exactly
    ``moe_router_topk`` of them (no capacity dropping or padding), no shared-expert overlap (its dispatcher hook)."""
    return (
        config.moe_token_dispatcher_type == "allgather"
        and num_local_experts == config.num_moe_experts
        and config.moe_expert_capacity_factor is None
        and not config.moe_pad_expert_input_to_capacity
        and not config.moe_shared_expert_overlap
    )


class QueuedCountsMoELayer(MoELayer):
    """Megatron's ``MoELayer`` whose all-gather dispatcher is :class:`QueuedCountsDispatcher` where it applies
    (:func:`queued_counts_apply`, with :class:`~lightning_megatron.kernels.expert_mlp.GroupedMLP` experts); the
    same parameters, checkpoints and numbers."""

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        pg_collection = pg_collection or get_default_pg_collection()  # as MoELayer resolves it
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if (
            type(self.token_dispatcher) is MoEAllGatherTokenDispatcher
            and isinstance(self.experts, GroupedMLP)  # the experts that take ExpertCounts
            and queued_counts_apply(config, self.num_local_experts)
        ):
            self.token_dispatcher = QueuedCountsDispatcher(
                self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
            )
