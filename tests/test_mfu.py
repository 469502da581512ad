"""The standard MFU count (lightning_megatron/parallel/counts.py): 6 N + 6 layers hidden seq FLOPs per token, N the
parameters without the input embedding table, a tied embedding counted once (as the output head)."""

from __future__ import annotations

import pytest
import torch

from lightning_megatron import tiny_gpt
from tests.conftest import one_process_megatron

# tiny_gpt: 4 layers, hidden 64, 4 heads (as many query groups), ffn 128 (SwiGLU), vocab 256, no biases, RMSNorm.
LAYERS, HIDDEN, FFN, VOCAB = 4, 64, 128, 256
PER_LAYER = (
    3 * HIDDEN * HIDDEN + HIDDEN * HIDDEN + 2 * FFN * HIDDEN + FFN * HIDDEN + 2 * HIDDEN
)  # qkv, proj, fc1/2, norms
TABLE = VOCAB * HIDDEN  # the input embedding table, and the output head (the same matrix when tied)
N = LAYERS * PER_LAYER + HIDDEN + TABLE  # layers, final norm, head: the input table left out, tied or not


def chunk(first: bool = True, last: bool = True, **overrides: object) -> torch.nn.Module:
    """A GPTModel of tiny_gpt (``overrides`` on it) as MegatronLMModule builds it ('torch' kernels, CPU)."""
    from megatron.core.models.gpt import GPTModel

    from lightning_megatron.gpt.specs import block_spec

    config = tiny_gpt(**overrides)
    tc = config.to_transformer_config(kernels="torch")
    spec = block_spec(config, tc, None, "torch")
    return GPTModel(config=tc, transformer_layer_spec=spec, pre_process=first, post_process=last,
                    **config.gpt_model_kwargs("torch"))  # fmt: skip


@pytest.fixture(scope="module")
def megatron() -> None:
    with one_process_megatron(port=29671):
        yield


def test_flops_per_token_formula() -> None:
    from lightning_megatron.parallel.counts import model_flops_per_token

    assert model_flops_per_token(1000, 0, 2, 8, 16) == 6 * 1000 + 6 * 2 * 8 * 16  # causal: 6 L H S, not 12
    assert model_flops_per_token(1000, 500, 2, 8, 16) == 6 * 1000 + 4 * 500 + 6 * 2 * 8 * 16  # frozen: 4 FLOPs


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_count_leaves_the_input_embedding_out(megatron: None, tied: bool) -> None:
    from lightning_megatron.parallel.counts import flops_parameters, whole_model_counts

    model = chunk(share_embeddings_and_output_weights=tied)
    (total,) = whole_model_counts([model.parameters()], [True])
    assert total == N + (0 if tied else TABLE)  # the summary's count: every parameter, a tied matrix once
    assert flops_parameters([model]) == (N, 0)  # the same N tied or untied: the input table never counts


def test_frozen_parameters_are_counted_apart(megatron: None) -> None:
    from lightning_megatron.parallel.counts import flops_parameters

    model = chunk()
    for name, param in model.named_parameters():
        param.requires_grad = "linear_fc" not in name  # the MLPs frozen (as a LoRA base is)
    frozen = LAYERS * 3 * FFN * HIDDEN
    assert flops_parameters([model]) == (N - frozen, frozen)


def test_tied_embedding_counted_once_at_pp2(megatron: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pipeline stages of 2 layers each: the first holds the embedding, the last the head, which Megatron marks
    ``shared`` at PP>1 (its copy of the tied embedding). Each stage's count, as its rank makes it, sums to N."""
    from megatron.core import parallel_state

    from lightning_megatron.parallel.counts import flops_parameter_sets, parameter_share

    stages = [chunk(first=True, last=False, num_layers=2, share_embeddings_and_output_weights=True),
              chunk(first=False, last=True, num_layers=2, share_embeddings_and_output_weights=True)]  # fmt: skip
    head = stages[1].output_layer.weight
    assert head is not None
    assert stages[0].embedding.word_embeddings.weight.shape == head.shape
    head.shared = True  # what LanguageModule.setup_embeddings_and_output_layer marks at PP>1
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args, **kwargs: 2)  # one rank per stage
    counted = []
    for stage in stages:
        trainable, frozen = flops_parameter_sets([stage])
        assert not frozen
        counted.append(sum(parameter_share(p) for p in trainable))
    assert counted == [2 * PER_LAYER + TABLE, 2 * PER_LAYER + HIDDEN]  # the head's matrix once, on the first stage
    assert sum(counted) == N


def test_moe_counts_the_active_experts(megatron: None) -> None:
    """An MoE token runs through its top-k experts: each expert's parameters count k / E (the router, attention and
    a shared expert in full); the summary's count keeps every expert."""
    from lightning_megatron.parallel.counts import flops_parameters, whole_model_counts

    experts, topk, moe_ffn, shared = 4, 2, 32, 48
    model = chunk(num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
                  moe_shared_expert_intermediate_size=shared)  # fmt: skip
    expert = 3 * moe_ffn * HIDDEN  # one SwiGLU expert: fc1 [2 ffn, hidden], fc2 [hidden, ffn]
    dense_mlp = 2 * FFN * HIDDEN + FFN * HIDDEN
    moe_mlp = experts * HIDDEN + 3 * shared * HIDDEN  # router, shared expert
    n_all = N + LAYERS * (moe_mlp + experts * expert - dense_mlp)
    (total,) = whole_model_counts([model.parameters()], [True])
    assert total == n_all + TABLE
    assert flops_parameters([model]) == (n_all - LAYERS * (experts - topk) * expert, 0)
