"""One micro-batch as this rank's model chunk sees it: packed documents and the context-parallel slice.

Packed batches follow Hugging Face's flattening convention (``DataCollatorWithFlattening``): ``position_ids``
[B, S] restart at 0 where each document starts (and count up inside it), ``labels`` hold -100 at each document's
first token. With ``position_ids`` in the batch, attention stays inside each document and RoPE uses those
positions. Under context parallelism every token-aligned tensor is cut to this rank's chunks
(:mod:`lightning_megatron.parallel.context`) after the labels are shifted on the full rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.contract import Batch
from lightning_megatron.kernels.documents import SequenceLayout
from lightning_megatron.parallel.context import ContextParallel, gather_sequence, slice_sequence, token_index


@dataclass(frozen=True)
class RankTokens:
    """This rank's tokens of one micro-batch."""

    input_ids: Tensor
    """[B, S_local] token ids."""
    position_ids: Tensor
    """[B, S_local] positions (restarting in every document of a packed row)."""
    layout: SequenceLayout | None
    """What core attention needs for packed rows or CP; ``None`` for plain rows without CP (the fast path)."""
    index: Tensor | None
    """[S_local] this rank's places in the row under CP; ``None`` without CP."""
    cp: ContextParallel
    """The context-parallel group."""

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's part of a token-aligned tensor [B, S, ...] of the full rows."""
        return slice_sequence(tensor, self.index)

    def local_batch(self, batch: Batch) -> Batch:
        """``batch`` with every token-aligned tensor ([B, S, ...]) cut to this rank's tokens."""
        if self.index is None:
            return batch
        shape = batch["input_ids"].shape
        return {k: self.local(v) if v.dim() >= 2 and v.shape[:2] == shape else v for k, v in batch.items()}

    def gather(self, tensor: Tensor) -> Tensor:
        """Full rows [B, S, ...] back from every CP rank's [B, S_local, ...] (no gradient)."""
        return gather_sequence(tensor, self.cp)


def rank_tokens(batch: Batch) -> RankTokens:
    """This rank's view of ``batch`` (a micro-batch of full rows)."""
    input_ids = batch["input_ids"]
    rows, seq = input_ids.shape
    cp = ContextParallel.current()
    packed = "position_ids" in batch
    if not packed and cp.size == 1:
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(rows, seq)
        return RankTokens(input_ids, positions, None, None, cp)
    index = token_index(seq, cp, input_ids.device) if cp.size > 1 else None
    if packed:
        positions = batch["position_ids"].to(input_ids.device)
        documents = (positions == 0).cumsum(1, dtype=torch.int32)  # [B, S]: the document number of every token
    else:
        positions, documents = torch.arange(seq, device=input_ids.device).unsqueeze(0), None
    local_positions = slice_sequence(positions, index)
    layout = SequenceLayout(positions=local_positions, documents=documents, query_index=index, seq_length=seq, cp=cp)
    return RankTokens(slice_sequence(input_ids, index), local_positions.expand(rows, -1), layout, index, cp)


def without_default_positions(batch: Any) -> Any:
    """``batch`` without ``position_ids`` when they are what the model uses anyway (every row one document counting
    from 0): such batches keep SDPA's causal fast path instead of the document-mask kernels. Host tensors only."""
    if not isinstance(batch, Mapping) or "position_ids" not in batch:
        return batch
    positions = batch["position_ids"]
    if positions.device.type != "cpu" or bool((positions[:, 1:] == 0).any()):
        return batch  # packed rows (or device tensors: a check here would synchronise)
    return {k: v for k, v in batch.items() if k != "position_ids"}


def document_starts(batch: Batch) -> Tensor | None:
    """Bool [B, S]: where a packed row's documents start (``position_ids == 0``); ``None`` for unpacked batches."""
    positions = batch.get("position_ids")
    return None if positions is None else positions == 0


def token_mask(batch: Batch) -> Tensor:
    """Bool [B, S]: the tokens that ``loss_mask`` and ``attention_mask`` (when present) keep."""
    keep = torch.ones_like(batch["input_ids"], dtype=torch.bool)
    for name in ("loss_mask", "attention_mask"):
        if name in batch:
            keep = keep & batch[name].bool()
    return keep
