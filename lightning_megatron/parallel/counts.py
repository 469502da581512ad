"""Parameter counts of the whole model from the shards every rank holds (for model summaries and the MFU count).

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


def input_embedding_parameters(chunks: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The input embedding tables among this rank's ``chunks`` (Megatron ``GPTModel``s, bare or wrapped): a lookup,
    no matmul. The token table tied to the output head (``share_embeddings_and_output_weights``) is not among them:
    it is the head's weight, counted once on the first stage (the last stage's copy is ``shared``)."""
    tables: list[nn.Parameter] = []
    for chunk in chunks:
        for model in chunk.modules():
            embedding = getattr(model, "embedding", None)
            if not hasattr(model, "share_embeddings_and_output_weights") or embedding is None:
                continue  # not a Megatron language model, or a stage without the embedding
            tied = model.share_embeddings_and_output_weights
            head = embedding.word_embeddings.weight if tied else None
            tables += [p for p in embedding.parameters() if p is not head]
    return tables


def flops_parameter_sets(chunks: Sequence[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """This rank's trainable and frozen parameters that the standard MFU count counts: all but the input embedding
    tables (:func:`input_embedding_parameters`)."""
    tables = {id(p) for p in input_embedding_parameters(chunks)}
    params = [p for chunk in chunks for p in chunk.parameters() if id(p) not in tables]
    return [p for p in params if p.requires_grad], [p for p in params if not p.requires_grad]


def routed_experts(chunks: Sequence[nn.Module]) -> tuple[set[int], float]:
    """The ids of this rank's routed-expert parameters (the ``experts`` of Megatron's MoE layers; not a shared expert,
    which every token runs) and the part of them one token runs through, ``moe_router_topk / num_moe_experts`` of the
    model's config (the same on every rank, also on a pipeline stage without MoE layers)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    config = getattr(chunks[0], "config", None) if chunks else None  # GPTModel, DDP and Float16Module carry it
    experts = getattr(config, "num_moe_experts", None)
    share = config.moe_router_topk / experts if experts else 1.0
    return {id(p) for layer in layers for p in layer.experts.parameters()}, share


def flops_parameters(chunks: Sequence[nn.Module]) -> tuple[int, int]:
    """Collective over all ranks (as :func:`whole_model_counts`): the trainable and the frozen parameters of the
    whole model that the standard MFU count counts, i.e. every parameter but the input embedding tables (a tied
    embedding counted once, as the output head); tensor-, pipeline- and expert-parallel shards and virtual stages
    summed as in the model summary. MoE experts count as active parameters: each routed expert's times
    ``moe_router_topk / num_moe_experts`` (:func:`routed_experts`), so that N is what one token runs through."""
    trainable, frozen = flops_parameter_sets(chunks)
    experts, share = routed_experts(chunks)
    sets = [
        [p for p in group if (id(p) in experts) == routed] for group in (trainable, frozen) for routed in (False, True)
    ]
    dense, routed, dense_frozen, routed_frozen = whole_model_counts(sets, [True] * 4)
    return round(dense + share * routed), round(dense_frozen + share * routed_frozen)


def model_flops_per_token(trainable: int, frozen: int, num_layers: int, hidden_size: int, seq_length: int) -> int:
    """Training FLOPs per token by the standard count: ``6 N + 6 layers hidden seq``.

    ``N`` (``trainable + frozen``): the parameters without the input embedding table (:func:`flops_parameters`):
    each does one multiply-add (2 FLOPs) per token in the forward pass and two in the backward (input and weight
    gradients); a frozen one (LoRA's base) 4 FLOPs, not 6 (no weight gradient). ``6 layers hidden seq``: the
    attention scores and the weighted values, per token and layer a multiply-add with ``seq x hidden`` keys and one
    with as many values (``4 seq hidden`` FLOPs forward), halved for causal attention (a token sees the keys before
    it), times 3 for forward and backward; counting the full matrix gives ``12 layers hidden seq``.
    """
    return 6 * trainable + 4 * frozen + 6 * num_layers * hidden_size * seq_length
