"""Checks of :class:`~lightning_megatron.gpt.config.ModelConfig` fields that are not specific to one feature family
(recomputation, CUDA graphs), kept apart so that the config stays a description. Each error names the field, its
value and what would work."""

from __future__ import annotations

from typing import Any

from lightning_megatron.validation import check_choice


def check_recompute(config: Any) -> None:
    """Raise ``ValueError`` for recompute settings Megatron rejects or would ignore."""
    # Mirrors TransformerConfig.__post_init__, plus rejecting settings Megatron would ignore.
    gran, method, n = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    check_choice("recompute_granularity", gran, ("full", "selective", None))
    check_choice("recompute_method", method, ("uniform", "block", None))
    if gran != "full":
        for name, value in (("recompute_method", method), ("recompute_num_layers", n)):
            if value is not None:
                raise ValueError(
                    f"{name}={value!r} only applies with recompute_granularity='full' "
                    f"(got recompute_granularity={gran!r}); set {name}=None or use 'full'"
                )
        return
    if method is None:
        raise ValueError(
            "recompute_method=None: recompute_granularity='full' needs recompute_method 'uniform' or 'block'"
        )
    if n is None or not 1 <= n <= config.num_layers:
        raise ValueError(
            f"recompute_num_layers={n!r}: recompute_granularity='full' needs recompute_num_layers "
            f"between 1 and num_layers={config.num_layers}"
        )


def check_cuda_graphs(config: Any) -> None:
    """Raise ``ValueError`` for a model Megatron's per-layer CUDA graphs cannot replay."""
    if not config.cuda_graphs:
        return
    if config.num_moe_experts is not None:
        raise ValueError(
            f"cuda_graphs=True with num_moe_experts={config.num_moe_experts}: the routed token counts change the "
            "experts' shapes every step, which fixed graphs cannot replay; use cuda_graphs=False for MoE models"
        )
    for name in ("hidden_dropout", "attention_dropout"):
        if getattr(config, name) > 0:
            raise ValueError(
                f"cuda_graphs=True with {name}={getattr(config, name)}: graphs captured in training replay their "
                f"dropout in validation too; use {name}=0.0 with cuda_graphs, or cuda_graphs=False"
            )
    if config.recompute_granularity is not None:
        raise ValueError(
            f"cuda_graphs=True with recompute_granularity={config.recompute_granularity!r}: Megatron's graphs of "
            "whole layers do not recompute; use recompute_granularity=None with cuda_graphs, or cuda_graphs=False"
        )
