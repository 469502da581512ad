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
# Where each target's HF projections sit in an HF decoder layer (PEFT's module names are these).
HF_BLOCK = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
# The HF projections, each with the Megatron linear that holds it: targets for a part of a fused linear.
PROJECTIONS = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
}  # fmt: skip


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (``...linear_qkv.lora_A.q_proj``) is an adapter factor, not a base weight."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_parts(target: str, model: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """The HF projections that Megatron's ``target`` linear fuses, as (name, full input size, full output size),
    in Megatron's order within a group: one adapter each, as PEFT puts one on each HF projection."""
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
    PEFT's Llama default q_proj + v_proj, where k gets none)."""
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
        unknown = sorted(set(targets) - set(TARGETS) - set(PROJECTIONS))
        if unknown or not targets:
            raise ValueError(
                f"target_modules={list(targets)}: unknown {unknown or 'empty'}; pick from {list(TARGETS)} (whole "
                f"linears) or {list(PROJECTIONS)} (HF projections)"
            )
        object.__setattr__(self, "target_modules", targets)  # lists from YAML become tuples

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def adapts(self, target: str) -> bool:
        """Whether Megatron's ``target`` linear gets adapters (on all its projections or some)."""
        return target in self.target_modules or any(PROJECTIONS.get(t) == target for t in self.target_modules)

    def adapted_parts(self, target: str, model: ModelConfig) -> tuple[tuple[str, int, int], ...]:
        """The projections of ``target`` (see :func:`adapter_parts`) that get an adapter."""
        parts = adapter_parts(target, model)
        return parts if target in self.target_modules else tuple(p for p in parts if p[0] in self.target_modules)


def check_lora(lora: LoRAConfig, model: ModelConfig) -> None:
    """Raise ``ValueError`` for adapters the model (a ``ModelConfig``) cannot take."""
    if model.fp8 is not None:
        raise ValueError(
            f"LoRAConfig with ModelConfig(fp8={model.fp8!r}): the adapted linears run in bf16, not fp8; use fp8=None "
            "with LoRA"
        )
    attention = [t for t in lora.target_modules if HF_BLOCK[PROJECTIONS.get(t, t)] == "self_attn"]
    if model.multi_latent_attention and attention:
        raise ValueError(
            f"LoRAConfig(target_modules={list(lora.target_modules)}) adapts attention projections {attention} of a "
            "Multi-Latent Attention model, which LoRA does not support yet; target the MLP linears only: "
            "target_modules=('linear_fc1', 'linear_fc2') (dense layers, shared experts and experts)"
        )
    missing = [t for t in lora.target_modules if t in PROJECTIONS and t not in _names(PROJECTIONS[t], model)]
    if missing:
        raise ValueError(
            f"LoRAConfig(target_modules=...) names {missing}, which this model does not have (gated_linear_unit="
            f"{model.gated_linear_unit}: linear_fc1 holds {list(_names('linear_fc1', model))})"
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
    mlp = [t for t in lora.target_modules if HF_BLOCK[PROJECTIONS.get(t, t)] == "mlp"]
    return model.num_moe_experts is not None and bool(mlp)


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


def _names(target: str, model: ModelConfig) -> tuple[str, ...]:
    return tuple(name for name, _, _ in adapter_parts(target, model))
