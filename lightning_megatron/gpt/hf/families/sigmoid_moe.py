"""What DeepSeek-V3 and GLM-4.5 share (:class:`SigmoidMoEFamily`): dense first layers (``first_k_dense_replace``),
then MoE layers with one ungated shared MLP (``n_shared_experts`` experts' worth) and the sigmoid router with
``e_score_correction_bias``, group-limited top-k and ``routed_scaling_factor``; multi-token-prediction layers stored
past ``num_hidden_layers``, which import skips.

Both transformers routers compute ``sigmoid(logits)``, add the correction bias for the choice only, keep the
``topk_group`` groups whose top-2 biased scores sum highest, take the top-k of those groups' experts, weight them by
their unbiased scores (divided by their sum with ``norm_topk_prob``) times ``routed_scaling_factor``: Megatron's
sigmoid router with ``moe_router_enable_expert_bias`` (:func:`router_fields` names what it cannot express).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_megatron.gpt.hf.families.base import dense_adapters, dense_mlp
from lightning_megatron.gpt.hf.families.moe import MoEFamily
from lightning_megatron.gpt.hf.params import ModelShape, Param
from lightning_megatron.gpt.moe.config import moe_layer_pattern


class SigmoidMoEFamily(MoEFamily):
    """Router ``mlp.gate`` (its ``e_score_correction_bias`` is Megatron's ``router.expert_bias``), experts
    ``mlp.experts.{e}.*_proj``, shared experts ``mlp.shared_experts.*_proj``."""

    sigmoid_router = True

    def matches(self, c: Any) -> bool:
        """MoE with an ungated shared MLP of whole experts, the biased sigmoid router and the dense layers first
        (what ``first_k_dense_replace`` says); the attention is the subclass's to check."""
        if c.num_moe_experts is None or c.moe_shared_expert_intermediate_size is None or c.moe_shared_expert_gate:
            return False
        ffn = c.moe_ffn_hidden_size or c.effective_ffn_hidden_size
        sparse = moe_layer_pattern(c.num_layers, c.moe_layer_freq)
        dense_first = any(sparse) and all(sparse[sparse.index(True) :])
        sigmoid = c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
        return sigmoid and dense_first and c.moe_shared_expert_intermediate_size % ffn == 0

    def mlp_params(self, c: ModelShape, m: str, h: str, layer: int, experts: range | None) -> list[Param]:
        params = super().mlp_params(c, m, h, layer, experts)
        if params and params[0].megatron == m + "mlp.router.weight":  # an MoE layer: the router's bias follows it
            bias = ((f"{h}{self.block}.gate.e_score_correction_bias", (c.num_moe_experts or 0,)),)
            params.insert(1, Param(m + "mlp.router.expert_bias", bias, "copy"))
        return params

    def shared_expert_params(self, c: ModelShape, m: str, hb: str) -> list[Param]:
        ffn = c.moe_shared_expert_intermediate_size or 0
        return dense_mlp(m + "mlp.shared_experts.", hb + "shared_experts.", c.hidden_size, ffn)

    def shared_adapter_params(self, c: Any, lora: Any, m: str, h: str) -> list[Param]:
        ffn = c.moe_shared_expert_intermediate_size or 0
        return dense_adapters(c, lora, m + "shared_experts.", h + "shared_experts.", ffn)

    def skipped(self, name: str, hf: Any) -> bool:
        """The MTP layers' tensors (``model.layers.{i}.`` for ``num_hidden_layers <= i < num_hidden_layers +
        num_nextn_predict_layers``), which import skips; a layer past those is a config.json of another model."""
        parts, n = name.split("."), hf.num_hidden_layers
        return name.startswith("model.layers.") and parts[2].isdigit() and n <= int(parts[2]) < n + mtp_layers(hf)


def mtp_layers(hf: Any) -> int:
    """How many multi-token-prediction layers the checkpoint stores past its decoder layers."""
    return int(getattr(hf, "num_nextn_predict_layers", None) or getattr(hf, "num_mtp_layers", 0) or 0)


def warn_mtp_skipped(hf: Any, arch: str) -> None:
    """One warning naming the multi-token-prediction layers import leaves out (transformers builds none either)."""
    if mtp := mtp_layers(hf):
        n = hf.num_hidden_layers
        warnings.warn(
            f"{arch}: skipping num_nextn_predict_layers={mtp} multi-token-prediction layer(s) "
            f"model.layers.{n}..{n + mtp - 1} (next-token loss only)",
            stacklevel=3,
        )


def router_fields(hf: Any, arch: str) -> dict[str, Any]:
    """The MoE fields: Megatron's sigmoid router divides the k chosen scores by their sum exactly when k > 1, and
    picks groups by the sum of each group's top ``k // topk_group`` scores, where transformers sums its top 2."""
    experts, k, first = hf.n_routed_experts, hf.num_experts_per_tok, int(hf.first_k_dense_replace or 0)
    if bool(hf.norm_topk_prob) != (k > 1):
        raise ValueError(
            f"{arch} with norm_topk_prob={hf.norm_topk_prob} and num_experts_per_tok={k} is not "
            "supported: Megatron's sigmoid router renormalises the chosen scores iff top-k > 1"
        )
    if not hf.n_shared_experts:
        raise ValueError(f"{arch} with n_shared_experts={hf.n_shared_experts!r} is not supported; at least 1")
    groups, topk_group = int(hf.n_group or 1), int(hf.topk_group or 1)
    grouped = topk_group < groups  # all groups kept: routing is plain top-k
    if grouped and k // topk_group != 2:
        raise ValueError(
            f"{arch} with num_experts_per_tok={k} and topk_group={topk_group} is not supported: "
            "Megatron ranks groups by their top (top-k // topk_group) scores, transformers by their "
            "top 2; use top-k = 2 x topk_group"
        )
    if first >= hf.num_hidden_layers:
        raise ValueError(f"{arch} with first_k_dense_replace={first} >= num_hidden_layers has no MoE layer")
    scaling = float(hf.routed_scaling_factor)
    return {
        "num_moe_experts": experts,
        "moe_router_topk": k,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": topk_group if grouped else None,
        "moe_router_topk_scaling_factor": None if scaling == 1.0 else scaling,
        "moe_shared_expert_intermediate_size": hf.moe_intermediate_size * hf.n_shared_experts,
        "moe_layer_freq": tuple(int(i >= first) for i in range(hf.num_hidden_layers)) if first else 1,
        "moe_aux_loss_coeff": 0.0,
    }


def router_config_kwargs(c: Any) -> dict[str, Any]:
    """The HF config keyword arguments of the router, experts and dense first layers (export of a generated
    config.json; no MTP layers: the model has none)."""
    ffn = c.moe_ffn_hidden_size or c.effective_ffn_hidden_size
    groups = c.moe_router_num_groups or 1
    return {
        "n_routed_experts": c.num_moe_experts,
        "num_experts_per_tok": c.moe_router_topk,
        "moe_intermediate_size": ffn,
        "n_shared_experts": (c.moe_shared_expert_intermediate_size or 0) // ffn,
        "first_k_dense_replace": moe_layer_pattern(c.num_layers, c.moe_layer_freq).index(True),
        "n_group": groups,
        "topk_group": c.moe_router_group_topk or groups,
        "norm_topk_prob": c.moe_router_topk > 1,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        "num_nextn_predict_layers": 0,
    }
