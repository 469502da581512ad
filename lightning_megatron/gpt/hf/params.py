"""The vocabulary of the HF weight tables (a leaf: it imports nothing from this package).

A :class:`Param` names one Megatron parameter of a model chunk and the HF tensors it is made of; its ``kind`` says
how those tensors are fused into it (:func:`combine`) and split back (:func:`split_local`), and along which dimension
they are sharded over tensor-parallel ranks (:data:`SPLIT_DIM`). :class:`ModelShape` is what the tables read of a
model config: ``ModelConfig`` satisfies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

Kind = Literal["copy", "rows", "cols", "qkv", "gate_up", "halves", "fused_gate_up", "fused_gate_up_bias", "fused_down",
               "fused_gate_up_rows"]  # fmt: skip
SPLIT_DIM: dict[str, int | None] = {"copy": None, "rows": 0, "cols": 1, "qkv": 0, "gate_up": 0, "halves": 0,
                                    "fused_gate_up": 1, "fused_gate_up_bias": 0, "fused_down": 0,
                                    "fused_gate_up_rows": 0}  # fmt: skip
"""The dimension each HF tensor of a kind is split along over tensor-parallel ranks (None: replicated). A "halves"
tensor (an expert adapter's B on HF's fused gate_up_proj: [gate rows; up rows]) is split half by half: a rank holds
[its gate rows; its up rows], as Megatron's fused linear_fc1 (:func:`rank_block`, :func:`join_rank_blocks`).

The ``fused_*`` kinds are one expert's piece of GPT-OSS's experts stored as ``x @ W`` (``[in, out]``, transposed
from ``nn.Linear``): ``gate_up_proj`` ``[hidden, 2 * ffn]`` with gate and up columns interleaved (gate ``0::2``, up
``1::2``; its bias likewise) and ``down_proj`` ``[ffn, hidden]``. A contiguous block of the interleaved columns
holds the same gate and up columns, which is a rank's [gate shard; up shard] once de-interleaved.
``fused_gate_up_rows`` is a PEFT factor on that ``gate_up_proj`` whose rows are its output columns, interleaved the
same way (one expert's adapter B, ``[2 * ffn, r]``)."""

HFTensor = tuple[str, tuple[int, ...]]
"""An HF tensor's name and full shape."""


@dataclass(frozen=True)
class Param:
    """One Megatron parameter of a chunk (``megatron``, its name in the chunk) and the HF tensors it is made of.

    ``expert`` is set for an expert's slice of a stacked expert weight: the HF tensors make
    ``parameter[expert]`` (the local expert index on this expert-parallel rank), not the whole parameter.
    """

    megatron: str
    hf: tuple[HFTensor, ...]
    kind: Kind
    expert: int | None = None


class ModelShape(Protocol):
    """The fields of a model config that the HF tables and family adapters read (``ModelConfig`` has them all)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def add_qkv_bias(self) -> bool: ...
    @property
    def qk_layernorm(self) -> bool: ...
    @property
    def gated_linear_unit(self) -> bool: ...
    @property
    def share_embeddings_and_output_weights(self) -> bool: ...
    @property
    def num_moe_experts(self) -> int | None: ...
    @property
    def moe_ffn_hidden_size(self) -> int | None: ...
    @property
    def moe_router_topk(self) -> int: ...
    @property
    def moe_router_pre_softmax(self) -> bool: ...
    @property
    def moe_shared_expert_intermediate_size(self) -> int | None: ...
    @property
    def moe_shared_expert_gate(self) -> bool: ...
    @property
    def moe_layer_freq(self) -> int | tuple[int, ...]: ...
    @property
    def effective_kv_channels(self) -> int: ...
    @property
    def effective_num_query_groups(self) -> int: ...
    @property
    def effective_ffn_hidden_size(self) -> int: ...


def qkv(prefix: str, what: str, c: ModelShape, rest: tuple[int, ...]) -> tuple[HFTensor, ...]:
    """HF's q/k/v projections' ``what`` ("weight" or "bias") under ``prefix``, fused in Megatron's linear_qkv."""
    d = c.effective_kv_channels
    sizes = (("q", c.num_attention_heads * d), ("k", c.effective_num_query_groups * d))
    sizes += (("v", c.effective_num_query_groups * d),)
    return tuple((f"{prefix}{p}_proj.{what}", (n, *rest)) for p, n in sizes)


def combine(p: Param, parts: list[Tensor], c: ModelShape, tp: int) -> Tensor:
    """This rank's shards of p's HF tensors -> its local Megatron tensor."""
    if p.kind == "qkv":
        groups, rest = c.effective_num_query_groups // tp, parts[0].shape[1:]
        # q [groups * heads_per_group * d, *rest], k and v [groups * d, *rest] -> per query group [q; k; v]
        per_group = [t.reshape(groups, -1, *rest) for t in parts]  # [groups, rows_per_group, *rest]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    if p.kind == "gate_up":
        return torch.cat(parts)  # [gate shard; up shard] on every rank
    if p.kind == "fused_gate_up":
        return torch.cat([parts[0][:, 0::2], parts[0][:, 1::2]], dim=1).t()
    if p.kind in ("fused_gate_up_bias", "fused_gate_up_rows"):
        return torch.cat([parts[0][0::2], parts[0][1::2]])
    if p.kind == "fused_down":
        return parts[0].t()
    return parts[0]


def split_local(p: Param, local: Tensor, c: ModelShape, tp: int) -> list[Tensor]:
    """Inverse of :func:`combine`: one rank's local tensor -> its shards of p's HF tensors."""
    if p.kind == "qkv":
        groups, d, rest = c.effective_num_query_groups // tp, c.effective_kv_channels, local.shape[1:]
        q_rows = c.num_attention_heads // c.effective_num_query_groups * d
        view = local.reshape(groups, q_rows + 2 * d, *rest)  # per query group [its q heads; k; v]
        return [t.reshape(-1, *rest) for t in view.split([q_rows, d, d], dim=1)]
    if p.kind == "gate_up":
        return list(local.chunk(2))
    if p.kind in ("fused_gate_up", "fused_gate_up_bias"):
        gate, up = (half.t() for half in local.chunk(2)) if local.ndim == 2 else local.chunk(2)
        return [torch.stack([gate, up], dim=-1).flatten(-2)]  # columns gate0, up0, gate1, ...
    if p.kind == "fused_gate_up_rows":
        gate, up = local.chunk(2)
        return [torch.stack([gate, up], dim=1).flatten(0, 1)]  # rows gate0, up0, gate1, ...
    if p.kind == "fused_down":
        return [local.t().contiguous()]
    return [local]


def rank_block(kind: Kind, whole: Tensor, rank: int, tp: int) -> Tensor:
    """A tensor-parallel rank's block of a whole HF tensor of ``kind`` (all of it for a replicated kind)."""
    dim = SPLIT_DIM[kind]
    if dim is None or tp == 1:
        return whole
    if kind == "halves":
        return torch.cat([half.chunk(tp)[rank] for half in whole.chunk(2)])
    return whole.chunk(tp, dim=dim)[rank]


def join_rank_blocks(kind: Kind, blocks: list[Tensor]) -> Tensor:
    """Inverse of :func:`rank_block`: the whole tensor from every rank's block, in rank order."""
    dim = SPLIT_DIM[kind]
    if dim is None:
        return blocks[0]
    if kind == "halves":
        return torch.cat([block.chunk(2)[half] for half in range(2) for block in blocks])
    return torch.cat(blocks, dim=dim)


EXPERT_PIECE = "@expert"
"""Suffix of one expert's piece of a PEFT tensor that holds all experts (``...experts.lora_A.weight@expert3``): the
tables name pieces, export joins them (:func:`join_expert_pieces`) and import slices them."""


def expert_piece(name: str) -> tuple[str, int | None]:
    """``(PEFT tensor name, expert)`` of a piece name; ``(name, None)`` for a name that is no piece."""
    whole, found, expert = name.rpartition(EXPERT_PIECE)
    return (whole, int(expert)) if found else (name, None)


def stacked(name: str) -> bool:
    """Whether the tensor ``name`` on fused experts stacks them on a leading expert dimension (a base weight:
    GPT-OSS), rather than interleaving them as PEFT's factors do."""
    return ".lora_A." not in name and ".lora_B." not in name


def join_pieces(name: str, pieces: list[Tensor]) -> Tensor:
    """The tensor ``name`` on fused experts from each expert's piece, in expert order: PEFT's factors
    (:func:`join_expert_pieces`) or a base weight stacked on a leading expert dimension (GPT-OSS)."""
    if not stacked(name):
        return join_expert_pieces(pieces, lora_a=".lora_A." in name)
    return torch.stack(pieces)


def piece_of(name: str, whole: Tensor, expert: int, num_experts: int) -> Tensor:
    """Inverse of :func:`join_pieces`: one expert's piece of the tensor ``name`` on fused experts."""
    if not stacked(name):
        return expert_slice(whole, expert, num_experts, lora_a=".lora_A." in name)
    return whole[expert]


def join_expert_pieces(pieces: list[Tensor], lora_a: bool) -> Tensor:
    """PEFT's tensor on fused experts from each expert's factor, in expert order: A ``[E * r, in]`` (each expert's
    rows in turn), B ``[out, r * E]`` (column ``j * E + e`` for rank ``j`` of expert ``e``: PEFT's ``ParamWrapper``)."""
    if lora_a:
        return torch.cat(pieces, dim=0)
    stacked = torch.stack(pieces, dim=-1)  # [out, r, E]
    return stacked.reshape(stacked.shape[0], -1)


def expert_slice(whole: Tensor, expert: int, num_experts: int, lora_a: bool) -> Tensor:
    """One expert's factor of PEFT's tensor on fused experts (the inverse of :func:`join_expert_pieces`)."""
    if lora_a:
        rank = whole.shape[0] // num_experts
        return whole[expert * rank : (expert + 1) * rank]
    return whole.reshape(whole.shape[0], -1, num_experts)[:, :, expert]


def lora_pair(m: str, h: str, part: str, rank: int, sizes: tuple[int, int], column: bool) -> list[Param]:
    """The A and B factors of one dense adapter under Megatron prefix ``m`` (the linear) and PEFT prefix ``h`` (the
    projection): on a column-parallel base B is split like its rows and A replicated; on a row-parallel one A is
    split like its columns and B replicated (lightning_megatron.gpt.lora)."""
    n_in, n_out = sizes
    a_kind: Kind = "copy" if column else "cols"
    b_kind: Kind = "rows" if column else "copy"
    return [
        Param(f"{m}lora_A.{part}", ((h + "lora_A.weight", (rank, n_in)),), a_kind),
        Param(f"{m}lora_B.{part}", ((h + "lora_B.weight", (n_out, rank)),), b_kind),
    ]
