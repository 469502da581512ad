"""The weight-name table: which HF tensors make each Megatron ``GPTModel`` parameter, and how they are split over
tensor-parallel ranks. Import (:mod:`lightning_megatron.gpt.hf.load`) and export
(:mod:`lightning_megatron.gpt.hf.export`) both read it, so the two directions cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from lightning_megatron.gpt.lora.config import COLUMN_TARGETS, HF_BLOCK

if TYPE_CHECKING:
    from lightning_megatron.gpt.config import ModelConfig
    from lightning_megatron.gpt.lora.config import LoRAConfig

PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the HF model's own names in an adapter's state dict."""

Kind = Literal["copy", "rows", "cols", "qkv", "gate_up"]
# The dimension each HF tensor of a kind is split along over tensor-parallel ranks (None: replicated).
SPLIT_DIM: dict[str, int | None] = {"copy": None, "rows": 0, "cols": 1, "qkv": 0, "gate_up": 0}


@dataclass(frozen=True)
class Param:
    """One Megatron parameter of a chunk and the HF tensors (name, full shape) it is made of."""

    megatron: str
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    kind: Kind


def _layer_params(c: ModelConfig, local: int, layer: int) -> list[Param]:
    m, att, h = f"decoder.layers.{local}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}."
    hidden, d, ffn = c.hidden_size, c.effective_kv_channels, c.effective_ffn_hidden_size
    q, kv = c.num_attention_heads * d, c.effective_num_query_groups * d
    params = [Param(m + "self_attention.linear_qkv.weight", _qkv(att, "weight", q, kv, (hidden,)), "qkv")]
    if c.add_qkv_bias:
        params.append(Param(m + "self_attention.linear_qkv.bias", _qkv(att, "bias", q, kv, ()), "qkv"))
    params.append(Param(m + "self_attention.linear_proj.weight", ((att + "o_proj.weight", (hidden, q)),), "cols"))
    if c.qk_layernorm:
        params.append(Param(m + "self_attention.q_layernorm.weight", ((att + "q_norm.weight", (d,)),), "copy"))
        params.append(Param(m + "self_attention.k_layernorm.weight", ((att + "k_norm.weight", (d,)),), "copy"))
    gate_up = ((h + "mlp.gate_proj.weight", (ffn, hidden)), (h + "mlp.up_proj.weight", (ffn, hidden)))
    params.append(Param(m + "mlp.linear_fc1.weight", gate_up, "gate_up"))
    params.append(Param(m + "mlp.linear_fc2.weight", ((h + "mlp.down_proj.weight", (hidden, ffn)),), "cols"))
    params.append(Param(m + "input_layernorm.weight", ((h + "input_layernorm.weight", (hidden,)),), "copy"))
    post_norm = ((h + "post_attention_layernorm.weight", (hidden,)),)
    params.append(Param(m + "pre_mlp_layernorm.weight", post_norm, "copy"))
    return params


def _qkv(prefix: str, what: str, q: int, kv: int, rest: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((f"{prefix}{p}_proj.{what}", (n, *rest)) for p, n in (("q", q), ("k", kv), ("v", kv)))


def chunk_params(c: ModelConfig, *, pre: bool, post: bool, offset: int, num_layers: int) -> list[Param]:
    """The parameters of one chunk (local layer i is global layer ``offset + i``), in HF state-dict order."""
    embed = ("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    params = [Param("embedding.word_embeddings.weight", (embed,), "rows")] if pre else []
    for i in range(num_layers):
        params += _layer_params(c, i, offset + i)
    if post:
        params.append(Param("decoder.final_layernorm.weight", (("model.norm.weight", (c.hidden_size,)),), "copy"))
        tied = c.share_embeddings_and_output_weights
        # Tied: a stage without the embedding keeps its own copy of it as output_layer.weight.
        if not (tied and pre):
            head = embed if tied else ("lm_head.weight", (c.vocab_size, c.hidden_size))
            params.append(Param("output_layer.weight", (head,), "rows"))
    return params


def adapter_params(c: ModelConfig, lora: LoRAConfig, *, offset: int, num_layers: int) -> list[Param]:
    """The LoRA factors of one chunk's layers as PEFT names them (``base_model.model.model.layers.0.self_attn.
    q_proj.lora_A.weight``), in PEFT's state-dict order. A column-parallel base's B is split like its rows and A
    replicated; a row-parallel base's A is split like its columns and B replicated (lightning_megatron.gpt.lora)."""
    params = []
    for i in range(num_layers):
        for target in HF_BLOCK:  # HF order: q, k, v, o, gate, up, down
            block = HF_BLOCK[target]
            column = target in COLUMN_TARGETS
            m = f"decoder.layers.{i}.{'self_attention' if block == 'self_attn' else 'mlp'}.{target}."
            for part, n_in, n_out in lora.adapted_parts(target, c):
                h = f"{PEFT_PREFIX}model.layers.{offset + i}.{block}.{part}."
                a_kind: Kind = "copy" if column else "cols"
                b_kind: Kind = "rows" if column else "copy"
                params.append(Param(f"{m}lora_A.{part}", ((h + "lora_A.weight", (lora.rank, n_in)),), a_kind))
                params.append(Param(f"{m}lora_B.{part}", ((h + "lora_B.weight", (n_out, lora.rank)),), b_kind))
    return params


def adapter_shapes(config: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a PEFT adapter's state dict for this model, in PEFT's order."""
    params = adapter_params(config, lora, offset=0, num_layers=config.num_layers)
    return {name: shape for p in params for name, shape in p.hf}


def hf_weight_shapes(config: ModelConfig, *, include_tied: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF state dict, in the order :func:`export_weights` yields them (HF's, except that
    Qwen2's q/k/v biases come after the three weights).

    With tied embeddings, ``lm_head.weight`` (the embedding again) is included only with ``include_tied``, as in
    ``model.state_dict()``; ``save_pretrained`` files leave it out.
    """
    params = chunk_params(config, pre=True, post=True, offset=0, num_layers=config.num_layers)
    shapes = {name: shape for p in params for name, shape in p.hf}
    if config.share_embeddings_and_output_weights and include_tied:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def combine(p: Param, parts: list[Tensor], c: ModelConfig, tp: int) -> Tensor:
    """This rank's shards of p's HF tensors -> its local Megatron tensor."""
    if p.kind == "qkv":
        groups, rest = c.effective_num_query_groups // tp, parts[0].shape[1:]
        # q [groups * heads_per_group * d, *rest], k and v [groups * d, *rest] -> per query group [q; k; v]
        per_group = [t.reshape(groups, -1, *rest) for t in parts]  # [groups, rows_per_group, *rest]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    if p.kind == "gate_up":
        return torch.cat(parts)  # [gate shard; up shard] on every rank
    return parts[0]


def split_local(p: Param, local: Tensor, c: ModelConfig, tp: int) -> list[Tensor]:
    """Inverse of :func:`combine`: one rank's local tensor -> its shards of p's HF tensors."""
    if p.kind == "qkv":
        groups, d, rest = c.effective_num_query_groups // tp, c.effective_kv_channels, local.shape[1:]
        q_rows = c.num_attention_heads // c.effective_num_query_groups * d
        view = local.reshape(groups, q_rows + 2 * d, *rest)  # per query group [its q heads; k; v]
        return [t.reshape(-1, *rest) for t in view.split([q_rows, d, d], dim=1)]
    if p.kind == "gate_up":
        return list(local.chunk(2))
    return [local]
