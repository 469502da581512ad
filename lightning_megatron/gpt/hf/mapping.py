"""The weight tables of a running model: which HF tensors make each Megatron ``GPTModel`` parameter of a chunk, and
how they are split over tensor-parallel ranks. Each HF family's adapter (:mod:`lightning_megatron.gpt.hf.families`)
names its tensors; import (:mod:`lightning_megatron.gpt.hf.load`) and export (:mod:`lightning_megatron.gpt.hf.export`)
both read the tables here, so the two directions cannot disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_megatron.gpt.hf.families.base import Family
from lightning_megatron.gpt.hf.params import Param, expert_piece, lora_pair
from lightning_megatron.gpt.hf.registry import described, family_of
from lightning_megatron.gpt.lora.config import HF_BLOCK, is_column, layer_linears

if TYPE_CHECKING:
    from lightning_megatron.gpt.config import ModelConfig
    from lightning_megatron.gpt.lora.config import LoRAConfig

PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the HF model's own names in an adapter's state dict."""


def family(c: ModelConfig) -> Family:
    """The HF family adapter of a model; ValueError if no supported HF architecture holds it."""
    found = family_of(c)
    if found is None:
        raise ValueError(f"no supported HF architecture holds a model with {described(c)}")
    return found


def chunk_params(
    c: ModelConfig, *, pre: bool, post: bool, offset: int, num_layers: int, experts: range | None = None
) -> list[Param]:
    """The parameters of one chunk (local layer i is global layer ``offset + i``; ``experts``: the global indices
    of the experts this rank holds, None for all), in HF state-dict order."""
    return family(c).chunk_params(c, pre=pre, post=post, offset=offset, num_layers=num_layers, experts=experts)


def expert_ranges(c: ModelConfig, ep: int) -> list[range | None]:
    """The global expert indices each of ``ep`` expert-parallel ranks holds (Megatron's contiguous split); [None]
    for a dense model."""
    if c.num_moe_experts is None:
        return [None]
    n = c.num_moe_experts // ep
    return [range(r * n, (r + 1) * n) for r in range(ep)]


def adapter_params(c: ModelConfig, lora: LoRAConfig, *, offset: int, num_layers: int) -> list[Param]:
    """The LoRA factors of one chunk's layers as PEFT names them (``base_model.model.model.layers.0.self_attn.
    q_proj.lora_A.weight``), in PEFT's state-dict order. A column-parallel base's B is split like its rows and A
    replicated; a row-parallel base's A is split like its columns and B replicated (lightning_megatron.gpt.lora)."""
    params = []
    attention = [target for target in layer_linears(c) if HF_BLOCK[target] == "self_attn"]  # HF order: q, k, v, o
    for i in range(num_layers):
        h = f"{PEFT_PREFIX}model.layers.{offset + i}."
        for target in attention:
            for part, n_in, n_out in lora.adapted_parts(target, c):
                pair = lora_pair(f"decoder.layers.{i}.self_attention.{target}.", f"{h}self_attn.{part}.", part,
                                 lora.rank, (n_in, n_out), is_column(target))  # fmt: skip
                params += pair
        params += family(c).mlp_adapter_params(c, lora, f"decoder.layers.{i}.mlp.", f"{h}mlp.", offset + i)
    return params


def adapter_shapes(config: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a PEFT adapter's state dict for this model, in PEFT's order (the experts' pieces of one
    PEFT tensor as that tensor: :func:`~lightning_megatron.gpt.hf.params.expert_piece`)."""
    params = adapter_params(config, lora, offset=0, num_layers=config.num_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in (hf for p in params for hf in p.hf):
        whole, expert = expert_piece(name)
        if expert is None:
            shapes[name] = shape
        elif whole not in shapes:  # A [E * r, in] (experts' rows one after another), B [out, r * E]
            experts = config.num_moe_experts or 1
            shapes[whole] = (shape[0] * experts, shape[1]) if ".lora_A." in whole else (shape[0], shape[1] * experts)
    return shapes


def hf_weight_shapes(config: ModelConfig, *, include_tied: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF state dict, in the order :func:`export_weights` yields them (HF's, except that
    Qwen2's q/k/v biases come after the three weights).

    With tied embeddings, ``lm_head.weight`` (the embedding again) is included only with ``include_tied``, as in
    ``model.state_dict()``; ``save_pretrained`` files leave it out.
    """
    params = chunk_params(config, pre=True, post=True, offset=0, num_layers=config.num_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in (pair for p in params for pair in p.hf):
        whole, expert = expert_piece(name)  # one expert's piece of a tensor on fused experts (GPT-OSS)
        shapes[whole] = shape if expert is None else (config.num_moe_experts or 0, *shape)
    if config.share_embeddings_and_output_weights and include_tied:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes
