"""Mixture-of-experts GPT with expert parallelism (Megatron's MoE layer, local spec)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ParallelSizes, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import one_process_trainer, run_here, run_worker

MOE = {"model": {"num_moe_experts": 4, "moe_router_topk": 2}}
# The routers real MoE models use: DeepSeek-V3's sigmoid scores with an aux-loss-free expert bias, group-limited
# routing and a routed scaling factor, Qwen2-MoE's gated shared expert, dense layers mixed in; both router losses on.
ROUTERS = {
    "num_moe_experts": 4, "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.0, "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True,
    "moe_layer_freq": (0, 1, 1, 0), "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3,
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process: 2 steps, checkpointed (``ckpt``); what its ModelSummary counted (``summary``)."""
    tmp = tmp_path_factory.mktemp("moe")
    run = {**MOE, "devices": 1, "max_steps": 2, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2, "summary": True}
    result = run_here(run, tmp)
    return {"ckpt": str(tmp / "ckpt" / "epoch=0-step=2.ckpt"), "summary": result["summary"]}


@pytest.mark.multiprocess
def test_expert_parallel_matches_one_process(moe_run: dict, tmp_path: Path) -> None:
    """The same MoE weights give the same validation loss with all experts on one rank and split over two, on
    packed rows (documents attending only to themselves; the plain rows' EP run: test_expert_parallel_trains)."""
    packed = {"model": {**MOE["model"], "kernels": "torch"}, "packed": True}
    args = {**packed, "mode": "validate", "limit_val_batches": 2, "resume": moe_run["ckpt"]}
    one = run_here({**args, "devices": 1}, tmp_path)
    ep2 = run_worker({**args, "devices": 2, "ep": 2}, tmp_path)
    assert ep2["val"] == pytest.approx(one["val"], rel=2e-5)
    assert (one["dispatchers"], ep2["dispatchers"]) == (["QueuedCountsDispatcher"], ["MoEAlltoAllTokenDispatcher"])


@pytest.mark.multiprocess
def test_expert_parallel_trains(moe_run: dict, tmp_path: Path) -> None:
    fused = {"model": {**MOE["model"], "gradient_accumulation_fusion": True}}  # expert linears fused too
    result = run_worker({**fused, "devices": 2, "ep": 2, "max_steps": 3, "summary": True}, tmp_path)
    assert len(result["train"]) == 3
    assert len(set(result["train"].values())) == 3  # weights move
    assert result["dispatchers"] == ["MoEAlltoAllTokenDispatcher"]  # tokens sent to their experts' ranks
    # The Trainer's ModelSummary counts the experts of both ranks, the dense weights (data-parallel copies) once.
    summary, one_process = result["summary"], moe_run["summary"]
    assert summary["class"] == "MegatronModelSummary"
    assert (summary["total"], summary["trainable"]) == (one_process["total"], one_process["trainable"])
    assert summary["rows"] == one_process["rows"]  # at EP=2 both ranks hold every layer: each row whole


def test_expert_parallel_errors() -> None:
    with pytest.raises(ValueError, match=r"num_moe_experts=4 must be divisible by ep=3"):
        tiny_gpt(num_moe_experts=4).validate_parallel(ParallelSizes(ep=3))
    with pytest.raises(ValueError, match=r"ep=2"):
        tiny_gpt().validate_parallel(ParallelSizes(ep=2))  # a dense model has no experts to split
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tp\*pp\*ep"):
        MegatronStrategy(tp=2, ep=2)._sizes.data_parallel_size(2)


def test_optimizer_state_is_resplit_between_one_and_two_optimizers(tmp_path: Path) -> None:
    """checkpointing/format/optimizer_split.py on hand-made states: entries renamed to the checkpoint's prefixes, the
    saved parameter groups offered to each optimizer (the missing expert group from the dense one), the refusal
    named."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lightning_megatron.checkpointing.format import optimizer_split
    from lightning_megatron.checkpointing.integrity import checks

    def entry(key: str) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, torch.zeros(2))

    saved = ["chained_0.optimizer.state.exp_avg.w", "chained_1.optimizer.state.exp_avg.e", "w", "e"]
    assert optimizer_split.optimizer_count(optimizer_split.state_keys(saved)) == 2
    request = {"param_state": {0: {"exp_avg": entry("optimizer.state.exp_avg.w")},
                               1: {"exp_avg": entry("optimizer.state.exp_avg.e")}}}  # fmt: skip
    optimizer_split.rekey(tmp_path, request, saved)
    assert [request["param_state"][i]["exp_avg"].key for i in (0, 1)] == saved[:2]
    with pytest.raises(ValueError, match=r"holds no optimizer state 'optimizer.state.exp_avg.x'.*load_from_checkpoint"):
        optimizer_split.rekey(tmp_path, {"x": entry("chained_1.optimizer.state.exp_avg.x")}, saved)

    dense = {"is_expert_parallel": False, "wd_mult": 1.0, "step": 2.0}
    experts = {**dense, "is_expert_parallel": True, "step": 2.0}
    two = {0: {"optimizer": {"param_groups": [dense]}, "param_state_sharding_type": "fully_reshardable"},
           1: {"optimizer": {"param_groups": [experts]}, "param_state_sharding_type": "fully_reshardable"},
           "param_state": "loaded"}  # fmt: skip
    one = optimizer_split.regroup(two, saved=2, wanted=1)
    assert one == {"optimizer": {"param_groups": [dense, experts]}, "param_state_sharding_type": "fully_reshardable",
                   "param_state": "loaded"}  # fmt: skip
    saved_one = {"optimizer": {"param_groups": [dense]}, "param_state_sharding_type": "fully_reshardable",
                 0: {"param_state": "dense"}, 1: {"param_state": "experts"}}  # fmt: skip
    chained = optimizer_split.regroup(saved_one, saved=1, wanted=2)
    assert [chained[i]["param_state"] for i in (0, 1)] == ["dense", "experts"]
    assert chained[1]["optimizer"]["param_groups"] == [dense, experts]  # the experts' group: the dense one's settings

    error = checks.optimizer_split_error(tmp_path, 1, 2, "HybridDeviceOptimizer")
    assert re.search(r"holds the state of 1 optimizer\(s\) and this run builds 2.*HybridDeviceOptimizer.*default "
                     r"distributed Adam.*load_from_checkpoint", str(error))  # fmt: skip


@pytest.mark.multiprocess
def test_optimizer_state_resumes_across_expert_parallel_sizes(moe_run: dict, tmp_path: Path) -> None:
    """Megatron splits the optimizer in two at ep=2 (dense parameters, experts) and not at ep=1: a checkpoint of
    either split resumes at the other with its optimizer state, continuing as at the layout that wrote it. (A loss
    two steps after a resume depends on the restored Adam moments and step count.) The EP=2 checkpoint holds the
    trained weights as main weights only (``save_model_weights=False``)."""
    ep1 = run_here({**MOE, "devices": 1, "max_steps": 5, "resume": moe_run["ckpt"]}, tmp_path)  # steps 3-5
    # The EP=2 run saves its weights only as the optimizers' main weights (chained_<i>. keys): rebuilt at EP=1.
    ep2 = run_worker({**MOE, "devices": 2, "ep": 2, "max_steps": 4, "resume": moe_run["ckpt"],
                      "ckpt_dir": str(tmp_path / "ep2"), "ckpt_every": 3, "lean": True}, tmp_path)  # fmt: skip
    stored = FileSystemReader(tmp_path / "ep2" / "epoch=0-step=3.ckpt").read_metadata().state_dict_metadata
    assert not [key for key in stored if key.endswith(".weight") and "optimizer." not in key]  # no model weight
    assert any(key.startswith("chained_1.optimizer.state.param.") and "experts" in key for key in stored)
    back = run_here({**MOE, "devices": 1, "max_steps": 5, "resume": str(tmp_path / "ep2" / "epoch=0-step=3.ckpt")},
                    tmp_path)  # fmt: skip
    one, two, again = ([losses[str(step)] for step in sorted(map(int, losses))] for losses in
                       (ep1["train"], ep2["train"], back["train"]))  # fmt: skip
    assert len(set(one)) == 3
    assert two == pytest.approx(one[:2], rel=2e-5)  # one optimizer's state read by two (EP=1 -> EP=2)
    assert again == pytest.approx(one[1:], rel=2e-5)  # two optimizers' state read by one (EP=2 -> EP=1)


def reference_losses(logits: torch.Tensor, topk: int) -> tuple[float, float]:
    """One MoE layer's (load-balancing loss, z-loss) of one micro-batch from its router logits [tokens, experts],
    written out from the papers' definitions: Switch's E * sum_e f_e * P_e on the sigmoid scores normalised per token
    (the top-k of the scores, neither grouped nor biased: Megatron's aux-loss routing), and ST-MoE's mean squared
    logsumexp."""
    tokens, experts = logits.shape
    scores = torch.sigmoid(logits.double())
    scores = scores / scores.sum(-1, keepdim=True)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0)
    fraction = chosen.sum(0) / (tokens * topk)  # f_e: share of the routed slots
    probability = scores.mean(0)  # P_e
    z = torch.logsumexp(logits.double(), dim=-1).square().mean()
    return float(experts * (fraction * probability).sum()), float(z)


class RouterProbe(L.Callback):
    """Captures each router's logits per training micro-batch (a forward hook: ``input @ weight.T``) and, at each
    ``on_train_batch_end``, what the callback sees logged and what :func:`reference_losses` gives for that step."""

    def __init__(self) -> None:
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.steps: list[dict] = []
        self.bias_moved = False

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        from lightning_megatron.gpt.moe.router import StepRouter

        for router in (m for m in pl_module.chunks.modules() if isinstance(m, StepRouter)):

            def hook(module, args, output) -> None:  # noqa: ANN001
                if module.training and torch.is_grad_enabled():
                    hidden = args[0].detach().reshape(-1, args[0].shape[-1])
                    self.logits.setdefault(module.layer_number, []).append(hidden.float() @ module.weight.detach().T)

            router.register_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        config = pl_module.config
        # Per MoE layer: the mean over its micro-batches; then the mean over the layers.
        layer_means = [
            torch.tensor([reference_losses(x, config.moe_router_topk) for x in xs]).mean(0)
            for xs in self.logits.values()
        ]
        aux, z = torch.stack(layer_means).mean(0).tolist()
        metrics = trainer.callback_metrics
        self.steps.append({
            "logged": (float(metrics["moe_aux_loss"]), float(metrics["moe_z_loss"])),
            "reference": (config.moe_aux_loss_coeff * aux, config.moe_z_loss_coeff * z),
            "micro_batches": {n: len(xs) for n, xs in self.logits.items()}, "loss": float(outputs["loss"]),
        })  # fmt: skip
        self.logits = {}
        biases = [b for n, b in pl_module.chunks.named_buffers() if n.endswith("expert_bias")]
        self.bias_moved |= any(bool(b.abs().sum() > 0) for b in biases)


def test_deepseek_and_qwen_routers_train_and_log_their_losses() -> None:
    """Sigmoid + expert bias + group-limited routing + gated shared experts + dense layers mixed in: the layers are
    dense/MoE as asked, two steps train (finite loss, weights move, expert bias moves), and ``moe_aux_loss`` /
    ``moe_z_loss`` are in ``callback_metrics`` in the step's own ``on_train_batch_end``, equal to the losses computed
    from the routers' logits (mean over both MoE layers and the 4 micro-batches, times the coefficient)."""
    from megatron.core.transformer.mlp import MLP

    from lightning_megatron.gpt.moe.dispatch import QueuedCountsDispatcher, QueuedCountsMoELayer
    from lightning_megatron.gpt.moe.router import StepRouter

    model = MegatronLMModule(tiny_gpt(**ROUTERS), lr=3e-3)
    probe = RouterProbe()
    before: dict[str, torch.Tensor] = {}

    class Before(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            before.update({n: p.detach().clone() for n, p in pl_module.chunks.named_parameters()})

    routed_as_deepseek_v3: list[bool] = []

    class DeepSeekRouting(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            _routes_as_deepseek_v3(pl_module.chunks[0].decoder.layers[1].mlp.router)
            routed_as_deepseek_v3.append(True)

    trainer = one_process_trainer(2, callbacks=[probe, Before(), DeepSeekRouting()])
    trainer.fit(model, DataLoader(synthetic_tokens(16, 32, 256, seed=1), batch_size=8))

    layers = model.chunks[0].decoder.layers
    assert [type(layer.mlp) for layer in layers] == [MLP, QueuedCountsMoELayer, QueuedCountsMoELayer, MLP]
    moe = layers[1].mlp
    assert isinstance(moe.router, StepRouter)
    assert moe.shared_experts.gate_weight is not None
    assert moe.config.moe_token_dispatcher_type == "allgather"  # ep=1: nothing to send (parallel/state.py)
    assert type(moe.token_dispatcher) is QueuedCountsDispatcher  # its permutation queued before the counts' wait
    assert len(probe.steps) == 2
    assert all(math.isfinite(step["loss"]) for step in probe.steps)
    unmoved = [n for n, p in model.chunks.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unmoved == []  # routers, shared experts and their gates, experts, dense MLPs: every weight trained
    assert probe.bias_moved  # aux-loss-free balancing updated the expert bias after a step
    for step in probe.steps:
        assert step["micro_batches"] == {2: 4, 3: 4}  # layer numbers 2 and 3 (1-based) are the MoE layers
        assert step["logged"] == pytest.approx(step["reference"], rel=1e-5)
    assert routed_as_deepseek_v3  # checked at the end of the fit (Megatron's router needs the run's device setup)


def _routes_as_deepseek_v3(router: torch.nn.Module) -> None:
    """The router (sigmoid scores, the expert bias in the choice only, the best group by its top-2 score sum, the
    chosen scores renormalised, x the scaling factor) picks the experts and weights transformers' DeepSeek-V3
    router picks with the same weight and bias (``e_score_correction_bias``)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden = router.weight.shape[1]
    config = DeepseekV3Config(hidden_size=hidden, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                              routed_scaling_factor=2.0, norm_topk_prob=True)  # fmt: skip
    reference = DeepseekV3TopkRouter(config)
    bias = torch.tensor([0.2, 0.1, -0.2, 0.0])  # favours group 0 by 0.3: changes some choices
    tokens = torch.randn(64, 1, hidden, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference.weight.copy_(router.weight.float())
        reference.e_score_correction_bias.copy_(bias)
        router.expert_bias.copy_(bias)
        router.eval()
        probs, routing_map = router(tokens)
        _, weights, chosen = reference(tokens)
    want = torch.zeros(64, 4).scatter(1, chosen, weights)
    assert torch.equal(routing_map, want > 0)
    torch.testing.assert_close(probs.float() * routing_map, want, rtol=1e-5, atol=1e-6)
    plain = reference.e_score_correction_bias.zero_() is not None and reference(tokens)[2]
    assert not torch.equal(plain.sort(dim=1).values, chosen.sort(dim=1).values)  # the bias decided some choices


def test_a_shared_expert_without_a_gate_trains() -> None:
    """DeepSeek's shared experts take every token ungated (``moe_shared_expert_gate=False``): built without a gate
    weight, and they train with the routed experts."""
    config = tiny_gpt(num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=64)
    model = MegatronLMModule(config, lr=3e-3)
    trainer = one_process_trainer(1)
    before: dict[str, torch.Tensor] = {}

    class Before(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            before.update({n: p.detach().clone() for n, p in pl_module.chunks.named_parameters() if "shared" in n})

    trainer.callbacks.append(Before())
    trainer.fit(model, DataLoader(synthetic_tokens(8, 32, 256, seed=1), batch_size=8))
    shared = model.chunks[0].decoder.layers[0].mlp.shared_experts
    assert shared.gate_weight is None
    assert before
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.chunks.named_parameters() if "shared" in n)


def test_router_losses_are_off_without_coefficients() -> None:
    from lightning_megatron.gpt.moe.router import tracked_names

    assert tracked_names(tiny_gpt(num_moe_experts=4)) == {}  # coefficient 0, z-loss None: nothing logged
    assert tracked_names(tiny_gpt()) == {}
    seq = tiny_gpt(num_moe_experts=4, moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss")
    assert tracked_names(seq) == {"moe_aux_loss": "seq_load_balancing_loss"}


def test_grouped_gemm_required_where_there_is_none() -> None:
    from lightning_megatron.gpt.plan import KernelPlan

    with pytest.raises(ValueError, match=r"moe_grouped_gemm=True.*CPU.*moe_grouped_gemm=None"):
        KernelPlan.resolve(tiny_gpt(num_moe_experts=4, moe_grouped_gemm=True), "cpu")
    KernelPlan.resolve(tiny_gpt(num_moe_experts=4, moe_grouped_gemm=None), "cpu")  # the loop there


ROUTER_LAYOUTS = {"pp2": {"pp": 2}, "ep2_dp2": {"ep": 2}, "tp2_sp": {"tp": 2, "sp": True}}


@pytest.fixture(scope="module")
def router_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process's run to a checkpoint at step 1 and its step 2 resumed from it (with validation at step 2), and
    that resume at each of ``ROUTER_LAYOUTS``, run side by side: every rank's ``callback_metrics``."""
    tmp = tmp_path_factory.mktemp("routers")
    model = {**ROUTERS, "moe_layer_freq": [0, 1, 1, 0]}  # a list, as from YAML
    # One sample per micro-batch: the router losses are per micro-batch and not linear in its samples, so a
    # data-parallel rank's micro-batches must hold what one process's do (the distributed sampler deals samples
    # alternately to the two ranks).
    # An EMA of the weights too (experts included), saved at step 1 and resumed at the layout: the validation at
    # step 2 runs on it.
    ckpt = {"model": model, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 1, "micro_batch_size": 1, "ema": 0.5}
    run_here({**ckpt, "max_steps": 1}, tmp)
    resume = {"model": model, "max_steps": 2, "resume": str(tmp / "ckpt" / "epoch=0-step=1.ckpt"),
              "micro_batch_size": 1, "ema": 0.5, "limit_val_batches": 1, "val_check_interval": 2}  # fmt: skip
    runs = {"one": [run_here(resume, tmp)["callback_metrics"]]}
    dirs = {name: tmp / name for name in ROUTER_LAYOUTS}
    with concurrent.futures.ThreadPoolExecutor(len(ROUTER_LAYOUTS)) as pool:
        for name, layout in ROUTER_LAYOUTS.items():
            dirs[name].mkdir()
        results = {name: pool.submit(run_worker, {**resume, "devices": 2, **layout}, dirs[name])
                   for name, layout in ROUTER_LAYOUTS.items()}  # fmt: skip
        for name, result in results.items():
            rank0 = result.result()["callback_metrics"]
            (other,) = dirs[name].glob("result-*.json.rank1")
            runs[name] = [rank0, json.loads(other.read_text())["callback_metrics"]]
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(ROUTER_LAYOUTS))
def test_router_losses_are_the_same_at_every_layout(router_runs: dict, name: str) -> None:
    """The router losses are reduced over the layout's ranks as the loss is: PP=2 splits the MoE layers (one per
    stage, from the stage's global layer offset) and sums over the stages; EP=2 (with DP=2: each rank routes half the
    batch) averages over the data-parallel ranks; TP=2 with SP adds up the load-balancing partial sums of the
    sequence shards and averages the z-loss. Every rank logs what one process logs for the same weights and batch."""
    (one,) = router_runs["one"]
    for metrics in router_runs[name]:  # both ranks
        for metric in ("moe_aux_loss", "moe_z_loss", "train_loss", "val_loss"):
            assert metrics[metric] == pytest.approx(one[metric], rel=1e-5), metric


def test_training_with_tensor_parallel_experts_needs_sequence_parallelism() -> None:
    """Megatron's MoE layer refuses to train at tp > 1 without sequence parallelism: refused at connect (fit only)."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    module = MegatronLMModule(tiny_gpt(num_moe_experts=4))
    module.validate_parallel(ParallelSizes(tp=2))  # no Trainer: validate/predict run either way
    module._trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING))  # what connect sees in fit
    with pytest.raises(ValueError, match=r"tp=2 needs MegatronStrategy\(sequence_parallel=True\)"):
        module.validate_parallel(ParallelSizes(tp=2))
    module.validate_parallel(ParallelSizes(tp=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"moe_ffn_hidden_size=30 must be divisible by tp=4"):
        tiny_gpt(num_moe_experts=4, moe_ffn_hidden_size=30).validate_parallel(ParallelSizes(tp=4))


@pytest.mark.multiprocess
def test_tensor_parallel_experts_train_with_sequence_parallelism(tmp_path: Path) -> None:
    result = run_worker({**MOE, "devices": 2, "tp": 2, "sp": True, "max_steps": 3}, tmp_path)
    assert len(set(result["train"].values())) == 3  # the experts split over expert TP train


@pytest.mark.multiprocess
def test_an_ep2_checkpoint_continues_at_ep1_from_its_weights(tmp_path: Path) -> None:
    """A checkpoint written at EP=2 holds each expert once; at EP=1 its weights load (the same validation loss as
    at EP=2) and training continues from them with a fresh optimizer (load_from_checkpoint, then fit)."""
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    run_worker({**MOE, "devices": 2, "ep": 2, "max_steps": 2, "ckpt_dir": str(tmp_path / "ckpt")}, tmp_path)
    args = {**MOE, "mode": "validate", "limit_val_batches": 2, "resume": str(ckpt)}
    at_ep2 = run_worker({**args, "devices": 2, "ep": 2}, tmp_path)
    at_ep1 = run_here({**args, "devices": 1}, tmp_path)
    assert at_ep1["val"] == pytest.approx(at_ep2["val"], rel=2e-5)
    module = MegatronLMModule.load_from_checkpoint(ckpt)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    data = DataLoader(synthetic_tokens(8, 32, 256, seed=5), batch_size=4)
    one_process_trainer(2, callbacks=[Record()]).fit(module, data)
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses)
