"""Checks of :class:`~lightning_megatron.gpt.config.ModelConfig` fields that are not specific to one feature family
(recomputation, CUDA graphs, the tensor-parallel split, pipeline stages, sequence lengths), kept apart so that the
config stays a description. Each error names the field, its value and what would work."""

from __future__ import annotations

import math
from typing import Any

from lightning_megatron.validation import check_choice, divisors, next_multiple


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


def check_graph_layout(config: Any, pp: int, cp: int) -> None:
    """Raise ``ValueError`` for CUDA graphs with a layout they are not supported with."""
    # Megatron's graphs support both, but with PP its runners rotate per in-flight micro-batch (validation runs
    # other counts) and CP's document layout is per-batch state: refused until run on GPUs.
    for name, size in (("pp", pp), ("cp", cp)):
        if config.cuda_graphs and size > 1:
            raise ValueError(
                f"ModelConfig(cuda_graphs=True) with {name}={size}: CUDA graphs are supported here without "
                f"pipeline and context parallelism only; use {name}=1 with cuda_graphs, or cuda_graphs=False"
            )


def check_sequence(config: Any, tp: int, cp: int, sequence_parallel: bool) -> None:
    """Raise ``ValueError`` for a sequence length or kernel set the TP/CP layout cannot run."""
    # SP splits each CP shard over TP; CP load-balancing cuts the sequence into 2*cp chunks.
    multiple = math.lcm(tp * cp if sequence_parallel else 1, 2 * cp if cp > 1 else 1)
    if config.seq_length % multiple != 0:
        raise ValueError(
            f"seq_length={config.seq_length} must be divisible by {multiple} (tp={tp}, cp={cp}, "
            f"sequence_parallel={sequence_parallel}); use seq_length={next_multiple(config.seq_length, multiple)}"
        )
    if cp > 1 and config.kernels == "local":
        raise ValueError(
            f"cp={cp} with kernels='local': Megatron's reference attention (DotProductAttention) asserts cp == 1; "
            "use kernels='torch' (SDPA with K/V all-gathered over the CP group) or 'auto'"
        )
    if cp > 1 and config.moe_enable_routing_replay:
        raise ValueError(
            f"cp={cp} with moe_enable_routing_replay=True: recorded routing covers whole rows, and each CP rank "
            "routes only its chunks of them; use cp=1 with routing replay"
        )


def check_tensor_split(config: Any, tp: int) -> None:
    """Whole attention heads, key/value heads and vocabulary rows per tensor-parallel rank."""
    heads, groups = config.num_attention_heads, config.effective_num_query_groups
    if heads % tp != 0:
        raise ValueError(f"num_attention_heads={heads} must be divisible by tp={tp}; pick tp among {divisors(heads)}")
    # Megatron also accepts tp a multiple of num_query_groups (KV heads replicated through an
    # all-gather); we require whole KV heads per rank so checkpoint conversion stays a plain split.
    if groups % tp != 0:
        raise ValueError(
            f"num_query_groups={groups} (effective) must be divisible by tp={tp}; pick tp among {divisors(groups)}"
        )
    if config.vocab_size % tp != 0:
        raise ValueError(
            f"vocab_size={config.vocab_size} must be divisible by tp={tp} (vocab-parallel embedding splits "
            f"rows evenly); pad vocab_size to {next_multiple(config.vocab_size, tp)}"
        )


def check_stages(config: Any, pp: int, vpp: int | None) -> None:
    """The same number of layers in every pipeline model chunk, and activation recompute within one."""
    stages = pp * (vpp or 1)
    if config.num_layers % stages != 0:
        lower = config.num_layers // stages * stages
        would_work = [n for n in (lower, lower + stages) if n > 0]
        raise ValueError(
            f"num_layers={config.num_layers} must be divisible by pp*vpp={pp}*{vpp or 1}={stages} (every "
            f"model chunk gets the same number of layers); num_layers among {would_work} would work, "
            f"or pick pp*vpp among {divisors(config.num_layers)}"
        )
    per_chunk = config.num_layers // stages
    n = config.recompute_num_layers
    if n is not None and n > per_chunk:
        raise ValueError(
            f"recompute_num_layers={n} exceeds the {per_chunk} layers per model chunk with "
            f"pp={pp}, vpp={vpp}; pick recompute_num_layers among 1..{per_chunk}"
        )
