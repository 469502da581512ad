"""What the mixture-of-experts families share: a router, experts stacked per projection, optional shared experts,
and dense layers mixed in (:class:`MoEFamily`).

Megatron's experts (:mod:`lightning_megatron.kernels.experts`) hold one weight per projection for all local experts,
``[num_local_experts, out, in]``; HF checkpoints store one tensor per expert (``...experts.{e}.gate_proj.weight``):
a :class:`~lightning_megatron.gpt.hf.params.Param` with ``expert`` set maps one expert's slice.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.gpt.hf.families.base import Family, dense_mlp
from lightning_megatron.gpt.hf.params import EXPERT_PIECE, Kind, ModelShape, Param
from lightning_megatron.gpt.moe.config import moe_layer_pattern


class MoEFamily(Family):
    """A decoder whose MoE layers route each token to ``moe_router_topk`` of ``num_moe_experts`` SwiGLU experts."""

    block: str = "mlp"
    """The HF submodule of a layer that holds the router and experts (Mixtral: ``block_sparse_moe``)."""
    expert_names: tuple[str, str, str] = ("gate", "up", "down")
    """HF names of an expert's gate, up and down projections (``gate`` -> ``gate_proj``; Mixtral ``w1, w3, w2``)."""

    def mlp_params(self, c: ModelShape, m: str, h: str, layer: int, experts: range | None) -> list[Param]:
        if not moe_layer_pattern(c.num_layers, c.moe_layer_freq)[layer]:
            return super().mlp_params(c, m, h, layer, experts)
        num_experts, hidden = c.num_moe_experts or 0, c.hidden_size
        ffn = c.moe_ffn_hidden_size or c.effective_ffn_hidden_size
        hb = f"{h}{self.block}."
        params = [Param(m + "mlp.router.weight", ((hb + "gate.weight", (num_experts, hidden)),), "copy")]
        for local, e in enumerate(experts if experts is not None else range(num_experts)):
            for p in dense_mlp(m + "mlp.experts.", f"{hb}experts.{e}.", hidden, ffn, self.expert_names):
                params.append(Param(p.megatron, p.hf, p.kind, expert=local))
        return params + self.shared_expert_params(c, m, hb)

    def shared_expert_params(self, c: ModelShape, m: str, hb: str) -> list[Param]:
        """The shared expert every token also goes through (none in this family)."""
        return []

    def mlp_adapter_params(self, c: Any, lora: Any, m: str, h: str, layer: int) -> list[Param]:
        """An MoE layer's adapters: each expert's on its fused gate/up and its down projection, as pieces of PEFT's
        tensors on HF's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (``target_parameters``; with both, PEFT
        nests the second wrapper, so the first is ``experts.base_layer.lora_*``), then the shared expert's."""
        if not moe_layer_pattern(c.num_layers, c.moe_layer_freq)[layer]:
            return super().mlp_adapter_params(c, lora, m, h, layer)
        hidden, ffn, rank = c.hidden_size, c.moe_ffn_hidden_size or c.effective_ffn_hidden_size, lora.rank
        fc1, fc2 = lora.adapts("linear_fc1"), lora.adapts("linear_fc2")
        params = []
        projections = [("linear_fc1", "gate_up_proj", hidden, 2 * ffn, ".base_layer" if fc2 else "")] if fc1 else []
        projections += [("linear_fc2", "down_proj", ffn, hidden, "")] if fc2 else []
        # Under expert TP, fc1's B is split like the base's rows ([gate; up] half by half) and fc2's A like its columns.
        kinds: dict[str, tuple[Kind, Kind]] = {"linear_fc1": ("copy", "halves" if c.gated_linear_unit else "rows"),
                                               "linear_fc2": ("cols", "copy")}  # fmt: skip
        for target, part, n_in, n_out, nest in projections:
            for e in range(c.num_moe_experts or 0):
                for factor, shape, kind in zip(("lora_A", "lora_B"), ((rank, n_in), (n_out, rank)), kinds[target]):
                    piece = f"{h}experts{nest}.{factor}.weight{EXPERT_PIECE}{e}"
                    params.append(Param(f"{m}experts.{target}.{factor}.{part}", ((piece, shape),), kind, expert=e))
        return params + self.shared_adapter_params(c, lora, m, h)

    def shared_adapter_params(self, c: Any, lora: Any, m: str, h: str) -> list[Param]:
        """The shared expert's adapters (none in this family)."""
        return []

    def moe_fields(self, hf: Any, *, experts: int, sparse: tuple[bool, ...], renormalise: bool) -> dict[str, Any]:
        """The MoE ModelConfig fields of an HF config: experts, top-k, expert size, routing, which layers are MoE and
        the load-balancing loss (on only where HF's training loss adds it: ``output_router_logits``).

        transformers computes one load-balancing loss over the router outputs of all MoE layers pooled,
        ``E * sum_e (tokens routed to e / tokens) * mean probability of e``; Megatron one per MoE layer, with the
        routed share divided by top-k, summed over the layers. ``router_aux_loss_coef * top-k / MoE layers`` as
        ``moe_aux_loss_coeff`` gives HF's loss exactly for one MoE layer, and the same value wherever the layers
        route alike (the pooled statistics then equal each layer's)."""
        jitter = float(getattr(hf, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise ValueError(f"router_jitter_noise={jitter} is not supported (Megatron's router has no input jitter)")
        coeff = 0.0
        if getattr(hf, "output_router_logits", False):
            coeff = float(getattr(hf, "router_aux_loss_coef", 0.0)) * hf.num_experts_per_tok / sum(sparse)
        return {
            "num_moe_experts": experts,
            "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
            # Megatron: pre-softmax = softmax over all experts, top-k kept as they are (HF norm_topk_prob=False);
            # otherwise top-k logits then a softmax over them, which equals renormalising the chosen probabilities.
            "moe_router_pre_softmax": not renormalise,
            "moe_layer_freq": 1 if all(sparse) else tuple(int(s) for s in sparse),
            "moe_aux_loss_coeff": coeff,
        }


class QwenMoEFamily(MoEFamily):
    """What Qwen2-MoE and Qwen3-MoE configs share: ``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob`` and
    the dense layers of ``decoder_sparse_step`` / ``mlp_only_layers`` (transformers' rule: layer ``i`` is sparse iff
    it is not listed and ``(i + 1) % decoder_sparse_step == 0``)."""

    def qwen_moe_fields(self, hf: Any) -> dict[str, Any]:
        step, dense = int(getattr(hf, "decoder_sparse_step", 1) or 1), set(getattr(hf, "mlp_only_layers", None) or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))
        return self.moe_fields(hf, experts=hf.num_experts, sparse=sparse, renormalise=bool(hf.norm_topk_prob))

    def hf_config_kwargs(self, c: ModelShape) -> dict[str, Any]:
        pattern = moe_layer_pattern(c.num_layers, c.moe_layer_freq)
        return {
            "num_experts": c.num_moe_experts, "num_experts_per_tok": c.moe_router_topk,
            "moe_intermediate_size": c.moe_ffn_hidden_size or c.effective_ffn_hidden_size,
            "norm_topk_prob": not c.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse],
        }  # fmt: skip
