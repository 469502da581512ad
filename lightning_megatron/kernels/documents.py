"""Where the tokens of a micro-batch sit -- RoPE position, document, place in the full row -- and attention over
that layout: packed documents (attention stays inside each document) and context parallelism (the rank's queries
against the keys/values of the whole row, all-gathered over the CP group as in Llama 3).

:class:`SequenceLayout` reaches core attention as Megatron's ``packed_seq_params``: with ``qkv_format="sbhd"``
Megatron passes it through every layer untouched (its own THD handling only triggers for ``"thd"``).
Kernels, chosen per call:

* unpacked rows under CP: per query chunk, SDPA over the key prefix with a bottom-right-aligned causal mask
  (``causal_lower_right``; flash/cuDNN kernels on GPU);
* packed rows on GPU: FlexAttention with a document block mask (compiled; only the blocks a document touches run);
* packed rows elsewhere (CPU, or attention dropout): SDPA with an explicit boolean mask, the reference path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from lightning_megatron.parallel.context import ContextParallel, gather_order


@dataclass(eq=False)
class SequenceLayout(PackedSeqParams):
    """The layout of one micro-batch's tokens on this rank, handed to ``GPTModel(..., packed_seq_params=layout)``."""

    positions: Tensor | None = None
    """[B or 1, S_local] RoPE positions of this rank's tokens (restarting at 0 in every document)."""
    documents: Tensor | None = None
    """[B, S] document number of every token of the full rows; ``None``: each row is one document."""
    query_index: Tensor | None = None
    """[S_local] place in the full row of each of this rank's tokens; ``None`` without context parallelism."""
    seq_length: int = 0
    """Tokens per full row (``S``)."""
    cp: ContextParallel = field(default_factory=lambda: ContextParallel(1, 0))
    """The context-parallel group the row is split over."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Masks built once per micro-batch and shared by all layers of a chunk."""

    def __post_init__(self) -> None:
        self.qkv_format = "sbhd"  # Megatron's attention then leaves the layout to the core attention
        # GPTModel sizes its own rotary table (YaRN models: GPT-OSS) by these whenever packed_seq_params is given:
        # the full rows' length, of which each CP rank's rotary module keeps its chunks' positions.
        self.max_seqlen_q = self.max_seqlen_q or self.seq_length
        self.max_seqlen_kv = self.max_seqlen_kv or self.seq_length
        super().__post_init__()


def gather_keys_values(key: Tensor, value: Tensor, layout: SequenceLayout) -> tuple[Tensor, Tensor]:
    """All-gather K/V [S_local, B, g, d] over the CP group into the full rows [S, B, g, d], in row order.

    The backward reduce-scatters: every rank's queries contribute to every key's gradient.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    order = gather_order(layout.seq_length, layout.cp.size, key.device)
    gathered = []
    for tensor in (key, value):
        blocks = gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=layout.cp.group)
        gathered.append(blocks.index_select(0, order))  # rank-ordered blocks -> row order
    return gathered[0], gathered[1]


def attend(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, sdpa: Any, dropout: float, scale: float) -> Tensor:
    """Causal attention of this rank's queries ``q`` [B, n, S_local, d] over ``k``/``v`` [B, g, S, d] (the full rows);
    ``sdpa(q, k, v, mask, causal)`` runs SDPA (with the module's dropout and RNG handling)."""
    if layout.documents is None:
        return _prefix_chunks(q, k, v, layout, sdpa)
    if q.device.type == "cuda" and dropout == 0.0:
        block_mask = layout.cache.get("block_mask")
        if block_mask is None:
            block_mask = layout.cache["block_mask"] = _block_mask(layout, q.shape[0], q.shape[2], q.device)
        return compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    mask = layout.cache.get("mask")
    if mask is None:
        mask = layout.cache["mask"] = document_mask(layout, q.device)
    return sdpa(q, k, v, mask, False)


def document_mask(layout: SequenceLayout, device: torch.device) -> Tensor:
    """Bool [B, 1, S_local, S], True = attend: a query sees the keys at or before it in its own document."""
    query, keys = _query_index(layout, device), torch.arange(layout.seq_length, device=device)
    allowed = keys[None, :] <= query[:, None]  # [S_local, S] causal by place in the row
    if layout.documents is not None:
        documents = layout.documents.to(device)
        same = documents[:, query, None] == documents[:, None, :]  # [B, S_local, S]
        allowed = allowed & same
    else:
        allowed = allowed[None]
    return allowed.unsqueeze(1)


def _query_index(layout: SequenceLayout, device: torch.device) -> Tensor:
    if layout.query_index is None:
        return torch.arange(layout.seq_length, device=device)
    return layout.query_index.to(device)


def _prefix_chunks(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, sdpa: Any) -> Tensor:
    """Unpacked rows under CP: each of the rank's two query chunks attends the key prefix that ends with it."""
    from torch.nn.attention.bias import causal_lower_right

    cp = layout.cp
    chunk = layout.seq_length // (2 * cp.size)
    outputs = []
    for i, index in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
        end = (index + 1) * chunk
        q_i = q[:, :, i * chunk : (i + 1) * chunk]
        if index == 0:  # the prefix is the chunk itself: plain causal
            outputs.append(sdpa(q_i, k[:, :, :end], v[:, :, :end], None, True))
        else:  # queries are the last `chunk` of `end` keys: causal aligned bottom-right
            outputs.append(sdpa(q_i, k[:, :, :end], v[:, :, :end], causal_lower_right(chunk, end), False))
    return torch.cat(outputs, dim=2)  # [B, n, 2c, d]


def _block_mask(layout: SequenceLayout, batch: int, queries: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    documents = layout.documents.to(device)
    query = _query_index(layout, device)

    def same_document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row = query[q_idx]
        return (kv_idx <= row) & (documents[b, row] == documents[b, kv_idx])

    # Compiled: built block by block, never as the [B, S_local, S] mask the eager version materialises.
    compiled = device.type == "cuda"
    return create_block_mask(
        same_document_causal, batch, None, queries, layout.seq_length, device=device, _compile=compiled
    )


@functools.cache
def compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # dynamic after a second shape: no recompile per row length
