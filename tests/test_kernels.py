"""The torch-native fast path matches Megatron's reference local spec (outputs and gradients, fp32, CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightning_megatron import tiny_gpt
from lightning_megatron.gpt import plan as resolve
from lightning_megatron.gpt import specs
from lightning_megatron.kernels import attention, cross_entropy
from lightning_megatron.kernels.compile import for_device
from tests.conftest import one_process_megatron


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29594):
        yield


def _gpt(config, kernel_set: str, compile_fusions: bool = False):
    from megatron.core.models.gpt import GPTModel

    tc = config.to_transformer_config(kernels=kernel_set, compile_fusions=compile_fusions, params_dtype=torch.float32)
    return GPTModel(
        config=tc,
        transformer_layer_spec=specs.block_spec(config, tc, None, kernel_set),
        **config.gpt_model_kwargs(kernel_set),
    )


def _forward_backward(model, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, None)  # [B, S, V]
    (logits.float().square().mean() + logits.float().logsumexp(-1).mean()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_query_groups": 2, "qk_layernorm": True},
        {"kv_channels": 8, "rotary_percent": 0.5},
        {"rope_scaling": True, "rotary_base": 500000, "seq_len_interpolation_factor": 2.0},
        {"position_embedding_type": "learned_absolute"},
    ],
    ids=["mha", "gqa_qknorm", "partial_rope", "rope_scaled", "learned_pos"],
)
def test_sdpa_layers_match_local_spec(megatron_state: None, overrides: dict) -> None:
    config = tiny_gpt(**overrides)
    torch.manual_seed(0)
    local = _gpt(config, "local")
    fast = _gpt(config, "torch")
    assert any(type(m).__name__ == "SDPAttention" for m in fast.modules())
    assert not any(type(m).__name__ == "SDPAttention" for m in local.modules())
    fast.load_state_dict(local.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    want_logits, want_grads = _forward_backward(local, tokens)
    got_logits, got_grads = _forward_backward(fast, tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sdpa_honours_an_explicit_mask(megatron_state: None) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    tc = tiny_gpt().to_transformer_config(kernels="torch", params_dtype=torch.float32)
    sdpa = attention.SDPAttention(tc, 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(6, 2, 4, 16) for _ in range(3))  # [S, B, heads, d]
    causal = sdpa(q, k, v, None)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)  # Megatron's convention: True = masked out
    torch.testing.assert_close(sdpa(q, k, v, mask), causal)
    assert causal.shape == (6, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_matches_megatron(megatron_state: None, dtype: torch.dtype) -> None:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = (3 * torch.randn(3, 7, 50)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    weights = torch.rand(3, 7)
    (cross_entropy.vocab_parallel_cross_entropy(logits, targets) * weights).sum().backward()
    ref = logits.detach().clone().requires_grad_()
    want = vocab_parallel_cross_entropy(ref.float(), targets)
    (want * weights).sum().backward()
    got = cross_entropy.vocab_parallel_cross_entropy(logits.detach(), targets)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want.detach(), **tol)
    assert logits.grad.dtype == dtype  # gradient written in the logits' dtype, no float32 copy kept
    torch.testing.assert_close(logits.grad, ref.grad, **tol)


def test_compiled_cross_entropy_kernels_match_eager() -> None:
    # On GPU these kernels run torch.compile'd; inductor compiles for CPU too, so check it gives the same.
    def _compiled(fn):  # what for_device returns for a CUDA device
        return for_device(fn, torch.device("cuda"))

    torch.manual_seed(0)
    logits = torch.randn(16, 40)
    target = torch.randint(0, 40, (16,))
    in_range = target < 30  # as if the rest lived on another tensor-parallel rank
    local = torch.where(in_range, target, 0)
    logits_max = logits.amax(-1)
    want = cross_entropy._ce_stats(logits, logits_max, local, in_range)
    got = _compiled(cross_entropy._ce_stats)(logits, logits_max, local, in_range)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    lse, grad = logits.logsumexp(-1), torch.rand(16)
    torch.testing.assert_close(
        _compiled(cross_entropy._ce_grad)(logits, lse, local, in_range, grad),
        cross_entropy._ce_grad(logits, lse, local, in_range, grad),
    )
    # RoPE (forward and backward through the compiled graph), half the head dims rotated
    t = torch.randn(6, 2, 3, 8, requires_grad=True)
    angles = torch.rand(6, 1, 1, 4) * 6
    want = attention._rope(t, angles.cos(), angles.sin())
    want.square().sum().backward()
    want_grad, t.grad = t.grad, None
    got = _compiled(attention._rope)(t, angles.cos(), angles.sin())
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(t.grad, want_grad)


def test_kernel_choice() -> None:
    assert resolve.resolve("auto", "cpu") == "torch"  # takes packed rows and CP (the local attention takes neither)
    assert resolve.resolve("torch", "cpu") == "torch"
    assert resolve.resolve("auto", "cuda") == ("te" if resolve.te_available() else "torch")
    if not resolve.te_available():
        with pytest.raises(ValueError, match="needs Transformer Engine"):
            resolve.resolve("te", "cuda")
    with pytest.raises(ValueError, match="kernels='bogus'"):
        tiny_gpt(kernels="bogus")


def test_experts_with_biases_are_kept_off_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Biased experts (GPT-OSS) run on our grouped experts only: with Transformer Engine installed 'auto' picks the
    torch-native kernels for them ('te' is refused by ModelConfig: tests/test_catalogue.py); experts without biases
    keep 'te'."""
    from lightning_megatron.gpt.plan import KernelPlan

    monkeypatch.setattr(resolve, "te_available", lambda: True)
    biased = {"num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": True}
    assert KernelPlan.resolve(tiny_gpt(**biased), "cuda").kernels == "torch"
    assert KernelPlan.resolve(tiny_gpt(**{**biased, "add_bias_linear": False}), "cuda").kernels == "te"


def test_torch_kernels_turn_on_compiled_fusions_only_when_asked() -> None:
    config = tiny_gpt()
    on = config.to_transformer_config(kernels="torch", compile_fusions=True)
    assert on.bias_activation_fusion
    assert on.bias_dropout_fusion
    off = config.to_transformer_config(kernels="torch", compile_fusions=False)
    assert not off.bias_activation_fusion
    assert not off.bias_dropout_fusion
    gelu = tiny_gpt(activation="gelu", gated_linear_unit=False).to_transformer_config(
        kernels="torch", compile_fusions=True
    )
    assert not gelu.bias_activation_fusion  # Megatron has no fused path for GeLU without a bias


def test_moe_with_expert_biases_builds_with_the_compiled_fusions(megatron_state: None) -> None:
    """GPU runs turn the compiled fusions on; Megatron's grouped experts assert bias-dropout fusion off when experts
    carry biases (GPT-OSS), so such a model leaves it off and builds."""
    config = tiny_gpt(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, add_bias_linear=True)
    assert not config.to_transformer_config(kernels="torch", compile_fusions=True).bias_dropout_fusion
    assert _gpt(config, "torch", compile_fusions=True) is not None
    dense = tiny_gpt(add_bias_linear=True).to_transformer_config(kernels="torch", compile_fusions=True)
    assert dense.bias_dropout_fusion  # the fusion stays on where nothing forbids it
