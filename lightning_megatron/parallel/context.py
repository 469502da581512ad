"""Context parallelism: which tokens of a sequence each CP rank holds, and putting the sequence back together.

Megatron's load-balanced layout: a row of ``S`` tokens is cut into ``2 * cp`` chunks of ``c = S / (2 * cp)``; rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (with causal attention the early chunks are cheap, the late ones
expensive: each rank gets one of each). Every tensor aligned with the tokens ([B, S, ...]) is sliced the same way
before the model runs; outputs come back as ``[B, 2c, ...]`` and :func:`gather_sequence` reassembles them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group."""

    size: int
    """Ranks the sequence is split over (``MegatronStrategy(cp=...)``)."""
    rank: int
    """This rank's index in the group."""
    group: Any = None
    """The process group (Megatron's context-parallel group); ``None`` when ``size == 1``."""

    @classmethod
    def current(cls) -> ContextParallel:
        """The running job's CP place; ``size=1`` outside a run."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
            return cls(1, 0)
        size, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        return cls(size, rank, ps.get_context_parallel_group())


def check_divisible(seq_length: int, cp: int) -> None:
    """Raise ``ValueError`` unless a row of ``seq_length`` tokens splits into ``2 * cp`` equal chunks."""
    if cp > 1 and seq_length % (2 * cp) != 0:
        raise ValueError(
            f"a batch of sequence length {seq_length} cannot be split over cp={cp}: context parallelism cuts each row "
            f"into 2*cp={2 * cp} equal chunks; pad the rows to a multiple of {2 * cp} (e.g. pack them to "
            f"{-(-seq_length // (2 * cp)) * 2 * cp} tokens)"
        )


def token_index(seq_length: int, cp: ContextParallel, device: torch.device) -> Tensor:
    """LongTensor [2c]: the positions in the full row of this rank's tokens, in the order the rank holds them."""
    return _token_index(seq_length, cp.size, cp.rank, device)


@functools.lru_cache(maxsize=64)
def _token_index(seq_length: int, size: int, rank: int, device: torch.device) -> Tensor:
    check_divisible(seq_length, size)
    c = seq_length // (2 * size)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)
    return torch.cat([first, second]).to(device)


def gather_order(seq_length: int, size: int, device: torch.device) -> Tensor:
    """LongTensor [S]: for each position of the full row, its index in the ranks' blocks concatenated in rank order
    (what an all-gather along the sequence returns); ``gathered.index_select(dim, order)`` is the row in order."""
    return _gather_order(seq_length, size, device)


@functools.lru_cache(maxsize=64)
def _gather_order(seq_length: int, size: int, device: torch.device) -> Tensor:
    blocks = torch.cat([_token_index(seq_length, size, rank, torch.device("cpu")) for rank in range(size)])
    order = torch.empty_like(blocks)
    order[blocks] = torch.arange(seq_length)  # inverse permutation
    return order.to(device)


def slice_sequence(tensor: Tensor, index: Tensor | None, dim: int = 1) -> Tensor:
    """This rank's tokens of ``tensor`` along ``dim`` (the sequence); ``tensor`` itself without CP."""
    return tensor if index is None else tensor.index_select(dim, index)


def gather_sequence(local: Tensor, cp: ContextParallel, dim: int = 1) -> Tensor:
    """The full rows from every CP rank's tokens (``[B, 2c, ...]`` -> ``[B, S, ...]`` along ``dim``); no gradient."""
    if cp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp.size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=cp.group)
    gathered = torch.cat(parts, dim=dim)  # rank-ordered blocks
    order = gather_order(gathered.shape[dim], cp.size, local.device)
    return gathered.index_select(dim, order)
