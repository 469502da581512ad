"""fp8 GEMMs without Transformer Engine (kernels/fp8.py, kernels/linear.py): scaling, casting and autograd against
a dequantized reference on CPU (torch's CPU ``_scaled_mm``), errors, and the real path on a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.gpt import plan as resolve
from lightning_megatron.kernels import fp8, linear
from tests.conftest import one_process_megatron, run_in_triton_interpreter
from tests.linear_pairs import linear_pair


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29613):
        yield


def _dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, _, inv = fp8.quantize_pair(x, dtype)
    return q.float() * inv


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_scales_amax_to_the_largest_fp8_value(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 48) * 1e-3  # far below fp8's range: the scale brings it up
    q, qt, inv = fp8.quantize_pair(x, dtype)
    assert q.dtype == qt.dtype == dtype
    assert qt.is_contiguous()
    assert torch.equal(qt.float(), q.float().t())  # the second layout: the transpose
    assert q.float().abs().max() == torch.finfo(dtype).max
    mantissa = {fp8.E4M3: 3, fp8.E5M2: 2}[dtype]
    # Each value within half a unit in the last place of its binade (normal range), the scale exactly undone.
    assert torch.all((q.float() * inv - x).abs() <= x.abs() * 2.0 ** -(mantissa + 1) + 1e-12)
    zeros, _, zero_inv = fp8.quantize_pair(torch.zeros(16, 16), dtype)
    assert torch.isfinite(zero_inv)
    assert not zeros.float().any()


GRAD_DTYPES = {"hybrid": fp8.E5M2, "e4m3": fp8.E4M3}  # ModelConfig.fp8's formats: their output gradients' type


def _pair(
    kind: str, bias: bool, tokens: int = 16, fmt: str = "hybrid"
) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    reference, layer = linear_pair(kind, bias, linear.FP8_LINEARS[fmt], (32, 48))
    return reference, layer, torch.randn(tokens // 2, 2, 32)  # [S, B, H]


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize(("fmt", "with_main_grad"), [("hybrid", False), ("hybrid", True), ("e4m3", True)])
def test_fp8_linear_equals_the_dequantized_reference(
    megatron_state: None, kind: str, fmt: str, with_main_grad: bool
) -> None:
    _, layer, x = _pair(kind, bias=True, fmt=fmt)
    if with_main_grad:  # as Megatron's DDP sets up the weight
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        layer.weight.grad_added_to_main_grad = False
    x = x.requires_grad_()
    out, _ = layer(x)
    g = torch.randn_like(out)
    out.backward(g)
    # The reference: the same GEMMs on the dequantized fp8 operands, in fp32.
    xq, wq = _dequantized(x.detach().reshape(-1, 32), fp8.E4M3), _dequantized(layer.weight.detach(), fp8.E4M3)
    gq = _dequantized(g.reshape(-1, 48), GRAD_DTYPES[fmt])
    assert not torch.equal(gq, _dequantized(g.reshape(-1, 48), GRAD_DTYPES["e4m3" if fmt == "hybrid" else "hybrid"]))
    torch.testing.assert_close(out.reshape(-1, 48), xq @ wq.t() + layer.bias.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 32), gq @ wq, rtol=1e-5, atol=1e-5)
    wgrad = layer.weight.main_grad if with_main_grad else layer.weight.grad
    torch.testing.assert_close(wgrad, gq.t() @ xq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, g.reshape(-1, 48).sum(0))  # bias gradient not quantized


def test_fp8_linear_is_close_to_full_precision(megatron_state: None) -> None:
    reference, layer, x = _pair("column", bias=False, tokens=64)
    want, got = reference(x)[0], layer(x)[0]
    assert (got - want).norm() / want.norm() < 0.05  # e4m3 x e4m3 products: a few per cent
    assert (got - want).norm() / want.norm() > 0  # and really fp8


def test_a_weight_cast_is_reused_until_its_weight_changes(megatron_state: None) -> None:
    _, layer, x = _pair("column", bias=False)
    _, other, _ = _pair("column", bias=False)
    before, other_before = layer(x)[0], other(x)[0]  # both weights have a kept cast now
    kept = fp8._WEIGHTS.casts[layer.weight].casts
    assert torch.equal(layer(x)[0], before)
    assert fp8._WEIGHTS.casts[layer.weight].casts is kept  # unchanged weight: the kept cast, not a new one
    with torch.no_grad():
        layer.weight.mul_(2)  # in place on the parameter (its version counter moves); a power of two: the fp8
        # values stay, the inverse scale doubles
    assert torch.equal(layer(x)[0], 2 * before)  # seen by the version counter: cast again
    assert torch.equal(other(x)[0], other_before)  # the other weight's cast stays current
    layer.weight.data.mul_(2)  # as Megatron's optimizer writes: through another tensor, no version bump
    other.weight.data.mul_(2)
    assert torch.equal(layer(x)[0], 2 * before)  # not seen: the kept cast of the old weight
    fp8.weights_changed()  # what the optimizer-step wrapper calls after each step
    assert torch.equal(layer(x)[0], 4 * before)
    assert torch.equal(other(x)[0], 2 * other_before)
    assert torch.equal(layer(x)[0], 4 * before)  # and reused again
    fp8.forget_weight_casts([layer])
    assert layer.weight not in fp8._WEIGHTS.casts
    assert other.weight in fp8._WEIGHTS.casts


def test_shapes_fp8_cannot_take_run_unquantized(megatron_state: None) -> None:
    reference, layer, _ = _pair("column", bias=False)
    x = torch.randn(5, 2, 32)  # 10 tokens: not a multiple of 16
    torch.testing.assert_close(layer(x)[0], reference(x)[0])


def test_each_fp8_format_builds_its_linears() -> None:
    from lightning_megatron.gpt.specs import layer_spec

    for fmt, (column, row) in linear.FP8_LINEARS.items():
        assert column.fp8
        assert row.fp8
        assert column.fp8_grad_dtype == row.fp8_grad_dtype == GRAD_DTYPES[fmt]
        spec = layer_spec(tiny_gpt(kernels="torch", fp8=fmt), "torch", fp8=True).submodules
        attention, mlp = spec.self_attention.submodules, spec.mlp.keywords["submodules"]
        assert (attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2) == (column, row) * 2
        assert f"fp8 GEMMs in the transformer layers ('{fmt}' format" in resolve.describe("torch", True, fmt)
    assert "fp8" not in resolve.describe("torch", True, None)


def test_fp8_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"fp8='e5m2' is not supported; pick one of \[None, 'hybrid', 'e4m3'\]"):
        tiny_gpt(fp8="e5m2")
    with pytest.raises(ValueError, match=r"fp8='hybrid' is the torch-native fp8 path; with kernels='te'"):
        ModelConfig(**{**tiny_gpt().__dict__, "kernels": "te", "fp8": "hybrid"})
    with pytest.raises(ValueError, match=r"needs a GPU with fp8 tensor cores .* this run is on a CPU"):
        resolve.use_fp8("hybrid", "torch", "cpu")
    assert not resolve.use_fp8(None, "torch", "cpu")
    # A GPU with fp8 tensor cores but no Triton (the GPU's cast kernel); CPU runs never need Triton.
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)
    monkeypatch.setattr(resolve, "triton_available", lambda: False)
    assert resolve.use_fp8("hybrid", "torch", "cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"fp8='hybrid'\) casts to fp8 with a Triton kernel.*use fp8=None"):
        resolve.use_fp8("hybrid", "torch", "cuda")
    q, qt, inv = fp8.quantize_pair(torch.randn(32, 16), fp8.E4M3)
    assert fp8.scaled_mm(q, inv, q.t(), inv, torch.float32).shape == (32, 32)  # q @ q^T, q.t() column-major
    with pytest.raises(ValueError, match=r"scaled_mm needs a row-major first operand and a column-major second"):
        fp8.scaled_mm(q, inv, qt, inv, torch.float32)  # the same product with qt [16, 32] row-major: a copy


def _losses(fp8_mode: str | None) -> list[float]:
    batch = synthetic_tokens(8, 32, 256, seed=5)
    batch[:, 16:] = batch[:, :16]  # learnable: the second half repeats the first
    data = batch.repeat(6, 1)  # the same batch every step: the loss must fall
    model = MegatronLMModule(tiny_gpt(kernels="torch", fp8=fp8_mode), lr=3e-3, decay_steps=8)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert model.fp8 == (fp8_mode is not None)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    linears = [m for m in model.chunks[0].decoder.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert len(linears) == 4 * 4  # qkv, proj, fc1, fc2 per layer
    assert all(type(m).__name__.startswith("Fp8") == model.fp8 for m in linears), {type(m).__name__ for m in linears}
    if fp8_mode is not None:  # each format's gradient type reached every linear of the module's chunks
        assert {m.fp8_grad_dtype for m in linears} == {GRAD_DTYPES[fp8_mode]}
    assert not type(model.chunks[0].output_layer).__name__.startswith("Fp8")  # the LM head stays bf16
    return losses


def test_fp8_training_follows_full_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU has no fp8 tensor cores (the build raises there), but torch's CPU _scaled_mm runs the same GEMMs: let
    # the check pass to train through Megatron's DDP and optimizer with fp8 linears.
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)
    weight_casts = []
    cast = fp8.quantize_pair

    def counting(x: torch.Tensor, *args: object) -> object:
        weight_casts.extend([1] if isinstance(x, torch.nn.Parameter) else [])
        return cast(x, *args)

    monkeypatch.setattr(fp8, "quantize_pair", counting)
    quantized, full = _losses("hybrid"), _losses(None)
    # 6 steps of 4 micro-batches, 16 fp8 linears: the weights are cast on each step's first micro-batch only
    assert len(weight_casts) == 6 * 16
    monkeypatch.setattr(linear, "quantize_weight", lambda weight, dtype: fp8.quantize_pair(weight, dtype))  # no reuse
    assert _losses("hybrid") == quantized  # the same casts, bit for bit
    assert len(weight_casts) == 6 * 16 + 6 * 4 * 16
    assert quantized != full
    assert quantized == pytest.approx(full, rel=2e-2)
    e4m3 = _losses("e4m3")  # the other format: other gradients from the first step on, as close to full precision
    assert e4m3[0] == quantized[0]
    assert e4m3[1:] != quantized[1:]
    assert e4m3 == pytest.approx(full, rel=2e-2)
    assert quantized[-1] < quantized[0] - 0.1
    assert full[-1] < full[0] - 0.1


def _interpreted_kernel_checks() -> None:
    """The Triton kernels' logic on CPU tensors (run by the test below under ``TRITON_INTERPRET=1``)."""
    from lightning_megatron.kernels.fp8_triton import amax, cast_transpose

    torch.manual_seed(0)
    x = torch.randn(300, 136, dtype=torch.bfloat16) * 3  # 40,800 elements: 10 blocks over 8 programs (a loop)
    x.view(-1)[-1] = -50.0  # the amax in the last element: the loop's and the mask's edge
    assert amax(x).item() == 50.0
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, qt, inv = cast_transpose(x, amax(x), dtype)
        # (not q's values: the interpreter's fp8 rounding is its own, e.g. 31.08 -> 16 where the GPU gives 32)
        assert torch.equal(inv, fp8.quantize_pair(x, dtype)[2])  # IEEE divisions, as the CPU's
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    off, on = torch.zeros((), dtype=torch.int32), torch.ones((), dtype=torch.int32)
    assert amax(x, off).item() == 0.0
    assert amax(x, on).item() == 50.0
    kept = [t.clone() for t in (q, qt, inv)]
    cast_transpose(x * 2, amax(x * 2, off), fp8.E5M2, (q, qt, inv), off)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip((q, qt), kept[:2], strict=True))
    assert torch.equal(inv, kept[2])
    nan = torch.ones(64, 64, dtype=torch.bfloat16)
    nan[3, 5] = float("nan")
    for top in (amax(nan), torch.linalg.vector_norm(nan, float("inf"))):  # the graphs' amax and the eager one
        assert not torch.isfinite(cast_transpose(nan, top, fp8.E4M3)[2])  # inverse scale: every GEMM non-finite
    for bad in (torch.empty(0, 16, dtype=torch.bfloat16), x.t()):  # empty; not contiguous
        with pytest.raises(ValueError, match="fp8 casts take a contiguous, non-empty tensor"):
            cast_transpose(bad, amax(x), fp8.E4M3)


def test_triton_kernels_in_the_interpreter() -> None:
    """amax (with its loop over blocks and the gate), the cast into both layouts and its inverse scale, the gated
    cast writing nothing, and a NaN input giving a non-finite scale with either amax -- on CPU, through Triton's
    interpreter (a fresh process: the variable is read when the kernels are defined). The GPU tests check the bits."""
    run_in_triton_interpreter("tests.test_fp8", "_interpreted_kernel_checks")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("shape", [(200, 136), (2500, 1000)])
def test_gpu_cast_transpose_equals_the_cpu_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """200 x 136: not a multiple of the cast kernel's 64-wide tiles; 2500 x 1000: more blocks than the amax kernel
    has programs on an H100/H200 (4 per SM, 4096 elements each), so that its programs loop."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.bfloat16) * 3
    x.view(-1)[-1] = -50.0  # the amax in the last element: the loop's and the mask's edge
    want = fp8.quantize_pair(x, dtype)
    got = fp8.quantize_pair(x.cuda(), dtype)
    from lightning_megatron.kernels.fp8_triton import amax  # the amax of graph-captured casts (eager: torch's)

    assert amax(x.cuda()).item() == x.abs().max().float().item()
    bits = [t.cpu().view(torch.uint8) if t.dtype == dtype else t.cpu() for t in (*got, *want)]  # NaN-safe
    for name, a, b, t in zip(("q", "q.t()", "inverse scale"), bits[:3], bits[3:], got, strict=True):
        assert t.is_contiguous(), name
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_cast_of_a_tensor_with_nan_is_not_finite() -> None:
    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    assert not torch.isfinite(fp8.quantize_pair(x, fp8.E4M3)[2])  # the inverse scale: every GEMM output non-finite


@pytest.mark.gpu
def test_a_graph_captured_cast_follows_its_device_flag_at_each_replay() -> None:
    """The weight cast as CUDA graphs capture it (``fp8.quantize_weight``): amax and cast both gated by a device
    flag that each replay reads -- 1 recasts the weight in place, 0 leaves the last cast."""
    torch.manual_seed(0)
    w = torch.randn(320, 192, device="cuda", dtype=torch.bfloat16)
    flag = torch.ones((), dtype=torch.int32, device="cuda")
    out = fp8.quantize_pair(w, fp8.E4M3, active=flag)  # also compiles the gated kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # on a side stream of its own
        fp8.quantize_pair(w, fp8.E4M3, out, flag)

    def bits(tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [t.view(torch.uint8) if t.dtype == fp8.E4M3 else t for t in tensors]

    w.mul_(2.5)  # a new amax (the scale changes): a skipped cast would show
    graph.replay()
    want = bits(fp8.quantize_pair(w, fp8.E4M3))
    assert all(torch.equal(a, b) for a, b in zip(bits(out), want, strict=True))
    flag.fill_(0)
    w.mul_(-0.3)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(bits(out), want, strict=True))


@pytest.mark.gpu
def test_fp8_linear_on_gpu() -> None:
    assert fp8.fp8_supported(torch.device("cuda"))
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    x8, _, x_inv = fp8.quantize_pair(x, fp8.E4M3)
    w8, w8t, w_inv = fp8.quantize_pair(w, fp8.E4M3)
    got = fp8.scaled_mm(x8, x_inv, w8.t(), w_inv, torch.bfloat16)
    want = (x8.float() * x_inv) @ (w8.float() * w_inv).t()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)  # bf16 output rounding
    assert (got.float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm() < 0.05
    assert torch.equal(w8t.t().float(), w8.float())


def _assert_fp8_gemm(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_bits: int, added: float = 0.0) -> None:
    """``got`` is ``added + a @ b`` of exact fp8 operands as Hopper's fp8 tensor cores compute it: their accumulator
    keeps about 14 bits (DeepSeek-V3's report), so each element may be off by a small part of the sum of its
    products' magnitudes, plus the output type's rounding (``out_bits``: significand bits with the implicit one,
    bf16 8, fp32 24). The 2^-12 allowed is a margin, not derived: 4x the largest error of the first GPU run (0.033,
    on bf16 outputs whose products' magnitudes sum to ~650)."""
    want = added + a.double() @ b.double()
    bound = (a.abs().double() @ b.abs().double()) * 2.0**-12 + want.abs() * 2.0**-out_bits
    err = (got.double() - want).abs()
    print(
        f"fp8 GEMM: worst error / allowed {(err / bound).max().item():.3f}, relative norm error "
        f"{((got.double() - want).norm() / want.norm()).item():.2e}"
    )
    assert torch.all(err <= bound)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("fmt", list(linear.FP8_LINEARS))
def test_fp8_linear_gradients_on_gpu_equal_the_dequantized_reference(kind: str, fmt: str) -> None:
    """The three GEMMs of the real GPU path (Triton casts, CUDA ``_scaled_mm``) through Megatron's layer, against
    float64 GEMMs of the dequantized operands: the forward output, the input gradient and the fp32 weight gradient
    accumulated into ``main_grad``."""

    def dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [..., K] -> [N, K], as the GEMMs see it
        return _dequantized(t.detach().reshape(-1, t.shape[-1]), dtype)

    with one_process_megatron(port=29614, cpu=False):
        _, layer = linear_pair(kind, False, linear.FP8_LINEARS[fmt], (1024, 2048))
        layer = layer.cuda().bfloat16()
        layer.weight.main_grad = torch.ones_like(layer.weight, dtype=torch.float32)  # accumulated into, not set
        layer.weight.grad_added_to_main_grad = False
        torch.manual_seed(0)
        x = torch.randn(1024, 4, 1024, device="cuda", dtype=torch.bfloat16).requires_grad_()  # [S, B, in]
        assert x.is_cuda  # not CPU mode's stand-ins (until 2026-12-03 this test ran on CPU)
        out, _ = layer(x)
        g = torch.randn_like(out) * 1e-3  # gradients far below fp8's range: the scale brings them up
        out.backward(g)
        xq, wq, gq = dequantized(x, fp8.E4M3), dequantized(layer.weight, fp8.E4M3), dequantized(g, GRAD_DTYPES[fmt])
        _assert_fp8_gemm(out.reshape(-1, 2048), xq, wq.t(), out_bits=8)  # bf16 output
        _assert_fp8_gemm(x.grad.reshape(-1, 1024), gq, wq, out_bits=8)
        # the weight gradient stays fp32 from the GEMM into main_grad, added to the 1 it held
        _assert_fp8_gemm(layer.weight.main_grad, gq.t(), xq, out_bits=24, added=1.0)
        assert layer.weight.grad_added_to_main_grad  # Megatron's DDP hook then discards the placeholder .grad
