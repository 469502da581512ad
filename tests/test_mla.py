"""Multi-Latent Attention on the torch-native stack: the core attention against a float64 reference (query/key heads
of 16 + 8, value heads of 16), packed rows, the config's checks, and a tiny MLA model training at one process and
continuing at TP=2 from its checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron import tiny_gpt
from lightning_megatron.kernels.attention import SDPAttention
from lightning_megatron.kernels.documents import SequenceLayout
from tests.conftest import (
    assert_continues_at_tp2_with_sp,
    one_process_megatron,
    one_process_trainer,
    run_in_triton_interpreter,
)
from tests.torch_gpt_models import assert_packed_row_is_its_documents, torch_gpt

QK, ROPE, V = 16, 8, 16  # tiny_gpt's MLA head sizes: query/key 16 + 8, value 16
MLA = {"multi_latent_attention": True}
# YaRN with its softmax-scale correction (mscale_all_dim) and a latent query (q_lora_rank) with the latent norms.
MLA_YARN = {
    **MLA, "q_lora_rank": 16, "qk_layernorm": True, "rope_type": "yarn", "rotary_scaling_factor": 4.0,
    "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29597):
        yield


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of [S, B, n, d] tensors; ``allowed`` [B, S, S] True = attend; returns [S, B, n * d_v]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [B, n, S, d]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = scores.softmax(-1) @ v  # [B, n, S, d_v]
    return out.permute(2, 0, 1, 3).flatten(2)


def _core_attention() -> SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType

    config = tiny_gpt(**MLA).to_transformer_config(kernels="torch", params_dtype=torch.float32)
    # MLA builds its core attention with these arguments (multi_latent_attention.py), its scale YaRN-corrected.
    return SDPAttention(
        config, 1, AttnMaskType.causal, "self", softmax_scale=0.3, k_channels=QK + ROPE, v_channels=V,
    )  # fmt: skip


def _packed_layout(seq: int) -> tuple[SequenceLayout, torch.Tensor]:
    """Two rows: one of documents of 5, 7 and 4 tokens, one a single document; the layout and the allowed mask."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in (5, 7, 4)]), torch.arange(seq)])
    documents = (positions == 0).cumsum(1, dtype=torch.int32)
    layout = SequenceLayout(positions=positions, documents=documents, seq_length=seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = causal & (documents[:, :, None] == documents[:, None, :])
    return layout, allowed


@pytest.mark.parametrize("packed", [False, True])
def test_mla_core_attention_equals_float64_reference(megatron_state: None, packed: bool) -> None:
    seq, batch, heads = 16, 2, 4
    torch.manual_seed(0)
    q, k = (torch.randn(seq, batch, heads, QK + ROPE, requires_grad=True) for _ in range(2))
    v = torch.randn(seq, batch, heads, V, requires_grad=True)
    layout, allowed = _packed_layout(seq) if packed else (None, torch.ones(seq, seq, dtype=torch.bool).tril()[None])
    out = _core_attention()(q, k, v, None, packed_seq_params=layout)
    want = _reference(q, k, v, allowed.expand(batch, -1, -1), 0.3)
    assert out.shape == (seq, batch, heads * V)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    wanted = torch.autograd.grad(want, (q, k, v), grad_out.double())
    for name, a, b in zip("qkv", got, wanted, strict=True):
        torch.testing.assert_close(
            a.double(), b.double(), rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"d{name}: {m}"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mla_core_attention_on_gpu_equals_the_float64_reference() -> None:
    """On CUDA, SDPA runs MLA's unequal head sizes (192 / 128) on its own kernel choice (cuDNN's on an H100 with
    torch 2.11): output and gradients equal the float64 reference to bf16 tolerance."""
    seq, batch, heads, device = 512, 2, 8, torch.device("cuda")
    qk, v_dim = 192, 128
    with one_process_megatron(port=29598, cpu=False):
        from megatron.core.transformer.enums import AttnMaskType

        config = tiny_gpt(**MLA).to_transformer_config(kernels="torch", params_dtype=torch.bfloat16)
        module = SDPAttention(
            config, 1, AttnMaskType.causal, "self", softmax_scale=qk**-0.5, k_channels=qk, v_channels=v_dim
        )  # fmt: skip
        torch.manual_seed(0)
        shapes = [(seq, batch, heads, qk)] * 2 + [(seq, batch, heads, v_dim)]
        inputs = [torch.randn(s, device=device, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
        grad_out = torch.randn(seq, batch, heads * v_dim, device=device, dtype=torch.bfloat16)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None].expand(batch, -1, -1)
        exact = [t.detach().double().requires_grad_() for t in inputs]
        want = _reference(*exact, causal, qk**-0.5)
        want_grads = torch.autograd.grad(want, exact, grad_out.double())
        out = module(*inputs, None)
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
        for got, wanted in zip(torch.autograd.grad(out, inputs, grad_out), want_grads, strict=True):
            torch.testing.assert_close(got.double(), wanted, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mla_heads_at_a_context_parallel_rank_on_gpu_equal_the_float64_reference() -> None:
    """CP rank 1 of 2 on GPU: its queries (chunks 1 and 2 of 4, 150 tokens each) against the whole row's 192 / 128
    heads through the core attention's prefix-chunk SDPA calls (bottom-right-aligned causal masks), bf16: the float64
    reference's rows and gradients."""
    from lightning_megatron.kernels.documents import attend
    from lightning_megatron.parallel.context import ContextParallel, token_index

    seq, batch, heads, qk, v_dim, device = 600, 2, 8, 192, 128, torch.device("cuda")
    cp = ContextParallel(2, 1)
    index = token_index(seq, cp, device)
    layout = SequenceLayout(positions=index[None], query_index=index, seq_length=seq, cp=cp)
    torch.manual_seed(0)
    shapes = [(batch, heads, seq // 2, qk), (batch, heads, seq, qk), (batch, heads, seq, v_dim)]
    inputs = [torch.randn(s, device=device, dtype=torch.bfloat16, requires_grad=True) for s in shapes]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, causal: bool) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=qk**-0.5)

    got = attend(*inputs, layout, sdpa, 0.0, qk**-0.5)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    scores = exact[0] @ exact[1].transpose(-1, -2) * qk**-0.5
    scores = scores.masked_fill(index[:, None] < torch.arange(seq, device=device)[None], float("-inf"))
    want = scores.softmax(-1) @ exact[2]
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    grad_out = torch.randn_like(got)
    wanted = torch.autograd.grad(want, exact, grad_out.double())
    for a, b in zip(torch.autograd.grad(got, inputs, grad_out), wanted, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=5e-2, atol=5e-2)


# A direct query projection with the key/value latent's norm (DeepSeek-V2-Lite / Moonlight), YaRN as above.
MLA_DIRECT_NORM = {**MLA_YARN, "q_lora_rank": None}


@pytest.mark.parametrize(
    ("sizes", "fused"),
    [({}, True), ({"qk_head_dim": 24}, False), ({"v_head_dim": 24}, False), ({"qk_pos_emb_head_dim": 12}, False),
     ({"qk_head_dim": 128, "v_head_dim": 128, "qk_pos_emb_head_dim": 64}, True)],
)  # fmt: skip
def test_fused_mla_rope_only_for_head_sizes_its_kernels_take_and_without_cp(sizes: dict, fused: bool) -> None:
    """Megatron's fused MLA RoPE (GPU, YaRN) indexes heads with Triton ranges of powers of two; other head sizes keep
    the unfused path instead of failing at the first GPU forward."""
    config = tiny_gpt(**{**MLA_YARN, **sizes})
    assert config.to_transformer_config(kernels="torch", compile_fusions=True).apply_rope_fusion is fused
    plain = tiny_gpt(**{**MLA, **sizes})  # rope_type 'rope': the fused kernels take YaRN only
    assert not plain.to_transformer_config(kernels="torch", compile_fusions=True).apply_rope_fusion
    # Under context parallelism the kernels would read the rank's tokens at their local places: unfused there.
    cp2 = config.to_transformer_config(kernels="torch", compile_fusions=True, context_parallel_size=2)
    assert not cp2.apply_rope_fusion


def _interpreted_fused_rope_checks() -> None:
    """Megatron's fused MLA RoPE on CPU tensors (run by the test below under ``TRITON_INTERPRET=1``): a packed YaRN
    batch's logits and every gradient equal the unfused path's."""
    import triton.runtime.autotuner as autotuner

    # The interpreter has no device to time the kernels' configurations on: take the first one.
    autotuner.Autotuner._bench = lambda self, *args, **kwargs: [0.0, 0.0, 0.0]
    config = tiny_gpt(**{**MLA_YARN, "mscale": 0.8})  # mscale unlike mscale_all_dim: equal ones cancel
    with one_process_megatron(port=29627):
        torch.manual_seed(0)
        models = [torch_gpt(config, compile_fusions=fused) for fused in (True, False)]
        assert [m.config.apply_rope_fusion for m in models] == [True, False]
        models[1].load_state_dict(models[0].state_dict())
        tokens = torch.randint(0, 256, (2, 16))
        positions = torch.cat([torch.arange(n) for n in (5, 7, 4)])[None].expand(2, -1)
        layout = SequenceLayout(positions=positions, documents=(positions == 0).cumsum(1, dtype=torch.int32),
                                seq_length=16)  # fmt: skip
        logits = []
        for model in models:
            logits.append(model(tokens, positions, None, packed_seq_params=layout))
            logits[-1].square().mean().backward()
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-6, atol=1e-6)
    grads = [dict(m.named_parameters()) for m in models]
    assert len(grads[1]) > 10
    for name, param in grads[1].items():
        message = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(grads[0][name].grad, param.grad, rtol=1e-5, atol=1e-6, msg=message)


def test_fused_mla_rope_equals_the_unfused_path_under_the_triton_interpreter() -> None:
    """The GPU test below on CPU: Megatron's fused MLA RoPE kernels run in Triton's interpreter (a fresh process: the
    variable is read when the kernels are defined)."""
    run_in_triton_interpreter("tests.test_mla", "_interpreted_fused_rope_checks")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overrides", [MLA_DIRECT_NORM, MLA_YARN], ids=["direct_q_norm", "q_lora"])
def test_fused_mla_rope_on_gpu_equals_the_unfused_path(overrides: dict, dtype: torch.dtype) -> None:
    """On GPU with YaRN, the model runs Megatron's fused MLA RoPE (Triton); logits and every gradient equal the
    unfused elementwise path's, packed rows included: to float tolerance in float32, and within 2% in norm in bf16
    (the fused path's cos/sin are cached in the activations' dtype). mscale unlike mscale_all_dim: the cos/sin carry
    YaRN's correction (equal ones cancel)."""
    config = tiny_gpt(**{**overrides, "mscale": 0.8})
    assert config.to_transformer_config(kernels="torch", compile_fusions=True).apply_rope_fusion
    assert not config.to_transformer_config(kernels="torch").apply_rope_fusion
    with one_process_megatron(port=29599, cpu=False):
        torch.manual_seed(0)
        models = [torch_gpt(config, compile_fusions=fused).to("cuda", dtype) for fused in (True, False)]
        models[1].load_state_dict(models[0].state_dict())
        tokens = torch.randint(0, 256, (2, 16), device="cuda")
        positions = torch.cat([torch.arange(n) for n in (5, 7, 4)]).cuda()[None].expand(2, -1)
        documents = (positions == 0).cumsum(1, dtype=torch.int32)
        layout = SequenceLayout(positions=positions, documents=documents, seq_length=16)
        outputs, grads = [], []
        for model in models:
            logits = model(tokens, positions, None, packed_seq_params=layout)
            logits.square().mean().backward()
            outputs.append(logits)
            grads.append({name: p.grad for name, p in model.named_parameters()})
        pairs = [("logits", outputs[0], outputs[1])] + [(n, grads[0][n], g) for n, g in grads[1].items()]
        for name, got, want in pairs:
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            else:
                error = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6))
                assert error < 2e-2, (name, error)


@pytest.mark.parametrize("overrides", [MLA, MLA_DIRECT_NORM, MLA_YARN], ids=["direct_q", "direct_q_norm", "q_lora"])
def test_packed_mla_rows_equal_their_documents_alone(megatron_state: None, overrides: dict) -> None:
    # Megatron's MLA rotates at positions within the row; attention inside each document makes that the documents'
    # own positions (RoPE scores depend on differences only): a packed row's logits are each document's alone.
    torch.manual_seed(0)
    assert_packed_row_is_its_documents(torch_gpt(tiny_gpt(**overrides)).eval())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({**MLA, "kv_lora_rank": 0}, "kv_lora_rank=0"),
        ({**MLA, "q_lora_rank": -1}, "q_lora_rank=-1"),
        ({**MLA, "qk_pos_emb_head_dim": 7}, "qk_pos_emb_head_dim=7"),
        ({**MLA, "rope_type": "llama3"}, "rope_type='llama3'"),
        ({**MLA, "mscale_all_dim": -1.0}, "mscale_all_dim=-1.0"),
        ({**MLA, "kernels": "local"}, "kernels='local' with multi_latent_attention=True"),
        ({**MLA, "num_query_groups": 2}, "num_query_groups=2 with multi_latent_attention=True"),
        ({**MLA, "position_embedding_type": "none"}, "position_embedding_type='none'"),
        ({**MLA, "rope_scaling": True}, "rope_scaling=True with multi_latent_attention=True"),
        ({"kv_lora_rank": 64}, "kv_lora_rank=64 is a Multi-Latent Attention setting"),
    ],
)
def test_bad_mla_configs_are_named(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        tiny_gpt(**overrides)


def test_mla_layouts_that_cannot_split_are_refused_before_building() -> None:
    from lightning_megatron.parallel.sizes import ParallelSizes

    config = tiny_gpt(**MLA, kv_lora_rank=30)  # + 8 = 38: not split by tp=4
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ qk_pos_emb_head_dim=38 must be divisible by tp=4"):
        config.validate_parallel(ParallelSizes(tp=4))
    tiny_gpt(**MLA).validate_parallel(ParallelSizes(cp=2, tp=2, sequence_parallel=True))  # context parallelism runs


@pytest.mark.parametrize("overrides", [MLA, MLA_DIRECT_NORM, MLA_YARN], ids=["direct_q", "direct_q_norm", "q_lora"])
def test_tiny_mla_model_trains_at_one_process(overrides: dict) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronLMModule

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(trainer.callback_metrics["train_loss"]))

    torch.manual_seed(0)
    rows = torch.randint(0, 16, (48, 32), generator=torch.Generator().manual_seed(0))  # 16 of 256 tokens: learnable
    one_process_trainer(12, callbacks=[Record()]).fit(MegatronLMModule(tiny_gpt(**overrides), lr=3e-3), DataLoader(
        list(rows), batch_size=4))  # fmt: skip
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.multiprocess
def test_mla_model_continues_at_tp2_and_at_cp2(tmp_path: Path) -> None:
    # One process trains 4 steps, checkpointing at step 2; TP=2 (the heads, the query and up-projections and the
    # latent down-projection split; a query latent at TP=2 is in tests/test_hf_moe_layouts.py's DeepSeek-V3 layouts)
    # and CP=2 (YaRN RoPE at each chunk's places in the row, keys of 16 + 8 and values of 16 dims gathered over the CP
    # ranks) resume that checkpoint side by side and must follow the one-process curve and validation.
    assert_continues_at_tp2_with_sp({**MLA_DIRECT_NORM, "kernels": "torch"}, tmp_path, also=({"cp": 2},))


@pytest.mark.multiprocess
def test_mla_model_on_packed_rows_continues_at_tp2_sp_cp2(tmp_path: Path) -> None:
    # As above on packed rows (documents of 3-20 tokens in rows of 32), with a query latent, at TP=2 with sequence
    # parallelism and at TP=2 + SP x CP=2 (four processes): the document mask with each CP rank's queries at their
    # places in the row, the latent's RoPE key gathered over the TP ranks' sequence shards of each CP chunk.
    model = {**MLA_YARN, "kernels": "torch"}
    tp_cp = {"devices": 4, "tp": 2, "sp": True, "cp": 2}
    assert_continues_at_tp2_with_sp(model, tmp_path, also=(tp_cp,), data={"packed": True})


def test_an_mla_model_without_experts_has_no_hf_family() -> None:
    from lightning_megatron.gpt.hf.mapping import family

    with pytest.raises(ValueError, match="no supported HF architecture holds a model with multi_latent_attention=True"):
        family(tiny_gpt(**MLA))
