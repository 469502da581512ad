"""``LoRAConfig``: which linears get low-rank adapters, and their rank, scale and dropout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_megatron.config import ModelConfig

from lightning_megatron.validation import check_positive_int

# Megatron's names of the transformer layer's linears (HF: q/k/v_proj fused in linear_qkv, o_proj, gate/up_proj
# fused in linear_fc1, down_proj): the column-parallel ones and the row-parallel ones.
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ROW_TARGETS = ("linear_proj", "linear_fc2")
TARGETS = COLUMN_TARGETS + ROW_TARGETS


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
    """Megatron names of the linears that get adapters: any of linear_qkv, linear_proj, linear_fc1, linear_fc2."""
    seed: int = 0
    """Seed of A's Kaiming-uniform initialisation (B starts at zero), drawn per layer and linear from the full
    unsharded shape, so every parallel layout builds the same adapters."""

    def __post_init__(self) -> None:
        check_positive_int("rank", self.rank)
        if not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha} must be positive (PEFT's default is 2 * rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        targets = tuple(self.target_modules)
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown or not targets:
            raise ValueError(f"target_modules={list(targets)}: unknown {unknown or 'empty'}; pick from {list(TARGETS)}")
        object.__setattr__(self, "target_modules", targets)  # lists from YAML become tuples

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def check_lora(lora: LoRAConfig, model: ModelConfig) -> None:
    """Raise ``ValueError`` for adapters the model (a ``ModelConfig``) cannot take."""
    if model.fp8 is not None:
        raise ValueError(
            f"LoRAConfig with ModelConfig(fp8={model.fp8!r}): the adapted linears run in bf16, not fp8; use fp8=None "
            "with LoRA"
        )
    mlp = sorted(set(lora.target_modules) & {"linear_fc1", "linear_fc2"})
    if model.num_moe_experts is not None and mlp:
        raise ValueError(
            f"LoRAConfig(target_modules=...) targets {mlp} of an MoE model (num_moe_experts={model.num_moe_experts}):"
            " adapters on experts are not supported; use target_modules=('linear_qkv', 'linear_proj')"
        )
