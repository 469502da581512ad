"""Weight gradients accumulated into ``main_grad`` in the GEMM (kernels/linear.py) equal Megatron's unfused path."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.gpt import plan as resolve
from lightning_megatron.kernels import linear
from tests.conftest import one_process_megatron
from tests.linear_pairs import linear_pair


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29612):
        yield


def test_accumulate_wgrad_adds_the_weight_gradient() -> None:
    torch.manual_seed(0)
    g, x = torch.randn(10, 6), torch.randn(10, 4)  # [N, out], [N, in]
    main = torch.randn(6, 4)
    want = main + g.t() @ x
    linear.accumulate_wgrad(main, g, x)
    torch.testing.assert_close(main, want)
    # bf16 activations into an fp32 buffer (the upcast GEMM on CPU; the fp32-output GEMM on GPU).
    main = torch.zeros(6, 4)
    linear.accumulate_wgrad(main, g.bfloat16(), x.bfloat16())
    torch.testing.assert_close(main, g.bfloat16().float().t() @ x.bfloat16().float())


def _pair(kind: str, bias: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    return linear_pair(kind, bias, (linear.FusedWgradColumnParallelLinear, linear.FusedWgradRowParallelLinear), (8, 12))


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linears_accumulate_into_main_grad(megatron_state: None, kind: str, bias: bool) -> None:
    reference, layer = _pair(kind, bias)
    layer.weight.main_grad = torch.zeros_like(layer.weight)  # what Megatron's DDP sets up
    layer.weight.grad_added_to_main_grad = False
    inputs = [torch.randn(5, 2, 8, requires_grad=True) for _ in range(2)]  # [S, B, H], two micro-batches
    for x in inputs:
        out, _ = reference(x)
        got, _ = layer(x.detach().requires_grad_())
        torch.testing.assert_close(got, out)
        out.square().sum().backward()
        x_fused = x.detach().requires_grad_()
        layer(x_fused)[0].square().sum().backward()
        torch.testing.assert_close(x_fused.grad, x.grad)
        x.grad = None
    torch.testing.assert_close(layer.weight.main_grad, reference.weight.grad)  # both micro-batches summed
    assert layer.weight.grad_added_to_main_grad  # DDP's hook discards the placeholder grad
    if bias:
        torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


def test_without_main_grad_the_layer_is_megatrons(megatron_state: None) -> None:
    reference, layer = _pair("column", bias=False)  # not wrapped by Megatron's DDP: no main_grad
    x = torch.randn(5, 2, 8)
    reference(x)[0].sum().backward()
    layer(x)[0].sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_resolution() -> None:
    assert not resolve.fuse_wgrad(None, "torch", "cpu")  # off on CPU by default
    assert not resolve.fuse_wgrad(None, "local", "cuda")
    assert resolve.fuse_wgrad(True, "local", "cpu")
    assert not resolve.fuse_wgrad(False, "torch", "cuda")
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True.*Transformer Engine"):
        resolve.fuse_wgrad(True, "te", "cuda")


def test_shared_weights_get_a_zero_placeholder(megatron_state: None) -> None:
    # Tied embeddings on one stage: the weight also gets the embedding's gradient, which Megatron's hook adds to
    # main_grad together with the placeholder (zero_out_wgrad), so the placeholder must be zeros.
    _, layer = _pair("column", bias=False)
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = True
    layer(torch.randn(5, 2, 8))[0].sum().backward()
    assert torch.count_nonzero(layer.weight.grad) == 0
    assert torch.count_nonzero(layer.weight.main_grad) > 0


@pytest.mark.parametrize("training", [True, False])
def test_lm_head_lays_its_logits_out_batch_first(megatron_state: None, training: bool) -> None:
    """GPTModel returns ``logits.transpose(0, 1).contiguous()``: with the LM head's output laid out [B, S, V] that
    is no copy. Values and gradients stay those of Megatron's layer."""
    reference, layer = linear_pair(
        "column", False, (linear.FusedWgradLMHead, linear.FusedWgradRowParallelLinear), (8, 12)
    )
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(5, 2, 8)  # [S, B, H]
    want = reference(x.requires_grad_())[0]
    x_head = x.detach().requires_grad_()
    with torch.set_grad_enabled(training):
        out = layer(x_head)[0]  # [S, B, V]
    logits = out.transpose(0, 1)  # what GPTModel returns: [B, S, V]
    assert logits.is_contiguous()
    torch.testing.assert_close(out, want)
    if not training:
        return
    g = torch.randn(2, 5, 12)  # [B, S, V], as the loss gives it
    want.transpose(0, 1).backward(g)
    logits.contiguous().backward(g)
    torch.testing.assert_close(x_head.grad, x.grad)
    assert x_head.grad.is_contiguous()  # [S, B, H], as the final norm's backward wants it
    torch.testing.assert_close(layer.weight.main_grad, reference.weight.grad)


def _losses(fused: bool, **overrides: object) -> tuple[list[float], MegatronLMModule]:
    data = synthetic_tokens(32, 32, 256, seed=5)
    config = tiny_gpt(kernels="torch", gradient_accumulation_fusion=fused, **overrides)
    model = MegatronLMModule(config, lr=3e-3, decay_steps=8)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))  # 4 micro-batches per step accumulate into main_grad
    return losses, model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_embeddings"])
def test_training_with_fused_wgrad_equals_megatrons_path(tied: bool) -> None:
    fused, model = _losses(True, share_embeddings_and_output_weights=tied)
    assert model.fused_wgrad
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    chunk = model.chunks[0]
    linears = [m for m in chunk.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert len(linears) == 4 * 4 + 1  # qkv, proj, fc1, fc2 per layer (MLP specs are partials), the LM head
    assert all(type(m).__name__.startswith("FusedWgrad") for m in linears), {type(m).__name__ for m in linears}
    assert type(chunk.output_layer) is linear.FusedWgradLMHead
    unfused, plain = _losses(False, share_embeddings_and_output_weights=tied)
    assert not any("Fused" in type(m).__name__ for m in plain.chunks[0].modules())
    assert fused == pytest.approx(unfused, rel=1e-5)
    assert len(set(fused)) == len(fused)  # it trains


@pytest.mark.gpu
def test_fused_wgrad_on_gpu() -> None:
    assert linear.mixed_dtype_addmm_available()
    torch.manual_seed(0)
    g = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    main = torch.randn(1024, 512, device="cuda")
    want = main + g.float().t() @ x.float()
    linear.accumulate_wgrad(main, g, x)
    torch.testing.assert_close(main, want, rtol=1e-4, atol=1e-2)  # fp32 accumulation of bf16 products
    assert resolve.fuse_wgrad(None, "torch", "cuda")
