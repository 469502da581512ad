"""Attention variants of the torch-native core attention: sliding-window causal attention, attention sinks and
attention-logit soft-capping (a query scale other than 1/sqrt(d) is only ``softmax_scale``).

* sliding window: a query attends the keys at most ``window`` places before it (and itself), Megatron's
  ``window_size = (window, 0)``; layers choose it by ``window_attn_skip_freq`` (Megatron's
  ``is_layer_window_attention``);
* sinks: a logit per head appended to every row of scores before the softmax, its column dropped after (GPT-OSS,
  Megatron's ``softmax_type='learnable'``, or a logit of 0 for ``'off-by-one'``): the probabilities sum to less than 1;
* soft-capping: ``cap * tanh(scores / cap)`` on the scaled scores before masking (Gemma 2).

Kernels, chosen per call: on GPU without dropout, FlexAttention with a block mask of causal AND window AND (packed
rows) same document, so blocks outside the window are skipped, not masked; soft-capping as its ``score_mod`` and
sinks through its log-sum-exp: ``out * sigmoid(lse - sink)`` is the output of the softmax over [scores, sink].
Elsewhere (CPU, attention dropout) an explicit masked softmax in float32, the reference path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_megatron.kernels.documents import SequenceLayout, compiled_flex
from lightning_megatron.parallel.context import ContextParallel, token_index


@dataclass(frozen=True)
class Variant:
    """What one layer's core attention does beyond plain causal softmax attention (sinks are a tensor: passed at
    call time)."""

    window: int | None = None
    """Keys at most this many places before the query are attended (Megatron's ``window_size[0]``); None: all."""
    softcap: float | None = None
    """``cap * tanh(scores / cap)`` on the scaled scores; None: no capping."""


def attend_variant(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: SequenceLayout | None,
    variant: Variant,
    sink: Tensor | None,
    scale: float,
    dropout: float,
    fork_rng: bool,
) -> Tensor:
    """Causal attention of ``q`` [B, n, S_q, d] over ``k``/``v`` [B, g, S, d] (full rows) with ``variant`` and
    ``sink`` ([n] logits or None); ``layout``: packed documents / this rank's query places, or None (plain rows)."""
    if q.device.type == "cuda" and dropout == 0.0:
        return _flex_variant(q, k, v, layout, variant, sink, scale)
    cache = {} if layout is None else layout.cache
    key = ("variant_mask", variant.window)
    if key not in cache:
        cache[key] = allowed_mask(layout, q.shape[2], k.shape[2], variant.window, q.device)
    return masked_attention(q, k, v, cache[key], scale, variant.softcap, sink, dropout, fork_rng)


def allowed_mask(
    layout: SequenceLayout | None, queries: int, keys: int, window: int | None, device: torch.device
) -> Tensor:
    """Bool [B or 1, 1, S_q, S], True = attend: causal by place in the row, inside the window, in the same
    document."""
    query, key = _query_index(layout, queries, device), torch.arange(keys, device=device)
    distance = query[:, None] - key[None, :]  # [S_q, S]: how many places the key is before the query
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance <= window)
    allowed = allowed[None]
    if layout is not None and layout.documents is not None:
        documents = layout.documents.to(device)
        allowed = allowed & (documents[:, query, None] == documents[:, None, :])  # [B, S_q, S]
    return allowed.unsqueeze(1)


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    scale: float,
    softcap: float | None,
    sink: Tensor | None,
    dropout: float,
    fork_rng: bool,
) -> Tensor:
    """The reference path: scores materialised in float32 (float64 stays), capped, masked, softmax over them and the
    sink column, dropout, then the values; ``allowed`` from :func:`allowed_mask`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale  # [B, n, S_q, S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is None:
        probs = scores.softmax(-1)
    else:
        column = sink.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    if dropout > 0.0:
        probs = _dropout(probs, dropout, fork_rng)
    return probs.to(v.dtype) @ v


def _dropout(probs: Tensor, p: float, fork_rng: bool) -> Tensor:
    if not fork_rng:
        return F.dropout(probs, p)
    from megatron.core import tensor_parallel

    # As SDPAttention's SDPA call: heads are split over TP ranks, so each rank's masks come from the TP stream.
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return F.dropout(probs, p)


def _flex_variant(
    q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout | None, variant: Variant, sink: Tensor | None, scale: float
) -> Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    block_mask = variant_block_mask(layout, variant.window, q.shape[0], q.shape[2], k.shape[2], q.device)
    score_mod = None if variant.softcap is None else _softcap_mod(variant.softcap)
    kwargs: dict[str, Any] = dict(score_mod=score_mod, block_mask=block_mask, scale=scale)
    kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    if sink is None:
        return compiled_flex()(q, k, v, **kwargs)
    out, aux = compiled_flex()(q, k, v, **kwargs, return_aux=AuxRequest(lse=True))
    # softmax over [scores, sink] = softmax over scores * Z / (Z + e^sink), Z = e^lse; gradients reach the sink and,
    # through lse, the scores.
    factor = torch.sigmoid(aux.lse - sink.float().view(1, -1, 1))  # [B, n, S_q], lse in natural log
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


@functools.cache
def _softcap_mod(cap: float) -> Any:
    # One function per cap: torch.compile keys its graphs on the score_mod function.
    def softcap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return softcap


def variant_block_mask(
    layout: SequenceLayout | None, window: int | None, batch: int, queries: int, keys: int, device: torch.device
) -> Any:
    """FlexAttention's block mask of causal AND window AND same document: built once per micro-batch (packed rows,
    in the layout's cache) or once per shape (plain rows; under context parallelism per length and CP place)."""
    if layout is None:
        return _plain_block_mask(window, queries, keys, device)
    cp, index = layout.cp, layout.query_index
    # Plain rows under CP: their queries' places are token_index's (one cached tensor per length and place).
    plain_cp = layout.documents is None and cp.size > 1 and index is not None
    if plain_cp and index is token_index(layout.seq_length, cp, index.device):
        return _cp_rows_block_mask(window, layout.seq_length, cp.size, cp.rank, index.device, device)
    key = ("variant_block_mask", window)
    if key not in layout.cache:
        layout.cache[key] = _build_block_mask(layout, window, batch, queries, keys, device)
    return layout.cache[key]


@functools.lru_cache(maxsize=16)
def _cp_rows_block_mask(
    window: int | None, seq_length: int, size: int, rank: int, index_device: torch.device, device: torch.device
) -> Any:
    index = token_index(seq_length, ContextParallel(size, rank), index_device)
    rows = SequenceLayout(query_index=index, seq_length=seq_length, cp=ContextParallel(size, rank))
    return _build_block_mask(rows, window, 1, index.shape[0], seq_length, device)


@functools.lru_cache(maxsize=16)
def _plain_block_mask(window: int | None, queries: int, keys: int, device: torch.device) -> Any:
    return _build_block_mask(None, window, 1, queries, keys, device)


def _build_block_mask(
    layout: SequenceLayout | None, window: int | None, batch: int, queries: int, keys: int, device: torch.device
) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    query = _query_index(layout, queries, device)
    documents = None if layout is None or layout.documents is None else layout.documents.to(device)

    def allowed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row = query[q_idx]
        keep = kv_idx <= row
        if window is not None:  # a Python constant: the compiled mask has no branch
            keep = keep & (row - kv_idx <= window)
        if documents is not None:
            keep = keep & (documents[b, row] == documents[b, kv_idx])
        return keep

    rows = None if documents is None else batch  # plain rows: one mask broadcast over the batch
    # Compiled on GPU: built block by block, never as the [B, S_q, S] mask the eager version materialises.
    compiled = device.type == "cuda"
    return create_block_mask(allowed, rows, None, queries, keys, device=device, _compile=compiled)


def _query_index(layout: SequenceLayout | None, queries: int, device: torch.device) -> Tensor:
    """Place in the full row of each query: this rank's places under context parallelism, else 0..S_q-1."""
    if layout is None or layout.query_index is None:
        return torch.arange(queries, device=device)
    return layout.query_index.to(device)


def layer_variant(config: Any, layer_number: int, softcap: float | None) -> Variant | None:
    """The variant of layer ``layer_number`` (1-based, global) of a ``TransformerConfig``: a window where Megatron's
    ``is_layer_window_attention`` says so; None for plain attention (SDPA's kernels)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = None
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        left, right = config.window_size
        if right != 0 or left < 0:
            raise ValueError(
                f"window_size={tuple(config.window_size)}: the torch kernels run causal sliding windows "
                "(window_size=(W, 0), W >= 0 keys before the query)"
            )
        window = left
    if window is None and softcap is None:
        return None
    return Variant(window=window, softcap=softcap)


def sink_logits(config: Any, tp_group: Any) -> Tensor | None:
    """This rank's heads' sink logits for ``config.softmax_type``: a trained parameter for ``'learnable'`` (named
    ``softmax_offset`` by the caller, as Megatron's DotProductAttention names it; split over TP by heads), zeros for
    ``'off-by-one'``, None for ``'vanilla'``."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.utils import get_pg_rank, get_pg_size

    kind = config.softmax_type
    if kind == "vanilla":
        return None
    tp = get_pg_size(tp_group)
    heads = config.num_attention_heads // tp
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    logits = torch.zeros(heads, device=device, dtype=config.params_dtype)
    if kind == "off-by-one":
        return logits
    if kind != "learnable":
        raise ValueError(f"softmax_type={kind!r}: use 'vanilla', 'off-by-one' or 'learnable'")
    if config.perform_initialization:
        with torch.no_grad():
            if config.use_cpu_initialization:  # this rank's heads of one full vector: the same model at any TP
                master = torch.empty(config.num_attention_heads, dtype=torch.float32)
                config.init_method(master)
                logits.copy_(master.chunk(tp)[get_pg_rank(tp_group)])
            else:
                with get_cuda_rng_tracker().fork():  # as Megatron's TP-split weights: the TP stream
                    config.init_method(logits)
    parameter = torch.nn.Parameter(logits)
    # Every TP rank holds other heads: each shard counts in the gradient norm and is saved as a slice.
    set_tensor_model_parallel_attributes(parameter, is_parallel=True, dim=0, stride=1)
    return parameter
