"""Checks of the mixture-of-experts fields of :class:`~lightning_megatron.gpt.config.ModelConfig`, before any build.

Each check mirrors what Megatron-Core 0.19's ``TransformerConfig.__post_init__`` rejects (often with a bare assert,
after the process groups exist), plus settings Megatron would silently ignore: a router setting on a dense model, a
coefficient for a loss type that is off, ``moe_router_pre_softmax`` with sigmoid scores. Every error names the field,
its value and what would work. This module reads a config through :class:`MoERequest` (it imports no config);
:func:`build_with_expert_biases` builds Megatron's config of an MoE model with expert biases.
"""

from __future__ import annotations

from typing import Any, Protocol

from lightning_megatron.validation import check_choice, check_positive_int, divisors

__all__ = [
    "MOE_DEFAULTS",
    "MoEParallelRequest",
    "MoERequest",
    "build_with_expert_biases",
    "check_moe",
    "check_moe_parallel",
    "moe_layer_pattern",
]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

# The MoE-only fields and their defaults: a dense model (num_moe_experts=None) must leave them so.
MOE_DEFAULTS: dict[str, Any] = {
    "moe_ffn_hidden_size": None,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_scaling_factor": None,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_layer_freq": 1,
    "moe_grouped_gemm": None,
}


class MoERequest(Protocol):
    """The ``ModelConfig`` fields checked here."""

    num_layers: int
    num_moe_experts: int | None
    moe_router_topk: int
    moe_router_pre_softmax: bool
    moe_router_score_function: str
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    moe_router_num_groups: int | None
    moe_router_group_topk: int | None
    moe_router_topk_scaling_factor: float | None
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    moe_z_loss_coeff: float | None
    moe_shared_expert_intermediate_size: int | None
    moe_shared_expert_gate: bool
    moe_layer_freq: int | tuple[int, ...]
    moe_grouped_gemm: bool | None
    add_bias_linear: bool
    kernels: str


def moe_layer_pattern(num_layers: int, freq: int | tuple[int, ...]) -> tuple[bool, ...]:
    """Whether each (0-based, global) layer is an MoE layer, with Megatron's ``moe_layer_freq`` semantics: an int
    ``k`` makes layer ``i`` MoE iff ``i % k == 0``; a tuple gives 0/1 per layer."""
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(num_layers))
    return tuple(bool(flag) for flag in freq)


def check_moe(config: MoERequest) -> None:
    """Raise ``ValueError`` for an MoE setting Megatron rejects or would ignore (see the module docstring)."""
    check_positive_int("moe_router_topk", config.moe_router_topk)
    check_choice("moe_router_score_function", config.moe_router_score_function, SCORE_FUNCTIONS)
    check_choice("moe_router_load_balancing_type", config.moe_router_load_balancing_type, LOAD_BALANCING_TYPES)
    if config.num_moe_experts is None:
        _check_dense(config)
        return
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if experts < 2:
        raise ValueError(f"num_moe_experts={experts} must be >= 2 (routing chooses among experts); or None for dense")
    if topk > experts:
        raise ValueError(
            f"moe_router_topk={topk} must be <= num_moe_experts={experts}; pick moe_router_topk among 1..{experts}"
        )
    _check_scores(config)
    _check_groups(config)
    _check_losses(config)
    _check_layers(config)


def _check_dense(config: MoERequest) -> None:
    for name, default in MOE_DEFAULTS.items():
        value = getattr(config, name)
        if value != default:
            raise ValueError(
                f"{name}={value!r} needs an MoE model, and num_moe_experts=None is dense (no router, no experts); "
                f"set num_moe_experts or leave {name}={default!r}"
            )


def _check_scores(config: MoERequest) -> None:
    score, pre_softmax, topk = config.moe_router_score_function, config.moe_router_pre_softmax, config.moe_router_topk
    if pre_softmax and score != "softmax":
        raise ValueError(
            f"moe_router_pre_softmax=True with moe_router_score_function={score!r}: Megatron ignores it there (the k "
            "chosen sigmoid scores are renormalised whenever moe_router_topk > 1); use moe_router_pre_softmax=False"
        )
    # Megatron's own rule: a softmax over the one chosen logit is always 1, so the router would get no gradient.
    if topk == 1 and score == "softmax" and not pre_softmax:
        raise ValueError(
            "moe_router_topk=1 with moe_router_score_function='softmax' and moe_router_pre_softmax=False: a softmax "
            "over the one chosen logit is always 1 (the router gets no gradient); set moe_router_pre_softmax=True "
            "(softmax over all experts, then top-1), moe_router_score_function='sigmoid', or moe_router_topk >= 2"
        )
    if config.moe_router_enable_expert_bias and score != "sigmoid":
        raise ValueError(
            f"moe_router_enable_expert_bias=True with moe_router_score_function={score!r}: Megatron's aux-loss-free "
            "expert bias works on sigmoid scores only (DeepSeek-V3); set moe_router_score_function='sigmoid'"
        )
    rate = config.moe_router_bias_update_rate
    if config.moe_router_enable_expert_bias and not (isinstance(rate, int | float) and rate >= 0):
        raise ValueError(
            f"moe_router_bias_update_rate={rate!r} must be >= 0 (DeepSeek-V3 uses 1e-3; 0 keeps the bias as loaded)"
        )
    if not config.moe_router_enable_expert_bias and rate != MOE_DEFAULTS["moe_router_bias_update_rate"]:
        raise ValueError(
            f"moe_router_bias_update_rate={rate!r} only applies with moe_router_enable_expert_bias=True; "
            "set moe_router_enable_expert_bias=True or leave moe_router_bias_update_rate=0.001"
        )
    factor = config.moe_router_topk_scaling_factor
    if factor is not None and not (isinstance(factor, int | float) and factor > 0):
        raise ValueError(f"moe_router_topk_scaling_factor={factor!r} must be > 0 (e.g. 2.5), or None for no scaling")


def _check_groups(config: MoERequest) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    experts, topk = config.num_moe_experts or 0, config.moe_router_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        missing = "moe_router_num_groups" if groups is None else "moe_router_group_topk"
        given = "moe_router_group_topk" if groups is None else "moe_router_num_groups"
        raise ValueError(
            f"{given}={group_topk if groups is None else groups} without {missing}: group-limited routing needs both "
            f"(Megatron asserts the first, ignores the second alone); set {missing} or {given}=None"
        )
    check_positive_int("moe_router_num_groups", groups)
    check_positive_int("moe_router_group_topk", group_topk)
    if experts % groups != 0:
        raise ValueError(
            f"moe_router_num_groups={groups} must divide num_moe_experts={experts}; pick it among {divisors(experts)}"
        )
    if group_topk > groups:
        raise ValueError(f"moe_router_group_topk={group_topk} must be <= moe_router_num_groups={groups}")
    # Megatron scores each group by the sum of its top (topk // group_topk) experts and then takes the top-k among
    # the chosen groups' experts: fewer than k there would route tokens to masked-out (-inf) experts.
    per_group = experts // groups
    if group_topk > topk or topk // group_topk > per_group or group_topk * per_group < topk:
        raise ValueError(
            f"moe_router_group_topk={group_topk} with moe_router_num_groups={groups} ({per_group} experts each) and "
            f"moe_router_topk={topk}: each token needs group_topk <= topk, topk // group_topk <= experts per group, "
            f"and topk <= group_topk * experts per group; pick moe_router_group_topk among "
            f"{[g for g in range(1, groups + 1) if g <= topk and topk // g <= per_group and g * per_group >= topk]}"
        )


def _check_losses(config: MoERequest) -> None:
    coeff, kind, z = config.moe_aux_loss_coeff, config.moe_router_load_balancing_type, config.moe_z_loss_coeff
    if not (isinstance(coeff, int | float) and coeff >= 0):
        raise ValueError(f"moe_aux_loss_coeff={coeff!r} must be >= 0 (e.g. 1e-2; 0 turns the load-balancing loss off)")
    if coeff > 0 and kind == "none":
        raise ValueError(
            f"moe_aux_loss_coeff={coeff} with moe_router_load_balancing_type='none': no loss would be weighted; "
            "pick 'aux_loss', 'seq_aux_loss' or 'global_aux_loss', or moe_aux_loss_coeff=0.0"
        )
    # 0.0 is not "off" in Megatron: it computes the z-loss and logs it divided by its coefficient (NaN).
    if z is not None and not (isinstance(z, int | float) and z > 0):
        raise ValueError(f"moe_z_loss_coeff={z!r} must be > 0 (e.g. 1e-3), or None to turn the z-loss off")
    size = config.moe_shared_expert_intermediate_size
    if size is not None:
        check_positive_int("moe_shared_expert_intermediate_size", size)
    if config.moe_shared_expert_gate and size is None:
        raise ValueError(
            "moe_shared_expert_gate=True gates the shared expert, and moe_shared_expert_intermediate_size=None builds "
            "none; set moe_shared_expert_intermediate_size (e.g. Qwen2-MoE's shared_expert_intermediate_size)"
        )
    if config.moe_grouped_gemm not in (None, True, False):
        raise ValueError(f"moe_grouped_gemm={config.moe_grouped_gemm!r} must be None (auto), True or False")
    if config.add_bias_linear and config.kernels == "te":  # the biases are added by our grouped experts' forward
        raise ValueError(
            "kernels='te' with experts that have biases (num_moe_experts with add_bias_linear=True, as GPT-OSS has): "
            "they run on the torch-native grouped experts only; use kernels='torch' or 'auto'"
        )


def _check_layers(config: MoERequest) -> None:
    freq, n = config.moe_layer_freq, config.num_layers
    if isinstance(freq, bool) or not isinstance(freq, int | tuple):
        raise ValueError(f"moe_layer_freq={freq!r} must be an int >= 1 or a tuple of 0/1 per layer ({n} entries)")
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"moe_layer_freq={freq} must be >= 1 (1: every layer is MoE), or a tuple of 0/1 per layer")
    if isinstance(freq, tuple):
        if len(freq) != n or any(flag not in (0, 1) for flag in freq):
            raise ValueError(
                f"moe_layer_freq={freq!r} must hold one 0 (dense) or 1 (MoE) per layer: {n} entries for num_layers={n}"
            )
        if not any(freq):
            raise ValueError(
                f"moe_layer_freq={freq!r} makes every layer dense; use num_moe_experts=None for a dense model, or "
                "mark at least one layer 1"
            )


class MoEParallelRequest(Protocol):
    """The ``ModelConfig`` fields :func:`check_moe_parallel` reads."""

    num_moe_experts: int | None
    moe_ffn_hidden_size: int | None
    moe_shared_expert_intermediate_size: int | None
    moe_enable_routing_replay: bool

    @property
    def effective_ffn_hidden_size(self) -> int: ...


def check_moe_parallel(config: MoEParallelRequest, ep: int, tp: int, sequence_parallel: bool) -> None:
    """Raise ``ValueError`` where the experts cannot be split by ``ep`` and ``tp`` (the strategy's sizes)."""
    experts = config.num_moe_experts
    if experts is None and ep > 1:
        raise ValueError(f"ep={ep} needs an MoE model but num_moe_experts=None; set ep=1 or num_moe_experts")
    if experts is not None and experts % ep != 0:
        raise ValueError(f"num_moe_experts={experts} must be divisible by ep={ep}; pick ep among {divisors(experts)}")
    # The experts (and a shared expert) are split over expert tensor parallelism, as large as tp.
    sizes = {
        "moe_ffn_hidden_size": config.moe_ffn_hidden_size or config.effective_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
    }
    for name, size in sizes.items() if experts is not None else ():
        if size is not None and size % tp != 0:
            raise ValueError(f"{name}={size} must be divisible by tp={tp}; pick tp among {divisors(size)}")
    if sequence_parallel and config.moe_enable_routing_replay:
        raise ValueError(
            "sequence_parallel=True splits each router's tokens across TP ranks, so the routing of "
            "moe_enable_routing_replay=True would be per-shard; use sequence_parallel=False with routing replay"
        )


def build_with_expert_biases(config_class: type, kwargs: dict[str, Any]) -> Any:
    """``config_class(**kwargs)`` (Megatron's ``TransformerConfig``). Megatron asserts expert tensor parallelism 1
    for MoE with ``add_bias_linear``, since its own expert linears would add fc2's row-parallel bias on every
    expert-TP rank; the grouped experts (:mod:`lightning_megatron.kernels.expert_mlp`) add it once, so such a config
    is built at expert TP 1 and then given its size (Megatron's default: tp)."""
    etp = kwargs.get("expert_tensor_parallel_size") or kwargs.get("tensor_model_parallel_size", 1)
    if kwargs.get("num_moe_experts") is None or not kwargs.get("add_bias_linear") or etp == 1:
        return config_class(**kwargs)
    config = config_class(**{**kwargs, "expert_tensor_parallel_size": 1})
    config.expert_tensor_parallel_size = etp
    return config
