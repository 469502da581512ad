"""Parameter counts of the whole model from the shards every rank holds (for model summaries).

Megatron marks how a parameter is split: ``tensor_model_parallel`` (a tensor-parallel shard), ``allreduce=False``
(an expert's: expert-parallel ranks hold different experts), ``shared`` (the last pipeline stage's copy of a tied
embedding, counted on the first stage). Each rank counts the fraction of each of its parameters that makes the sum
over all ranks count every parameter of the model once: a shard held by ``n`` ranks (data- and context-parallel
replicas, tensor-parallel ranks of an unsplit parameter) counts ``1/n`` on each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def parameter_share(param: nn.Parameter) -> float:
    """The part of ``param`` this rank counts (the sum over all ranks counts each parameter of the model once)."""
    from megatron.core import parallel_state as ps

    if getattr(param, "shared", False):
        return 0.0  # the tied output weight's copy on the last pipeline stage: the first stage counts it
    tp_sharded = getattr(param, "tensor_model_parallel", False)
    stage_ranks = torch.distributed.get_world_size() // ps.get_pipeline_model_parallel_world_size()
    if getattr(param, "allreduce", True):  # dense: each shard on every data/context-parallel rank of its stage
        holders = stage_ranks // ps.get_tensor_model_parallel_world_size() if tp_sharded else stage_ranks
    else:  # an expert's: every expert-parallel rank holds other experts, split over expert-TP when sharded
        ep = ps.get_expert_model_parallel_world_size()
        holders = stage_ranks // (ep * ps.get_expert_tensor_parallel_world_size()) if tp_sharded else stage_ranks // ep
    return param.numel() / holders


def whole_model_counts(sets: Sequence[Iterable[nn.Parameter]], every_stage: Sequence[bool]) -> list[int]:
    """Collective over all ranks: the parameters in each of ``sets`` counted over the whole model.

    Every rank passes the same number of sets. A set with ``every_stage`` true is one every pipeline stage has (the
    LightningModule's parameters, its top-level children): summed over the stages. The others are modules of this
    rank's stage (Megatron numbers layers per stage, so a name means another layer on another stage): their count
    is of that stage, every tensor- and expert-parallel shard included. Without Megatron's groups: this rank's count.
    """
    from megatron.core import parallel_state as ps

    params = [list(dict.fromkeys(members)) for members in sets]  # a parameter reached twice counts once
    if not ps.model_parallel_is_initialized():
        return [sum(p.numel() for p in group) for group in params]
    device = next((p.device for group in params for p in group), torch.device("cpu"))
    counts = torch.tensor([sum(parameter_share(p) for p in group) for group in params], dtype=torch.float64)
    counts = counts.to(device)
    torch.distributed.all_reduce(counts, group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        whole = torch.tensor(every_stage, device=device)
        across = torch.where(whole, counts, torch.zeros_like(counts))
        torch.distributed.all_reduce(across, group=ps.get_pipeline_model_parallel_group())
        counts = torch.where(whole, across, counts)
    return [round(value) for value in counts.tolist()]
