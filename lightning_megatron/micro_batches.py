"""How one DataLoader batch becomes the micro-batches of one step: fixed-size slices, or groups under a token budget.

Fixed (``MegatronStrategy(micro_batch_size=n)``): slices of ``n`` samples along dim 0. Token budget
(``MegatronStrategy(max_tokens_per_micro_batch=N)``): samples are grouped so that each micro-batch, padded to its
own longest sample, holds at most ``N`` tokens: longest first, first fit (similar lengths together, little padding),
then the same number of groups balanced (longest first, each to the group with the fewest padded tokens that still
has room) when that pads no more; every micro-batch is cut to its longest sample. A
sample's length is its last attended position + 1 (``attention_mask``, right padding); without an
``attention_mask`` every sample is a full row (packed rows). The step's loss is the same either way: losses are
token sums divided by the token count of the whole global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_megatron.contract import Batch
from lightning_megatron.parallel.sizes import ParallelSizes
from lightning_megatron.validation import check_positive_int, divisors, next_multiple

GPU_LENGTH_MULTIPLE = 256
"""On GPU, budgeted micro-batches are cut to a multiple of this many tokens."""


def check_micro_batch_size(batch_size: int, micro_batch_size: int) -> None:
    """Raise ``ValueError`` unless a DataLoader batch of ``batch_size`` splits into micro-batches."""
    if batch_size % micro_batch_size != 0:
        raise ValueError(
            f"DataLoader batch_size={batch_size} is not divisible by micro_batch_size={micro_batch_size}: each batch "
            f"is split into micro-batches; use a batch size that is a multiple of {micro_batch_size} (and "
            f"drop_last=True), or pick micro_batch_size among {divisors(batch_size)}"
        )


def check_last_batch(dataloader: Any, micro_batch_size: int) -> None:
    """Raise ``ValueError`` if the last batch of a DataLoader that keeps it (``drop_last=False``) would not split into
    micro-batches: the epoch would otherwise fail at its very end."""
    batch_size, sampler = getattr(dataloader, "batch_size", None), getattr(dataloader, "sampler", None)
    if not isinstance(batch_size, int) or getattr(dataloader, "drop_last", True) or not hasattr(sampler, "__len__"):
        return  # dropped, or a length that is unknown before the data is exhausted
    samples = len(sampler)
    last = samples % batch_size
    if last % micro_batch_size:
        raise ValueError(
            f"the DataLoader's last batch would hold {last} samples ({samples} samples on this rank, batch_size="
            f"{batch_size}, drop_last=False), which does not split into micro-batches of micro_batch_size="
            f"{micro_batch_size}; for training pass drop_last=True; where every sample counts (validation, "
            f"prediction) use a dataset whose size per data-parallel rank is a multiple of {micro_batch_size}, or a "
            "micro_batch_size that divides both the batch size and the last batch"
        )


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into micro-batches of ``micro_batch_size``."""
    size = batch["input_ids"].shape[0]
    check_micro_batch_size(size, micro_batch_size)
    parts = {key: value.split(micro_batch_size) for key, value in batch.items()}
    return [{key: parts[key][i] for key in parts} for i in range(size // micro_batch_size)]


@dataclass(frozen=True)
class MicroBatching:
    """The strategy's micro-batching rule."""

    size: int = 1
    """Samples per micro-batch (without a token budget; with one, for predictions)."""
    max_tokens: int | None = None
    """Token budget per micro-batch (padded tokens, ``rows x longest``); ``None``: fixed ``size``."""
    length_multiple: int = 1
    """A budgeted micro-batch's length is rounded up to a multiple of this (``2*cp``; ``tp*cp`` under SP)."""

    def check_loader(self, dataloader: Any) -> None:
        """Fixed micro-batches: raise ``ValueError`` unless the DataLoader's batches split into them (its last one
        included); budgeted micro-batches take any batch size."""
        batch_size = getattr(dataloader, "batch_size", None)
        if isinstance(batch_size, int) and self.max_tokens is None:
            check_micro_batch_size(batch_size, self.size)
            check_last_batch(dataloader, self.size)

    def split(self, batch: Batch, fixed: bool = False) -> list[Batch]:
        """The micro-batches of ``batch``; ``fixed`` ignores the budget (predictions keep the batch's order)."""
        if self.max_tokens is None or fixed:
            return split_micro_batches(batch, self.size)
        if "routing" in batch:
            raise ValueError(
                "batch['routing'] (MoE routing replay) is laid out per sample and token of fixed micro-batches; use "
                "micro_batch_size instead of max_tokens_per_micro_batch with routing replay"
            )
        multiple = self.length_multiple
        if batch["input_ids"].device.type == "cuda":
            # Few distinct shapes: every new length costs new attention plans and compiled-kernel variants.
            multiple = math.lcm(multiple, GPU_LENGTH_MULTIPLE)
        lengths = sample_lengths(batch, multiple)
        groups = group_by_tokens(lengths, self.max_tokens)
        micro_batches = []
        for group in groups:
            rows = torch.tensor(group, device=batch["input_ids"].device)
            length = max(lengths[i] for i in group)  # every sample of the group fits: cut the padding after it
            shape = batch["input_ids"].shape
            micro_batches.append({k: _cut(v.index_select(0, rows), shape, length) for k, v in batch.items()})
        return micro_batches


def _cut(tensor: torch.Tensor, shape: torch.Size, length: int) -> torch.Tensor:
    if tensor.dim() >= 2 and tensor.shape[1] == shape[1]:  # token-aligned: [b, S, ...] -> [b, length, ...]
        return tensor[:, :length]
    return tensor  # per-sample values ([b], [b, K]) stay whole


def micro_batching(sizes: ParallelSizes, micro_batch_size: int, max_tokens: int | None) -> MicroBatching:
    """The rule for a strategy's layout; ``ValueError`` for a size or budget that is not a positive int."""
    check_positive_int("micro_batch_size", micro_batch_size)
    if max_tokens is None:
        return MicroBatching(size=micro_batch_size)
    check_positive_int("max_tokens_per_micro_batch", max_tokens)
    if sizes.ep > 1:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens} with ep={sizes.ep}: each data-parallel rank groups its own "
            "samples, so expert-parallel peers (on different data-parallel ranks) could run different numbers of "
            "micro-batches and wait on each other's token exchange; use ep=1 or fixed micro_batch_size"
        )
    if sizes.vpp is not None:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens} with vpp={sizes.vpp}: Megatron's interleaved schedule mismatches "
            "the shapes of variable-length micro-batches between stages (seen at pp=2); use vpp=None or fixed "
            "micro_batch_size"
        )
    # CP cuts every row into 2*cp chunks; SP splits each CP shard's tokens over TP.
    multiple = math.lcm(2 * sizes.cp if sizes.cp > 1 else 1, sizes.tp * sizes.cp if sizes.sequence_parallel else 1)
    return MicroBatching(micro_batch_size, max_tokens, length_multiple=multiple)


def sample_lengths(batch: Batch, multiple: int = 1) -> list[int]:
    """Each sample's length (its last ``attention_mask`` position + 1; the full row without one), rounded up to a
    multiple of ``multiple`` and capped at the row length. One host read of the mask."""
    rows, seq = batch["input_ids"].shape
    mask = batch.get("attention_mask")
    if mask is None:
        return [seq] * rows
    positions = torch.arange(1, seq + 1, device=mask.device)
    last = (mask.bool() * positions).amax(dim=1).tolist()  # [B]: 0 for an empty sample
    return [min(next_multiple(max(int(n), 1), multiple), seq) for n in last]


def group_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Sample indices grouped so that ``len(group) * max(lengths in group) <= max_tokens``, balanced on that padded
    size, in as few groups as that allows; each group in batch order."""
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens} is smaller than the longest sample of the batch ({longest} "
            f"tokens, after rounding for context/sequence parallelism and, on GPU, to a multiple of "
            f"{GPU_LENGTH_MULTIPLE}); use a budget of at least {longest}"
        )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packed = _first_fit_decreasing(order, lengths, max_tokens)  # similar lengths together: little padding
    # The same number of groups, balanced (longest first to the emptiest group with room), when that pads no more.
    balanced = _assign(order, lengths, max_tokens, len(packed))
    padded = [sum(len(g) * max(lengths[i] for i in g) for g in groups) for groups in (packed, balanced or packed)]
    best = balanced if balanced is not None and padded[1] <= padded[0] else packed
    return [sorted(group) for group in best]


def _first_fit_decreasing(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in order:  # longest first: a group's first sample is its longest
        for group in groups:
            if (len(group) + 1) * lengths[group[0]] <= max_tokens:
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def _assign(order: list[int], lengths: list[int], max_tokens: int, count: int) -> list[list[int]] | None:
    """Longest first, each sample to the group with the fewest padded tokens that has room; ``None`` if one has no
    room anywhere."""
    groups: list[list[int]] = [[] for _ in range(count)]
    longest = [0] * count
    for i in order:
        fits = [g for g in range(count) if (len(groups[g]) + 1) * max(longest[g], lengths[i]) <= max_tokens]
        if not fits:
            return None
        g = min(fits, key=lambda g: (len(groups[g]) * longest[g], g))
        groups[g].append(i)
        longest[g] = max(longest[g], lengths[i])
    return [group for group in groups if group]
