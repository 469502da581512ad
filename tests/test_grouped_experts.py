"""Grouped-GEMM MoE experts (kernels/experts.py) against Megatron's SequentialMLP: values, gradients, the fp32
``main_grad`` accumulation and checkpoint compatibility."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.kernels import expert_mlp, experts
from lightning_megatron.kernels.expert_counts import ExpertCounts
from tests.conftest import one_process_megatron
from tests.moe_kernel_inputs import COUNTS, FFN, HIDDEN, moe_config, routing


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29641):
        yield


def build(kind: str, config: Any, fuse_wgrad: bool = False) -> torch.nn.Module:
    """Megatron's ``SequentialMLP`` (local linears) or ``TEGroupedMLP`` over our grouped linears."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import build_module

    groups = ProcessGroupCollection.use_mpu_process_groups()
    if kind == "sequential":
        local = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        return SequentialMLP(len(COUNTS), config, local, pg_collection=groups)
    return build_module(expert_mlp.grouped_mlp_spec(fuse_wgrad), len(COUNTS), config, pg_collection=groups)


def grouped_like(reference: torch.nn.Module, fuse_wgrad: bool = False, gemm: str = "auto") -> torch.nn.Module:
    """A TEGroupedMLP holding ``reference``'s (a SequentialMLP's) expert weights."""
    module = build("grouped", reference.config, fuse_wgrad)
    with torch.no_grad():
        for e, expert in enumerate(reference.local_experts):
            module.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
            module.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)
    module.linear_fc1.gemm = module.linear_fc2.gemm = gemm
    return module


def run(module: torch.nn.Module, x: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor) -> tuple[Any, Any]:
    x = x.detach().requires_grad_()
    out, bias = module(x, torch.tensor(COUNTS), probs)
    assert bias is None
    out.backward(grad)
    return out.detach(), x.grad


def expert_grads(module: torch.nn.Module) -> list[torch.Tensor]:
    """Per-expert [fc1, fc2] weight gradients of either implementation."""
    if hasattr(module, "local_experts"):
        return [g for e in module.local_experts for g in (e.linear_fc1.weight.grad, e.linear_fc2.weight.grad)]
    fc1, fc2 = module.linear_fc1.weight.grad, module.linear_fc2.weight.grad
    return [g for e in range(len(COUNTS)) for g in (fc1[e], fc2[e])]


class GroupedMMCalls:
    """Counts ``torch._grouped_mm`` calls (the grouped path's kernel)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, original = 0, torch._grouped_mm

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "_grouped_mm", counted)


@pytest.mark.parametrize(("gemm", "kernel_calls"), [("loop", 0), ("grouped", 6), ("auto", 0)])
def test_grouped_mlp_equals_sequential_mlp(
    megatron_state: None, monkeypatch: pytest.MonkeyPatch, gemm: str, kernel_calls: int
) -> None:
    """Output, input gradient and each expert's weight gradients; "grouped" on CPU runs torch's reference grouped
    kernel (the CUDA path's offsets and layouts), "auto" on CPU the loop. fc1 + fc2, forward + 2 backward GEMMs."""
    reference = build("sequential", moe_config())
    module = grouped_like(reference, gemm=gemm)
    torch.manual_seed(1)
    x, probs = torch.randn(sum(COUNTS), HIDDEN), torch.rand(sum(COUNTS))
    grad = torch.randn(sum(COUNTS), HIDDEN)
    want, want_dx = run(reference, x, probs, grad)
    calls = GroupedMMCalls(monkeypatch)
    got, got_dx = run(module, x, probs, grad)
    assert calls.count == kernel_calls
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_dx, want_dx)
    for got_grad, want_grad in zip(expert_grads(module), expert_grads(reference), strict=True):
        torch.testing.assert_close(got_grad, want_grad)
    assert torch.count_nonzero(module.linear_fc1.weight.grad[1]) == 0  # the expert without tokens
    assert torch.count_nonzero(module.linear_fc1.weight.grad[0]) > 0


@pytest.mark.parametrize("gemm", ["loop", "grouped"])
def test_weight_gradients_accumulate_into_main_grad(megatron_state: None, gemm: str) -> None:
    """Two micro-batches through the fused linears sum into fp32 ``main_grad`` what the plain ones put in
    ``.grad``; the weight's own gradient is the placeholder Megatron's DDP hook discards."""
    reference = build("sequential", moe_config())
    plain, fused = grouped_like(reference, gemm=gemm), grouped_like(reference, fuse_wgrad=True, gemm=gemm)
    weights = [fused.linear_fc1.weight, fused.linear_fc2.weight]
    for weight in weights:  # what Megatron's DDP sets up
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
        weight.grad_added_to_main_grad = False
    torch.manual_seed(2)
    for _ in range(2):
        x, probs = torch.randn(sum(COUNTS), HIDDEN), torch.rand(sum(COUNTS))
        grad = torch.randn(sum(COUNTS), HIDDEN)
        want, want_dx = run(plain, x, probs, grad)
        got, got_dx = run(fused, x, probs, grad)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_dx, want_dx)
    for weight, unfused in zip(weights, [plain.linear_fc1.weight, plain.linear_fc2.weight], strict=True):
        torch.testing.assert_close(weight.main_grad, unfused.grad)
        assert weight.grad_added_to_main_grad
    # Without the fused linears, a main_grad is left to DDP's hook: the gradient goes to .grad.
    plain.linear_fc1.weight.main_grad = torch.zeros_like(plain.linear_fc1.weight)
    plain.linear_fc1.weight.grad_added_to_main_grad = False
    run(plain, x, probs, grad)
    assert torch.count_nonzero(plain.linear_fc1.weight.main_grad) == 0


def built(state: dict[str, Any]) -> dict[str, Any]:
    """The sharded tensors and objects a save writes: factories built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(state)
    return {(v.key, tuple(v.global_offset)): v for v in nested_values(state)}


def describe(state: dict[str, Any]) -> set[tuple]:
    return {(key, offset, tuple(v.global_shape), v.replica_id) for (key, offset), v in built(state).items()}


def transfer(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Load ``target`` from ``source``'s sharded state dict as ``dist_checkpointing.load`` does (shards matched by
    key and global offset, then the factories' merges), without the file system."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory, apply_factory_merges

    saved = {k: v.data for k, v in built(source.sharded_state_dict()).items()}
    state = target.sharded_state_dict()
    factories, _ = extract_matching_values(
        state, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
    )
    built(state)
    dict_list_map_inplace(
        lambda v: saved[(v.key, tuple(v.global_offset))] if isinstance(v, ShardedBase) else v, state
    )  # fmt: skip
    target.load_state_dict(apply_factory_merges(state, factories))


@pytest.mark.parametrize("singleton", [False, True])
def test_checkpoints_are_sequential_mlps(megatron_state: None, singleton: bool) -> None:
    """The same sharded keys, global shapes, expert offsets and replica ids as SequentialMLP's, for the weights
    and for an optimizer's state of them; each loads the other's."""
    metadata = {"singleton_local_shards": singleton}
    reference = build("sequential", moe_config())
    module = build("grouped", reference.config)
    assert describe(module.sharded_state_dict("mlp.", metadata=dict(metadata))) == describe(
        reference.sharded_state_dict("mlp.", metadata=dict(metadata))
    )
    assert optimizer_state(module) == optimizer_state(reference)
    transfer(reference, module)
    for e, expert in enumerate(reference.local_experts):
        assert torch.equal(module.linear_fc1.weight[e], expert.linear_fc1.weight)
        assert torch.equal(module.linear_fc2.weight[e], expert.linear_fc2.weight)
    with torch.no_grad():
        module.linear_fc2.weight.mul_(2)
    transfer(module, reference)
    assert torch.equal(reference.local_experts[3].linear_fc2.weight, module.linear_fc2.weight[3])
    # The sharding attributes Megatron's DDP, optimizer and gradient clipping read (expert dims: one further in).
    for name in ("linear_fc1", "linear_fc2"):
        ours, theirs = getattr(module, name).weight, getattr(reference.local_experts[0], name).weight
        assert (ours.allreduce, ours.tensor_model_parallel) == (theirs.allreduce, theirs.tensor_model_parallel)
        assert ours.partition_dim == theirs.partition_dim + 1


def optimizer_state(module: torch.nn.Module) -> set[tuple]:
    """Adam's state of ``module`` as Megatron shards it (``optimizer.state.exp_avg.<key>`` ...), found through
    each parameter's sharded-state-dict entry."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = list(module.parameters())
    optimizer = torch.optim.Adam(params)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    id_map = get_param_id_to_sharded_param_map(module.sharded_state_dict(), params)
    assert len(id_map) == len(params)  # every parameter found by its data
    state = optimizer.state_dict()
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    return describe(state["state"])


def test_plain_state_dict_round_trips(megatron_state: None) -> None:
    reference = build("grouped", moe_config())
    state = reference.state_dict()
    assert sorted(state) == sorted(
        ["linear_fc1.weight", "linear_fc1._extra_state", "linear_fc2.weight", "linear_fc2._extra_state"]
    )
    copy = build("grouped", moe_config())
    assert not torch.equal(copy.linear_fc1.weight, reference.linear_fc1.weight)
    copy.load_state_dict(state)
    torch.testing.assert_close(copy.state_dict()["linear_fc1.weight"], state["linear_fc1.weight"])
    # Transformer Engine's per-expert layout (weight0, weight1, ...) loads too.
    per_expert = {f"linear_fc2.weight{e}": w for e, w in enumerate(reference.linear_fc2.weight.detach() * 3)}
    copy.load_state_dict({**{k: v for k, v in state.items() if k != "linear_fc2.weight"}, **per_expert})
    assert torch.equal(copy.linear_fc2.weight, reference.linear_fc2.weight * 3)


@pytest.mark.parametrize(("gemm", "fuse_wgrad"), [("grouped", True), ("grouped", False), ("loop", True)])
def test_grouped_forward_does_not_read_the_counts_on_the_host(
    megatron_state: None, monkeypatch: pytest.MonkeyPatch, gemm: str, fuse_wgrad: bool
) -> None:
    """With device counts (what the dispatcher hands over), the grouped forward reads them only on the device;
    the backward reads them on the host (the checks, the per-expert wgrad loop). The loop reads them at once."""
    reference = build("sequential", moe_config())
    module = grouped_like(reference, fuse_wgrad=fuse_wgrad, gemm=gemm)
    if fuse_wgrad:
        for linear in (module.linear_fc1, module.linear_fc2):
            linear.weight.main_grad = torch.zeros_like(linear.weight)
            linear.weight.grad_added_to_main_grad = False
    reads = []
    host = ExpertCounts.host
    monkeypatch.setattr(ExpertCounts, "host", lambda self: reads.append(1) or host(self))
    torch.manual_seed(3)
    x, probs = torch.randn(sum(COUNTS), HIDDEN, requires_grad=True), torch.rand(sum(COUNTS))
    out, _ = module(x, ExpertCounts(torch.tensor(COUNTS)), probs)
    assert bool(reads) == (gemm == "loop")
    reads.clear()
    out.backward(torch.randn_like(out))
    assert reads
    want, _ = run(reference, x.detach(), probs, torch.zeros_like(out))  # values: the sequential experts'
    torch.testing.assert_close(out.detach(), want)


@pytest.mark.parametrize(
    "overrides",
    [
        {"activation_func_clamp_value": 0.5, "glu_linear_offset": 1.0},
        {"gated_linear_unit": False, "activation_func": F.gelu},
        {"params_dtype": torch.bfloat16},  # bf16 rows times fp32 probabilities, rounded once
    ],
)
def test_grouped_mlp_activations_equal_megatrons(megatron_state: None, overrides: dict[str, Any]) -> None:
    """GroupedMLP's own forward (clamped and offset SwiGLU, a plain activation) against TEGroupedMLP's."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    module = build("grouped", moe_config(**overrides))
    assert module.plain_path()
    torch.manual_seed(4)
    dtype = module.linear_fc1.weight.dtype
    x, probs = torch.randn(sum(COUNTS), HIDDEN, dtype=dtype), torch.rand(sum(COUNTS))
    grad = torch.randn(sum(COUNTS), HIDDEN, dtype=dtype)
    got, got_dx = run(module, x, probs, grad)
    assert got.dtype == dtype
    got_grads = [module.linear_fc1.weight.grad.clone(), module.linear_fc2.weight.grad.clone()]
    module.zero_grad()
    x = x.detach().requires_grad_()
    want, _ = TEGroupedMLP.forward(module, x, torch.tensor(COUNTS), probs)
    want.backward(grad)
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(got_dx, x.grad)
    torch.testing.assert_close(got_grads, [module.linear_fc1.weight.grad, module.linear_fc2.weight.grad])
    single = moe_config(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True)
    assert not build("grouped", single).plain_path()  # probabilities on the input: Megatron's forward


def test_unsupported_settings_are_refused(megatron_state: None) -> None:
    biased = build("grouped", moe_config(add_bias_linear=True))  # GPT-OSS's experts: [E, out] biases, zeros at first
    assert biased.linear_fc1.bias.shape == (len(COUNTS), 2 * FFN)
    assert not biased.linear_fc2.bias.any()
    biased.activation_recompute = True  # off the plain path, Megatron's forward wants TE's per-expert bias lists
    with pytest.raises(ValueError, match="with biases"):
        biased(torch.randn(15, HIDDEN), torch.tensor(COUNTS), torch.ones(15))
    with pytest.raises(ValueError, match="bias_activation_fusion=True"):
        build("grouped", moe_config(activation_func=F.gelu, bias_activation_fusion=True))
    module = build("grouped", moe_config())
    with pytest.raises(ValueError, match="must add up to the 15 rows"):
        module.linear_fc1(torch.randn(15, HIDDEN), [5, 0, 7, 2])
    with pytest.raises(ValueError, match="3 counts for 4 local experts"):
        module.linear_fc1(torch.randn(15, HIDDEN), [5, 0, 10])
    module.linear_fc1.gemm = "grouped"  # counts on the device: checked there (on CPU at once), without waiting
    with pytest.raises(RuntimeError, match="must add up to the 15 rows"):
        module.linear_fc1(torch.randn(15, HIDDEN), ExpertCounts(torch.tensor([5, 0, 7, 2])))
    assert not experts.grouped_mm_available("cpu")


def _gpu_pair(fuse_wgrad: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two bf16 TEGroupedMLPs on the GPU with the same O(1)-scaled weights: grouped kernels and the loop."""
    config = moe_config(hidden_size=256, ffn_hidden_size=512, moe_ffn_hidden_size=512, params_dtype=torch.bfloat16)
    grouped, loop = build("grouped", config, fuse_wgrad), build("grouped", config, fuse_wgrad)
    with torch.no_grad():
        for name in ("linear_fc1", "linear_fc2"):
            weight = getattr(grouped, name).weight
            weight.copy_(torch.randn_like(weight, dtype=torch.float32) / weight.shape[-1] ** 0.5)
            getattr(loop, name).weight.copy_(weight)
    loop.linear_fc1.gemm = loop.linear_fc2.gemm = "loop"
    return grouped, loop


def _close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 GEMMs summed in another order: within a few bf16 ulps of O(1) values, and close in norm."""
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert (got.float() - want.float()).norm() <= 1e-2 * want.float().norm()


@pytest.mark.gpu
def test_grouped_kernels_match_the_loop_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert experts.grouped_mm_available("cuda")
    with one_process_megatron(port=29642, cpu=False):
        grouped, loop = _gpu_pair()
        torch.manual_seed(3)
        rows = 4 * 64 + 37  # uneven counts, one expert without tokens
        counts = torch.tensor([100, 0, 150, rows - 250])
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(rows, device="cuda")
        grad = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        results = []
        for module in (loop, grouped):
            calls = GroupedMMCalls(monkeypatch)
            inputs = x.detach().requires_grad_()
            out, _ = module(inputs, counts, probs)
            out.backward(grad)
            results.append((out, inputs.grad, module.linear_fc1.weight.grad, module.linear_fc2.weight.grad))
            assert calls.count == (6 if module is grouped else 0)  # the grouped path ran, the loop did not
        for got, want in zip(results[1], results[0], strict=True):
            _close_bf16(got, want)
        assert torch.count_nonzero(results[1][2][1]) == 0  # no tokens, no gradient


@pytest.mark.gpu
def test_grouped_kernels_accumulate_into_main_grad_on_gpu() -> None:
    """Two backward passes accumulate in fp32 into main_grad: the loop's bf16 gradients of each pass, summed in fp32
    (each rounded to bf16 once, up to half a bf16 ulp of values near 16: the absolute tolerance)."""
    with one_process_megatron(port=29643, cpu=False):
        grouped, loop = _gpu_pair(fuse_wgrad=True)
        for weight in (grouped.linear_fc1.weight, grouped.linear_fc2.weight):
            weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
            weight.grad_added_to_main_grad = False
        want = {
            name: torch.zeros_like(getattr(loop, name).weight, dtype=torch.float32)
            for name in ("linear_fc1", "linear_fc2")
        }
        counts = torch.tensor([64, 0, 200, 56])
        for _ in range(2):
            x = torch.randn(320, 256, device="cuda", dtype=torch.bfloat16)
            probs, grad = torch.rand(320, device="cuda"), torch.randn(320, 256, device="cuda", dtype=torch.bfloat16)
            for module in (grouped, loop):
                module(x, counts, probs)[0].backward(grad)
            for name, total in want.items():
                total += getattr(loop, name).weight.grad.float()
                getattr(loop, name).weight.grad = None
        for name, total in want.items():
            got = getattr(grouped, name).weight.main_grad
            torch.testing.assert_close(got, total, rtol=3e-2, atol=6e-2)
            assert (got - total).norm() <= 1e-2 * total.norm()


@pytest.mark.gpu
def test_dispatch_and_experts_forward_without_host_synchronisation() -> None:
    """At ep=1 the dispatcher's counts reach the grouped experts on the device: from the permutation to the
    combine, the forward queues its work without waiting for the GPU (CUDA's sync debug mode raises on any
    wait); the backward then reads the counts on the host, and the values equal the loop's."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from lightning_megatron.gpt.moe.dispatch import QueuedCountsDispatcher

    with one_process_megatron(port=29644, cpu=False):
        grouped, loop = _gpu_pair(fuse_wgrad=True)
        for weight in (grouped.linear_fc1.weight, grouped.linear_fc2.weight):
            weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
            weight.grad_added_to_main_grad = False
        groups = ProcessGroupCollection.use_mpu_process_groups()
        experts.grouped_mm_available("cuda")  # its one-time probe compares on the host
        dispatcher = QueuedCountsDispatcher(
            len(COUNTS), list(range(len(COUNTS))), config=grouped.config, pg_collection=groups
        )
        routing_map, probs = (t.cuda() for t in routing(300, len(COUNTS), 2, seed=7))
        x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        hidden, row_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
        hidden, row_probs = dispatcher.token_dispatch(hidden, row_probs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rows, counts, row_probs = dispatcher.dispatch_postprocess(hidden, row_probs)
            out, _ = grouped(rows, counts, row_probs)
            combined = dispatcher.combine_preprocess(out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(counts, ExpertCounts)
        assert not counts.on_host
        combined.float().square().sum().backward()
        assert counts.on_host  # read in the backward
        want, _ = loop(rows.detach(), torch.tensor(counts.host()), row_probs.detach())
        _close_bf16(out, want)
        assert torch.count_nonzero(grouped.linear_fc1.weight.main_grad) > 0
