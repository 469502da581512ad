"""The MoE routers' losses, logged every training step: ``moe_aux_loss`` (load balancing) and ``moe_z_loss``.

Megatron's routers add these losses to the gradient themselves and record each MoE layer's value, divided by its
coefficient, in a process-wide tracker (``get_moe_metrics_tracker()``, what ``save_to_aux_losses_tracker`` writes):
summed over the micro-batches of the step on each rank, at the layer's global index. After the step's schedule,
:func:`router_losses` reads the tracker on every rank and reduces it as Megatron's ``track_moe_metrics`` does:

* per layer, the mean over this rank's micro-batches (Megatron's ``loss_scale = 1 / num_microbatches``; the routers
  here count their own training forward passes, see :class:`StepRouter`);
* the load-balancing loss summed over the tensor x context-parallel ranks (each holds a part of the token sum;
  ``global_aux_loss``: over tensor x data x context, its reduce group, without a data-parallel mean), the z-loss
  averaged over them; then both averaged over the data-parallel ranks and summed over the pipeline stages (each
  holds its own layers' entries), so every rank gets the same numbers;
* the mean over the model's MoE layers, times the loss's coefficient.

So ``moe_aux_loss`` is ``moe_aux_loss_coeff`` x the per-layer load-balancing loss, averaged over MoE layers,
micro-batches and data-parallel ranks -- the per-token term each MoE layer adds to the objective, as ``train_loss`` is
the per-token language-model loss -- and likewise ``moe_z_loss`` (``moe_z_loss_coeff`` x the mean squared logsumexp
of the router logits). With equal micro-batches that mean is how Megatron weights the micro-batches in the gradient;
its per-token loss (``calculate_per_token_loss``) scales the router terms by the routed tokens over the loss tokens
(e.g. S / (S - 1) for shifted labels), a factor not in the logged number. Routers compute these losses in training
only, so validation logs none. The tracker is cleared after each read.

Token dispatch: Megatron's all-to-all dispatcher at ``ep > 1`` (and with variable sequence lengths), its default
``"allgather"`` otherwise, which exchanges nothing at ``ep=1`` (``lightning_megatron.parallel.state.chunk_specs``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_megatron.gpt.config import ModelConfig

__all__ = ["StepRouter", "router_losses", "tracked_names"]

# The tracker's name of each load-balancing loss (Megatron's router.py).
_TRACKED = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


class StepRouter(TopKRouter):
    """Megatron's ``TopKRouter`` that also counts its training forward passes (those that record losses in the
    tracker) until :func:`router_losses` reads them. The same parameters, buffers and checkpoints."""

    training_forwards: int = 0

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        _reset_tracker(config.num_layers + (config.mtp_num_layers or 0))

    def forward(self, input: Tensor, padding_mask: Tensor | None = None) -> Any:
        # Megatron records the aux losses under exactly these conditions (a recomputed layer: in its recomputation).
        if self.training and torch.is_grad_enabled():
            self.training_forwards += 1
        return super().forward(input, padding_mask)


def _reset_tracker(size: int) -> None:
    """Zero the process-wide tracker when a model is built, and drop entries sized for another model (an earlier
    fit in this process): Megatron indexes them by layer and would fail on, or mix in, another model's layers."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    for name in [name for name, entry in tracker.metrics.items() if entry.values.numel() != size]:
        del tracker.metrics[name]
    tracker.clear()


def tracked_names(config: ModelConfig) -> dict[str, str]:
    """``{logged name: tracker name}`` of the router losses ``config`` turns on (none for a dense model)."""
    if config.num_moe_experts is None:
        return {}
    names = {}
    if config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type in _TRACKED:
        names["moe_aux_loss"] = _TRACKED[config.moe_router_load_balancing_type]
    if config.moe_z_loss_coeff is not None:
        names["moe_z_loss"] = "z_loss"
    return names


def router_losses(config: ModelConfig, chunks: Iterable[nn.Module]) -> dict[str, Tensor]:
    """This step's ``{"moe_aux_loss": ..., "moe_z_loss": ...}`` (those turned on; device scalars, read without a
    host synchronisation), identical on every rank, as the module docstring defines them; then clears the tracker
    and the routers' counts. Collective over the model's process groups: every rank calls it after the schedule."""
    from megatron.core import parallel_state as ps

    names = tracked_names(config)
    if not names:
        return {}
    chunks = list(chunks)
    per_layer = _per_layer_means(config, chunks, list(names.values()))  # [losses, layers] on this rank
    tp_cp = ps.get_tensor_and_context_parallel_group()
    dp = ps.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    if "moe_z_loss" in names:  # averaged over TP x CP, where the load-balancing partial sums add up
        per_layer[list(names).index("moe_z_loss")] /= torch.distributed.get_world_size(tp_cp)
    for group in (tp_cp, dp, ps.get_pipeline_model_parallel_group()):
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(per_layer, group=group)  # sums (gloo has no AVG), divided below
    dp_size = torch.distributed.get_world_size(dp)
    coefficients = {"moe_aux_loss": config.moe_aux_loss_coeff, "moe_z_loss": config.moe_z_loss_coeff}
    num_moe = sum(config.moe_layers)
    out = {}
    for row, (name, tracker_name) in enumerate(names.items()):
        # global_aux_loss's reduce group spans DP already (Megatron takes no DP mean of it); the others: DP mean.
        ranks = 1 if tracker_name == "global_load_balancing_loss" else dp_size
        out[name] = (per_layer[row].sum() * (coefficients[name] / (num_moe * ranks))).float()
    return out


def _per_layer_means(config: ModelConfig, chunks: list[nn.Module], tracker_names: list[str]) -> Tensor:
    """``[len(tracker_names), num_layers]`` float64: each layer's tracked loss, the mean over this rank's micro-batches
    of the step (zero for layers elsewhere, or dense); resets the tracker's values and the routers' counts."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    device = next(p for chunk in chunks for p in chunk.parameters()).device
    counts = torch.zeros(config.num_layers, dtype=torch.float64, device=device)
    for router in (m for chunk in chunks for m in chunk.modules() if isinstance(m, StepRouter)):
        counts[router.layer_number - 1] += router.training_forwards  # a host int: no synchronisation
        router.training_forwards = 0
    tracker = get_moe_metrics_tracker()
    rows = torch.zeros(len(tracker_names), config.num_layers, dtype=torch.float64, device=device)
    for row, name in enumerate(tracker_names):
        if name in tracker.metrics:
            rows[row] = tracker.metrics[name].values.to(device=device, dtype=torch.float64, copy=True)
    tracker.clear()
    return rows / counts.clamp(min=1)
