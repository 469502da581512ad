"""``LoRAConfig``: which linears get low-rank adapters, and their rank, scale and dropout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_megatron.gpt.config import ModelConfig

from lightning_megatron.validation import check_positive_int

# Megatron's names of the transformer layer's linears (HF: q/k/v_proj fused in linear_qkv, o_proj, gate/up_proj
# fused in linear_fc1, down_proj): the column-parallel ones and the row-parallel ones.
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ROW_TARGETS = ("linear_proj", "linear_fc2")
TARGETS = COLUMN_TARGETS + ROW_TARGETS
# Multi-Latent Attention's column-parallel projections that take adapters (one HF projection each): the direct query
# projection (q_lora_rank=None) or the query latent's up projection, and the key/value latent's up projection. An MLA
# model has no linear_qkv, so that name (of the default targets) stands for all of these there.
MLA_TARGETS = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
# MLA's down projections (column-parallel too, their outputs gathered over TP): adapted only where named, so that
# linear_qkv (of the default targets) keeps meaning the projections above.
MLA_DOWN_TARGETS = ("linear_q_down_proj", "linear_kv_down_proj")
# Where each target's HF projections sit in an HF decoder layer (PEFT's module names are these).
HF_BLOCK = {
    **dict.fromkeys(("linear_qkv", "linear_proj", *MLA_TARGETS, *MLA_DOWN_TARGETS), "self_attn"), "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}  # fmt: skip
# The HF projections, each with the Megatron linear that holds it: targets for a part of a fused linear.
PROJECTIONS = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
}  # fmt: skip
# The same for an MLA model's attention (its MLP's are PROJECTIONS').
MLA_PROJECTIONS = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj",
                   "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_b_proj": "linear_kv_up_proj",
                   "o_proj": "linear_proj"}  # fmt: skip
NAMES = tuple(dict.fromkeys((*TARGETS, *MLA_TARGETS, *MLA_DOWN_TARGETS, *PROJECTIONS, *MLA_PROJECTIONS)))
"""Every name ``target_modules`` takes (which of them a model has: :func:`check_lora`)."""


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (``...linear_qkv.lora_A.q_proj``) is an adapter factor, not a base weight."""
    return ".lora_A." in name or ".lora_B." in name


def layer_linears(model: ModelConfig) -> tuple[str, ...]:
    """Megatron's linears of ``model``'s decoder layers that can take adapters, in HF's order of their projections."""
    if not model.multi_latent_attention:
        return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    query = ("linear_q_proj",) if model.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return (*query, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")


def is_column(target: str) -> bool:
    """Whether Megatron's ``target`` linear is column-parallel (its rows split over TP), not row-parallel."""
    return target not in ROW_TARGETS


def adapter_parts(target: str, model: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """The HF projections that Megatron's ``target`` linear fuses, as (name, full input size, full output size),
    in Megatron's order within a group: one adapter each, as PEFT puts one on each HF projection."""
    if model.multi_latent_attention and HF_BLOCK[target] == "self_attn":
        return (_mla_part(target, model),)
    hidden, d, ffn = model.hidden_size, model.effective_kv_channels, model.effective_ffn_hidden_size
    q, kv = model.num_attention_heads * d, model.effective_num_query_groups * d
    if target == "linear_qkv":
        return (("q_proj", hidden, q), ("k_proj", hidden, kv), ("v_proj", hidden, kv))
    if target == "linear_proj":
        return (("o_proj", q, hidden),)
    if target == "linear_fc1":
        gated = model.gated_linear_unit
        return (("gate_proj", hidden, ffn), ("up_proj", hidden, ffn)) if gated else (("up_proj", hidden, ffn),)
    return (("down_proj", ffn, hidden),)


def _mla_part(target: str, model: ModelConfig) -> tuple[str, int, int]:
    """An MLA projection's HF name and full sizes (the output projection reads heads * v_head_dim values; the key/value
    down projection writes the latent and the shared RoPE key)."""
    heads, hidden = model.num_attention_heads, model.hidden_size
    query = heads * (model.qk_head_dim + model.qk_pos_emb_head_dim)
    parts = {
        "linear_q_proj": ("q_proj", hidden, query),
        "linear_q_down_proj": ("q_a_proj", hidden, model.q_lora_rank or 0),
        "linear_q_up_proj": ("q_b_proj", model.q_lora_rank or 0, query),
        "linear_kv_down_proj": ("kv_a_proj_with_mqa", hidden, model.kv_lora_rank + model.qk_pos_emb_head_dim),
        "linear_kv_up_proj": ("kv_b_proj", model.kv_lora_rank, heads * (model.qk_head_dim + model.v_head_dim)),
        "linear_proj": ("o_proj", heads * model.v_head_dim, hidden),
    }
    if target not in parts:
        raise ValueError(f"{target} is not a linear of Multi-Latent Attention (it has {sorted(parts)})")
    return parts[target]


@dataclass(kw_only=True, frozen=True)
class LoRAConfig:
    """Low-rank adapters ``W x + (alpha / rank) B A dropout(x)`` on the chosen linears; the base model is frozen."""

    rank: int = 8
    """Rank r of each adapter (A: [r, in], B: [out, r])."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (as in PEFT)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (the base path sees the input unchanged)."""
    target_modules: tuple[str, ...] = TARGETS
    """What gets adapters: Megatron's linears (linear_qkv, linear_proj, linear_fc1, linear_fc2: every HF projection
    each fuses) and/or single HF projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; e.g.
    PEFT's Llama default q_proj + v_proj, where k gets none). On a Multi-Latent Attention model linear_qkv adapts
    the query/key/value projections after the latents -- linear_q_up_proj (HF q_b_proj) or, with q_lora_rank=None,
    linear_q_proj (q_proj), and linear_kv_up_proj (kv_b_proj) -- which may also be named alone; its down projections
    linear_q_down_proj (q_a_proj) and linear_kv_down_proj (kv_a_proj_with_mqa) are adapted where named."""
    seed: int = 0
    """Seed of A's Kaiming-uniform initialisation (B starts at zero), drawn per layer and linear from the full
    unsharded shape, so every parallel layout builds the same adapters."""

    def __post_init__(self) -> None:
        check_positive_int("rank", self.rank)
        if not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha} must be positive (often 2 * rank; PEFT's default is 8)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        targets = tuple(self.target_modules)
        unknown = sorted(set(targets) - set(NAMES))
        if unknown or not targets:
            raise ValueError(
                f"target_modules={list(targets)}: unknown {unknown or 'empty'}; pick from {list(TARGETS)} (whole "
                f"linears) or {list(PROJECTIONS)} (HF projections), or on a Multi-Latent Attention model "
                f"{[*MLA_TARGETS, *MLA_DOWN_TARGETS]} / {list(MLA_PROJECTIONS)}"
            )
        object.__setattr__(self, "target_modules", targets)  # lists from YAML become tuples

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def adapts(self, target: str) -> bool:
        """Whether Megatron's ``target`` linear gets adapters (on all its projections or some)."""
        names = self.target_modules
        if target in MLA_TARGETS and "linear_qkv" in names:
            return True
        holders = {PROJECTIONS.get(t) for t in names} | {MLA_PROJECTIONS.get(t) for t in names}
        return target in names or target in holders

    def adapted_parts(self, target: str, model: ModelConfig) -> tuple[tuple[str, int, int], ...]:
        """The projections of ``target`` (see :func:`adapter_parts`) that get an adapter."""
        parts = adapter_parts(target, model)
        whole = target in self.target_modules or (target in MLA_TARGETS and "linear_qkv" in self.target_modules)
        return parts if whole else tuple(p for p in parts if p[0] in self.target_modules)


def check_lora(lora: LoRAConfig, model: ModelConfig) -> None:
    """Raise ``ValueError`` for adapters the model (a ``ModelConfig``) cannot take."""
    if model.fp8 is not None:
        raise ValueError(
            f"LoRAConfig with ModelConfig(fp8={model.fp8!r}): the adapted linears run in bf16, not fp8; use fp8=None "
            "with LoRA"
        )
    holds = {linear: [part for part, _, _ in adapter_parts(linear, model)] for linear in layer_linears(model)}
    has = {"linear_qkv", *holds, *(part for parts in holds.values() for part in parts)}
    if missing := [t for t in lora.target_modules if t not in has]:
        mla = model.multi_latent_attention
        kind = f"multi_latent_attention={mla}" + (f", q_lora_rank={model.q_lora_rank}" if mla else "")
        qkv = f" ('linear_qkv' names {[t for t in holds if t in MLA_TARGETS]})" if mla else ""
        raise ValueError(
            f"LoRAConfig(target_modules=...) names {missing}, which this model does not have ({kind}, "
            f"gated_linear_unit={model.gated_linear_unit}): its linears that take adapters, and the HF projections "
            f"each holds, are {holds}{qkv}"
        )
    if adapts_experts(lora, model) and model.gated_linear_unit and lora.adapts("linear_fc1"):
        fc1 = set(lora.target_modules) & {"linear_fc1", "gate_proj", "up_proj"}
        if fc1 in ({"gate_proj"}, {"up_proj"}):
            raise ValueError(
                f"LoRAConfig(target_modules=...) names {sorted(fc1)} alone on an MoE model: each expert's gate and up "
                "projections share one adapter (as PEFT's on HF's fused experts.gate_up_proj); target 'linear_fc1' "
                "(or both 'gate_proj' and 'up_proj')"
            )


def adapts_experts(lora: LoRAConfig, model: ModelConfig) -> bool:
    """Whether ``lora`` adapts an MoE model's experts (any MLP target; lightning_megatron.gpt.lora.experts)."""
    return model.num_moe_experts is not None and (lora.adapts("linear_fc1") or lora.adapts("linear_fc2"))


def check_lora_parallel(lora: LoRAConfig, model: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` for dropout on expert adapters under tensor parallelism: the experts' tensor-parallel
    ranks share their tokens (each holds part of every expert), and independent masks would give each rank's part
    another dropped input."""
    if tp > 1 and lora.dropout > 0 and adapts_experts(lora, model):
        raise ValueError(
            f"LoRAConfig(dropout={lora.dropout}) on the experts of an MoE model (target_modules="
            f"{list(lora.target_modules)}) with tp={tp}: the experts' tensor-parallel ranks would drop different "
            "inputs of the same tokens; use dropout=0.0, or tp=1 (expert and data parallelism split MoE models)"
        )
