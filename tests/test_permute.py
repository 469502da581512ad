"""MoE token permutation without atomic adds (lightning_megatron.kernels.permute, patches.UniformTokenPermutation)
against Megatron-Core's own permute/unpermute: the same rows, probs, indices, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from lightning_megatron.compat import patches
from lightning_megatron.kernels import permute
from tests.moe_kernel_inputs import moe_config, routing


@pytest.mark.parametrize(("experts", "k"), [(8, 2), (4, 1), (6, 6)])
def test_permutation_equals_megatrons(experts: int, k: int) -> None:
    tokens, hidden = 37, 16
    routing_map, probs = routing(tokens, experts, k, seed=experts + k)
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad_rows = torch.randn(tokens * k, hidden, dtype=torch.float64)
    grad_out = torch.randn(tokens, hidden, dtype=torch.float64)
    results = []
    for ours in (False, True):
        inputs = x.clone().requires_grad_()
        if ours:
            rows, row_probs, indices = permute.permute(inputs, routing_map, k, probs)
        else:
            rows, row_probs, indices, _, _ = moe_utils.permute(inputs, routing_map, probs, num_out_tokens=tokens * k)
        weighted = (rows * 3.0).detach().requires_grad_()  # what the experts would return, per row
        if ours:
            out = permute.unpermute(weighted, indices, tokens)
        else:
            out = moe_utils.unpermute(weighted, indices, restore_shape=x.shape, routing_map=routing_map)
        (rows * grad_rows).sum().backward()
        (out * grad_out).sum().backward()
        results.append((rows, row_probs, indices, out, inputs.grad, weighted.grad))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_map_without_k_experts_per_token_is_refused() -> None:
    routing_map, probs = routing(8, 4, 2, seed=0)
    routing_map[0] = False  # token 0 routed nowhere: 7 x 2 + 0 rows, not 8 x 2
    with pytest.raises(RuntimeError, match="exactly k routed experts"):
        permute.permute(torch.randn(8, 4), routing_map, 2, probs)


def test_the_patch_takes_only_calls_it_reproduces() -> None:
    routing_map, probs = routing(10, 4, 2, seed=3)
    x = torch.randn(10, 8)
    with patches.UniformTokenPermutation(permute):
        rows, _, indices, _, _ = token_dispatcher.permute(x, routing_map, num_out_tokens=20)
        assert permute.has_token_order(indices)
        out = token_dispatcher.unpermute(rows, indices, restore_shape=x.shape, routing_map=routing_map)
        torch.testing.assert_close(out, x * 2)  # each token's two rows summed
        # A device tensor as num_out_tokens, or probs at unpermute: Megatron's own functions.
        _, _, megatron_indices, _, _ = token_dispatcher.permute(x, routing_map, num_out_tokens=torch.tensor(20))
        assert not permute.has_token_order(megatron_indices)
        weighted = token_dispatcher.unpermute(rows, indices, x.shape, probs=probs, routing_map=routing_map)
        torch.testing.assert_close(weighted, x * probs.sum(1, keepdim=True))
    assert token_dispatcher.permute is moe_utils.permute
    assert token_dispatcher.unpermute is moe_utils.unpermute


def test_queued_counts_dispatcher_equals_megatrons() -> None:
    """The MoE layer's all-gather dispatcher at ep=1 (gpt/moe/dispatch.py): the same rows, counts (on the host),
    probabilities, combined output and gradients as Megatron's, without the patch installed."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from lightning_megatron.gpt.moe.dispatch import QueuedCountsDispatcher, queued_counts_apply
    from lightning_megatron.kernels.expert_counts import ExpertCounts
    from tests.conftest import one_process_megatron

    tokens, k = 23, 2
    with one_process_megatron(port=29643):
        config = moe_config(params_dtype=torch.float64)
        experts = config.num_moe_experts
        assert queued_counts_apply(config, experts)
        assert not queued_counts_apply(config, experts // 2)
        groups = ProcessGroupCollection.use_mpu_process_groups()
        routing_map, probs = routing(tokens, experts, k, seed=5)
        x = torch.randn(tokens, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        results = []
        for kind in (MoEAllGatherTokenDispatcher, QueuedCountsDispatcher):
            dispatcher = kind(experts, list(range(experts)), config=config, pg_collection=groups)
            inputs, row_probs_in = x.clone().requires_grad_(), probs.clone().requires_grad_()
            hidden, dispatched_probs = dispatcher.dispatch_preprocess(inputs, routing_map, row_probs_in)
            hidden, dispatched_probs = dispatcher.token_dispatch(hidden, dispatched_probs)
            rows, counts, row_probs = dispatcher.dispatch_postprocess(hidden, dispatched_probs)
            weighted = rows * row_probs.unsqueeze(-1) * 3.0  # what the experts would return, per row
            out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(weighted)))
            out.square().sum().backward()
            if kind is QueuedCountsDispatcher:  # the experts' counts: on the device, their host copy queued
                assert isinstance(counts, ExpertCounts)
                counts = torch.tensor(counts.host())
            else:
                assert counts.device.type == "cpu"  # Megatron's: copied to the host (a wait on a GPU)
            results.append((rows, counts, row_probs, out, inputs.grad, row_probs_in.grad))
        for got, want in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_compiled_row_sum_equals_the_written_out_one_on_gpu() -> None:
    """The tokens' k rows summed by the compiled kernel (kernels/permute.py) equal the eager gather and sum in bf16:
    the same fp32 accumulation, one rounding."""
    tokens, experts, k, hidden = 1000, 16, 4, 512
    routing_map, probs = routing(tokens, experts, k, seed=7)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    rows, _, indices = permute.permute(x.requires_grad_(), routing_map.cuda(), k, probs.cuda())
    weighted = (rows.detach() * torch.rand(tokens * k, 1, device="cuda")).to(torch.bfloat16)
    order = indices.token_order
    got = permute.unpermute(weighted, indices, tokens)
    want = permute.gathered_sum(weighted, order, k)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2**-8  # one bf16 ulp or two
    rows.backward(torch.ones_like(rows))  # the gather's backward: each token's k rows of ones summed
    torch.testing.assert_close(x.grad.float(), torch.full_like(x.grad, k, dtype=torch.float32))
