"""What every HF family adapter has: :class:`Family`, whose subclasses (one module each) say how their HF config maps
to :class:`~lightning_megatron.ModelConfig` fields and how their weights are named, and get ``to_hf``/``from_hf``
(whole state dicts, one process) and the sharded tables that import and export read.

The decoder-only layout common to all of them (embedding, final norm, LM head, attention, norms) lives here; a family
overrides what differs: biases, q/k norms, the MLP (dense or experts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_megatron.gpt.hf.params import (
    HFTensor,
    ModelShape,
    Param,
    combine,
    expert_piece,
    join_pieces,
    lora_pair,
    piece_of,
    qkv,
    split_local,
)


class Family:
    """One HF architecture family (e.g. Llama and Mistral, which name and shape their weights alike)."""

    architectures: ClassVar[tuple[str, ...]]
    """The ``architectures`` entries of config.json this family reads."""
    model_types: ClassVar[tuple[str, ...]]
    """config.json's ``model_type`` of each of :attr:`architectures` (for a config that names no architecture)."""
    export_architecture: ClassVar[str]
    """The architecture written into a generated config.json (a model that was not loaded from HF)."""
    config_class: ClassVar[str]
    """The transformers config class of :attr:`export_architecture`."""
    latent_attention: ClassVar[bool] = False
    """Whether the family's attention is Multi-Latent Attention (its models have ``multi_latent_attention=True``)."""
    own_rope: ClassVar[bool] = False
    """Whether :meth:`fields` maps the RoPE settings itself (MLA's), instead of the shared mapping."""
    partial_rope: ClassVar[bool] = False
    """Whether the family's HF attention rotates only the first ``partial_rotary_factor`` of each head (rotate-half,
    as Megatron's ``rotary_percent``); elsewhere HF's factor is refused, and so is ``rotary_percent`` on export."""
    qkv_attention_bias: ClassVar[bool] = False
    """Whether HF's ``attention_bias`` means q/k/v biases only (mapped by :meth:`fields`); elsewhere it also puts a
    bias on ``o_proj``, which Megatron's attention does not have, and is refused."""
    windowed: ClassVar[bool] = False
    """Whether :meth:`fields` maps HF's ``sliding_window`` to ``window_size``; elsewhere a window caps seq_length."""
    gemma_layout: ClassVar[bool] = False
    """Whether the family's models have Gemma's settings (:func:`lightning_megatron.gpt.gemma.gemma_layout`); only
    such families hold such models."""
    linear_biases: ClassVar[bool] = False
    """Whether the family's layers have a bias on every linear (GPT-OSS: ``add_bias_linear``); only such families
    hold such models."""
    yarn_rope: ClassVar[bool] = False
    """Whether the family's HF config writes YaRN RoPE (``position_embedding_type='yarn'``) on export."""
    mxfp4_weights: ClassVar[tuple[str, ...]] = ()
    """Suffixes of the HF weights the family's MXFP4 checkpoints store as blocks and scales
    (:mod:`lightning_megatron.gpt.hf.mxfp4`; GPT-OSS: its experts' two projections); such checkpoints of a family
    without any are refused."""
    sigmoid_router: ClassVar[bool] = False
    """Whether the family's router is DeepSeek-V3's sigmoid router (expert bias, groups, scaling factor); elsewhere
    those router settings are refused on export."""

    # ------------------------------------------------------------------------------------------- config
    def fields(self, hf: Any) -> dict[str, Any]:
        """The ModelConfig fields specific to this family, from its HF ``PretrainedConfig`` (the shared ones --
        sizes, norms, RoPE -- come from :mod:`lightning_megatron.gpt.hf.fields`). Raise ValueError for an HF
        setting the model cannot express, naming it."""
        return {"add_qkv_bias": False, "qk_layernorm": False}

    def matches(self, c: ModelShape) -> bool:
        """Whether this family's HF architecture can hold a model of config ``c`` (export picks the one that does)."""
        return not c.add_qkv_bias and not c.qk_layernorm and c.num_moe_experts is None

    def skipped(self, name: str, hf: Any) -> bool:
        """Whether import leaves out checkpoint tensor ``name`` that the model has no place for (HF config ``hf``)."""
        return False

    def hf_config_kwargs(self, c: ModelShape) -> dict[str, Any]:
        """Keyword arguments of :attr:`config_class` specific to this family (export of a generated config)."""
        return {}

    # ------------------------------------------------------------------------------------------- weights
    def chunk_params(
        self, c: ModelShape, *, pre: bool, post: bool, offset: int, num_layers: int, experts: range | None = None
    ) -> list[Param]:
        """The parameters of one model chunk (local layer i is global layer ``offset + i``), in HF state-dict
        order: the embedding on the first stage, the final norm and LM head on the last. ``experts``: the global
        indices of this expert-parallel rank's experts (None: all of them)."""
        embed = ("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        params = [Param("embedding.word_embeddings.weight", (embed,), "rows")] if pre else []
        for i in range(num_layers):
            params += self.layer_params(c, i, offset + i, experts)
        if post:
            params.append(Param("decoder.final_layernorm.weight", (("model.norm.weight", (c.hidden_size,)),), "copy"))
            tied = c.share_embeddings_and_output_weights
            # Tied: a stage without the embedding keeps its own copy of it as output_layer.weight.
            if not (tied and pre):
                head = embed if tied else ("lm_head.weight", (c.vocab_size, c.hidden_size))
                params.append(Param("output_layer.weight", (head,), "rows"))
        return params

    def layer_params(self, c: ModelShape, local: int, layer: int, experts: range | None = None) -> list[Param]:
        """Decoder layer ``layer`` (the chunk's ``local``-th): attention, MLP, then the two norms, as HF orders them."""
        m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
        norms = [Param(m + "input_layernorm.weight", ((h + "input_layernorm.weight", (c.hidden_size,)),), "copy")]
        post_norm = ((h + "post_attention_layernorm.weight", (c.hidden_size,)),)
        norms.append(Param(m + "pre_mlp_layernorm.weight", post_norm, "copy"))
        mlp = self.mlp_params(c, m, h, layer, experts)
        return [*self.attention_params(c, m, h + "self_attn."), *mlp, *norms]

    def attention_params(self, c: ModelShape, m: str, att: str) -> list[Param]:
        """Fused q/k/v (with their biases when ``add_qkv_bias``), the output projection, q/k norms when
        ``qk_layernorm``."""
        hidden, d = c.hidden_size, c.effective_kv_channels
        params = [Param(m + "self_attention.linear_qkv.weight", qkv(att, "weight", c, (hidden,)), "qkv")]
        if c.add_qkv_bias:
            params.append(Param(m + "self_attention.linear_qkv.bias", qkv(att, "bias", c, ()), "qkv"))
        o_proj = ((att + "o_proj.weight", (hidden, c.num_attention_heads * d)),)
        params.append(Param(m + "self_attention.linear_proj.weight", o_proj, "cols"))
        if c.qk_layernorm:
            params.append(Param(m + "self_attention.q_layernorm.weight", ((att + "q_norm.weight", (d,)),), "copy"))
            params.append(Param(m + "self_attention.k_layernorm.weight", ((att + "k_norm.weight", (d,)),), "copy"))
        return params

    def mlp_params(self, c: ModelShape, m: str, h: str, layer: int, experts: range | None) -> list[Param]:
        """A dense SwiGLU MLP: HF's gate/up projections fused in linear_fc1, down_proj as linear_fc2."""
        return dense_mlp(m + "mlp.", h + "mlp.", c.hidden_size, c.effective_ffn_hidden_size)

    def mlp_adapter_params(self, c: Any, lora: Any, m: str, h: str, layer: int) -> list[Param]:
        """The LoRA factors of layer ``layer``'s MLP (Megatron prefix ``m``, PEFT prefix ``h``: ``...mlp.``), one
        adapter per adapted HF projection (``lora``: a :class:`~lightning_megatron.LoRAConfig`)."""
        return dense_adapters(c, lora, m, h, c.effective_ffn_hidden_size)

    # ------------------------------------------------------------------------------------------- whole models
    def to_hf(self, state_dict: Mapping[str, Tensor], c: ModelShape) -> dict[str, Tensor]:
        """A whole model's Megatron ``GPTModel`` state dict (one process: no TP/PP/EP shards) -> the HF state dict,
        in HF's order (a tied ``lm_head.weight`` left out, as ``save_pretrained`` does)."""
        out: dict[str, Tensor | None] = {}
        pieces: dict[str, dict[int, Tensor]] = {}  # one expert's piece of a tensor on fused experts (GPT-OSS)
        for p in self.chunk_params(c, pre=True, post=True, offset=0, num_layers=c.num_layers):
            local = state_dict[p.megatron] if p.expert is None else state_dict[p.megatron][p.expert]
            for name, tensor in zip([name for name, _ in p.hf], split_local(p, local, c, 1), strict=True):
                whole, expert = expert_piece(name)
                if expert is None:
                    out[name] = tensor
                else:
                    out.setdefault(whole, None)  # its place in HF's order
                    pieces.setdefault(whole, {})[expert] = tensor
        for whole, parts in pieces.items():
            out[whole] = join_pieces(whole, [parts[i] for i in sorted(parts)])
        return {name: tensor for name, tensor in out.items() if tensor is not None}

    def from_hf(self, hf_state_dict: Mapping[str, Tensor], c: ModelShape) -> dict[str, Tensor]:
        """The HF state dict -> the Megatron ``GPTModel`` parameters of a whole model (one process). Non-parameter
        entries (rotary buffers, ``_extra_state``) are not included: load with ``strict=False``."""
        out: dict[str, Tensor] = {}
        experts: dict[str, dict[int, Tensor]] = {}

        def hf_tensor(name: str) -> Tensor:
            whole, expert = expert_piece(name)
            if expert is None:
                return hf_state_dict[name]
            return piece_of(whole, hf_state_dict[whole], expert, c.num_moe_experts or 1)

        for p in self.chunk_params(c, pre=True, post=True, offset=0, num_layers=c.num_layers):
            local = combine(p, [hf_tensor(name) for name, _ in p.hf], c, 1)
            if p.expert is None:
                out[p.megatron] = local
            else:
                experts.setdefault(p.megatron, {})[p.expert] = local
        for name, slices in experts.items():  # stacked expert weights: [num_experts, out, in]
            out[name] = torch.stack([slices[i] for i in sorted(slices)])
        return out


def dense_adapters(c: Any, lora: Any, m: str, h: str, ffn: int) -> list[Param]:
    """The adapters of a dense SwiGLU MLP of hidden size ``ffn`` under Megatron prefix ``m`` and PEFT prefix ``h``
    (a dense layer's, or an MoE layer's shared expert: HF's ``gate_proj`` / ``up_proj`` / ``down_proj``)."""
    params: list[Param] = []
    for target in ("linear_fc1", "linear_fc2"):
        for part, _, _ in lora.adapted_parts(target, c):
            sizes = (c.hidden_size, ffn) if target == "linear_fc1" else (ffn, c.hidden_size)
            params += lora_pair(f"{m}{target}.", f"{h}{part}.", part, lora.rank, sizes, target == "linear_fc1")
    return params


def dense_mlp(
    m: str, h: str, hidden: int, ffn: int, names: tuple[str, str, str] = ("gate", "up", "down")
) -> list[Param]:
    """A SwiGLU MLP under Megatron prefix ``m`` (``...mlp.``) from HF's ``{h}{gate}_proj`` / up / down (or, with
    ``names`` of full names such as Mixtral's ``("w1", "w3", "w2")``, ``{h}{name}``)."""
    gate, up, down = (n if n.startswith("w") else f"{n}_proj" for n in names)
    gate_up: tuple[HFTensor, ...] = ((f"{h}{gate}.weight", (ffn, hidden)), (f"{h}{up}.weight", (ffn, hidden)))
    return [
        Param(m + "linear_fc1.weight", gate_up, "gate_up"),
        Param(m + "linear_fc2.weight", ((f"{h}{down}.weight", (hidden, ffn)),), "cols"),
    ]
