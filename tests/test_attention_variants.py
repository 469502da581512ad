"""Attention variants of the torch-native core attention -- sliding windows, sinks, logit soft-capping, a query
scale -- against a float64 reference in forward and gradients (the sinks' included), causal and packed rows; the
per-layer window pattern; a tiny model with all of them training; the config's checks; and on GPU the FlexAttention
path against the reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron import tiny_gpt
from lightning_megatron.gpt import specs
from lightning_megatron.gpt.attention_variants import window_layers
from lightning_megatron.kernels.attention import SDPAttention
from lightning_megatron.kernels.documents import SequenceLayout
from tests.conftest import one_process_megatron, one_process_trainer
from tests.torch_gpt_models import assert_packed_row_is_its_documents, torch_gpt

SEQ, BATCH, HEADS, GROUPS, DIM = 16, 2, 4, 2, 16  # tiny_gpt's heads of 16, grouped-query attention
SINKS = torch.tensor([-1.0, 0.0, 1.0, 2.5])  # large enough to take a visible share of the softmax

VARIANTS: dict[str, dict[str, Any]] = {
    "window": {"window_size": (3, 0)},
    "sinks": {"softmax_type": "learnable"},
    "off_by_one": {"softmax_type": "off-by-one"},
    "softcap": {"attn_logit_softcapping": 0.5},
    "scale": {"softmax_scale": 0.6},
    "window_sinks": {"window_size": (3, 0), "softmax_type": "learnable"},
    "all": {"window_size": (4, 0), "softmax_type": "learnable", "attn_logit_softcapping": 1.5, "softmax_scale": 0.4},
}


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29681):
        yield


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, fields: dict, sink: torch.Tensor | None
) -> torch.Tensor:
    """float64 attention of [S, B, n, d] tensors (key/value [S, B, g, d]); ``allowed`` [B, S, S] True = attend (the
    window applied here); returns [S, B, n * d]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [B, n, S, d]
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * (fields.get("softmax_scale") or DIM**-0.5)
    cap = fields.get("attn_logit_softcapping")
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    window = fields.get("window_size")
    if window is not None:
        place = torch.arange(SEQ)
        allowed = allowed & (place[:, None] - place[None, :] <= window[0])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sink is not None:  # one more column of the sink's logit, dropped after the softmax
        scores = torch.cat([scores, sink.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = scores.softmax(-1)[..., :SEQ]
    return (probs @ v).permute(2, 0, 1, 3).flatten(2)


def _core_attention(fields: dict, layer_number: int = 1) -> SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType

    model = tiny_gpt(num_query_groups=GROUPS, **fields)
    config = model.to_transformer_config(kernels="torch", params_dtype=torch.float32)
    build = specs.sdp_attention(model)  # as the layer spec builds it (RoPE left out: the test gives rotated q, k)
    kwargs = getattr(build, "keywords", {})
    kwargs = {name: value for name, value in kwargs.items() if name != "rotary"}
    # SelfAttention passes config.softmax_scale (None: the module's 1/sqrt(d)).
    return SDPAttention(
        config, layer_number, AttnMaskType.causal, "self", softmax_scale=config.softmax_scale, **kwargs
    )  # fmt: skip


def _packed_layout() -> tuple[SequenceLayout, torch.Tensor]:
    """Two rows: one of documents of 5, 7 and 4 tokens, one a single document; the layout and the allowed mask."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in (5, 7, 4)]), torch.arange(SEQ)])
    documents = (positions == 0).cumsum(1, dtype=torch.int32)
    layout = SequenceLayout(positions=positions, documents=documents, seq_length=SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return layout, causal & (documents[:, :, None] == documents[:, None, :])


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_equals_float64_reference(megatron_state: None, variant: str, packed: bool) -> None:
    fields = VARIANTS[variant]
    torch.manual_seed(0)
    attention = _core_attention(fields)
    learnable = fields.get("softmax_type") == "learnable"
    if learnable:
        with torch.no_grad():
            attention.softmax_offset.copy_(SINKS)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, requires_grad=True)
    k, v = (torch.randn(SEQ, BATCH, GROUPS, DIM, requires_grad=True) for _ in range(2))
    layout, allowed = _packed_layout() if packed else (None, torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None])
    out = attention(q, k, v, None, packed_seq_params=layout)
    sink = attention.softmax_offset
    sink_ref = None if sink is None else sink.detach().double().requires_grad_(learnable)
    want = _reference(q, k, v, allowed.expand(BATCH, -1, -1), fields, sink_ref)
    assert out.shape == (SEQ, BATCH, HEADS * DIM)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    grad_out = torch.randn_like(out)
    inputs, ref_inputs = [q, k, v], [q, k, v]
    if learnable:  # the sinks' gradient too
        inputs, ref_inputs = [*inputs, sink], [*ref_inputs, sink_ref]
    got = torch.autograd.grad(out, inputs, grad_out)
    wanted = torch.autograd.grad(want, ref_inputs, grad_out.double())
    for name, a, b in zip(["q", "k", "v", "sink"], got, wanted, strict=False):
        # float32 against float64 (SDPA's CPU kernel for the plain scale: rounding of ~2e-6 there)
        message = lambda m, name=name: f"d{name}: {m}"  # noqa: E731
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=message)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_context_parallel_ranks_with_variants_make_up_full_attention(packed: bool) -> None:
    """Under CP=3 each rank's queries (two load-balanced chunks of the row) attend the whole row's keys/values with a
    window that crosses the chunks' edges, sinks and soft-capping: its rows of the output are full attention's, and
    the gradients summed over the ranks (what the key/value gather's reduce-scatter and DDP's reduction over the CP
    ranks add up) are full attention's, the sinks' included."""
    from lightning_megatron.kernels.variants import Variant, attend_variant
    from lightning_megatron.parallel.context import ContextParallel, token_index

    seq, variant, scale = 24, Variant(window=5, softcap=1.5), 0.4
    torch.manual_seed(0)
    q = torch.randn(2, HEADS, seq, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, GROUPS, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = SINKS.double().requires_grad_()
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4])
    documents = (positions == 0).cumsum(0).expand(2, seq) if packed else None
    whole = None if not packed else SequenceLayout(positions=positions[None], documents=documents, seq_length=seq)
    want = attend_variant(q, k, v, whole, variant, sink, scale, 0.0, False)
    grad = torch.randn_like(want)
    wanted = torch.autograd.grad(want, [q, k, v, sink], grad)
    summed = [torch.zeros_like(t) for t in (q, k, v, sink)]
    for rank in range(3):
        cp = ContextParallel(3, rank)
        index = token_index(seq, cp, torch.device("cpu"))
        layout = SequenceLayout(
            positions=positions[index][None], documents=documents, query_index=index, seq_length=seq, cp=cp
        )  # fmt: skip
        got = attend_variant(q[:, :, index], k, v, layout, variant, sink, scale, 0.0, False)
        torch.testing.assert_close(got, want[:, :, index])
        for total, part in zip(summed, torch.autograd.grad(got, [q, k, v, sink], grad[:, :, index]), strict=True):
            total += part
    for name, a, b in zip(["q", "k", "v", "sink"], summed, wanted, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")
    assert wanted[3].abs().min() > 1e-3  # every sink takes part: its gradient is checked


def test_plain_rows_under_cp_share_one_block_mask_per_length_and_place() -> None:
    """FlexAttention's block mask for plain rows under CP is built once per length and CP place (not per
    micro-batch): two micro-batches' layouts get the same mask, which allows exactly ``allowed_mask``'s pairs; a
    layout whose query places are not token_index's own tensor gets a mask of its own."""
    from lightning_megatron.kernels.variants import allowed_mask, variant_block_mask
    from lightning_megatron.parallel.context import ContextParallel, token_index

    seq, cpu = 48, torch.device("cpu")
    masks = []
    for rank in (1, 1, 0):
        cp = ContextParallel(2, rank)
        layout = SequenceLayout(query_index=token_index(seq, cp, cpu), seq_length=seq, cp=cp)  # as rank_tokens makes
        masks.append((layout, variant_block_mask(layout, 5, 2, seq // 2, seq, cpu)))
    assert masks[0][1] is masks[1][1]
    assert masks[2][1] is not masks[0][1]
    own = SequenceLayout(query_index=token_index(seq, ContextParallel(2, 1), cpu).clone(), seq_length=seq,
                         cp=ContextParallel(2, 1))  # fmt: skip
    masks.append((own, variant_block_mask(own, 5, 2, seq // 2, seq, cpu)))
    assert masks[3][1] is not masks[0][1]
    q_idx, kv_idx = torch.arange(seq // 2)[:, None], torch.arange(seq)[None]
    for layout, mask in masks:
        allowed = mask.mask_mod(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
        assert torch.equal(allowed, allowed_mask(layout, seq // 2, seq, 5, cpu)[0, 0])
        assert allowed.sum(1).max() == 6  # the query and the 5 keys before it: the window, not causal alone


@pytest.mark.parametrize(
    ("freq", "windowed"),
    [(None, (True,) * 4), (2, (True, False, True, False)), ((1, 1, 0, 1), (True, True, False, True))],
)
def test_window_layers_follow_megatrons_pattern(megatron_state: None, freq: Any, windowed: tuple) -> None:
    config = tiny_gpt(window_size=(5, 0), window_attn_skip_freq=freq, softmax_type="learnable")
    assert window_layers(config) == windowed
    model = torch_gpt(config)
    for layer, want in zip(model.decoder.layers, windowed, strict=True):
        variant = layer.self_attention.core_attention.variant
        assert (variant is not None and variant.window == 5) == want
    # The sinks under Megatron's name, one per head of every layer.
    sinks = {name: p for name, p in model.named_parameters() if name.endswith("core_attention.softmax_offset")}
    assert len(sinks) == 4
    assert all(p.shape == (HEADS,) and p.tensor_model_parallel for p in sinks.values())


# GPT-OSS's layout (YaRN RoPE applied by Megatron's attention from GPTModel's own table, sized for the full rows the
# layout names) and our RoPE inside the core attention, each with windows and sinks.
YARN = {"position_embedding_type": "yarn", "rotary_scaling_factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize(
    "rope", [{"attn_logit_softcapping": 5.0}, YARN], ids=["rope_in_attention_softcap", "gpt_models_own_yarn"]
)
def test_packed_rows_with_variants_equal_their_documents_alone(megatron_state: None, rope: dict) -> None:
    # A window shorter than the documents, sinks: each document of a packed row sees what it sees alone.
    torch.manual_seed(0)
    config = tiny_gpt(window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable", **rope)
    assert_packed_row_is_its_documents(torch_gpt(config).eval())


def test_tiny_model_with_variants_trains_at_one_process() -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronLMModule

    losses: list[float] = []

    first_sinks: list[torch.Tensor] = []

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            first_sinks.extend(p.detach().clone() for p in _sinks(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(trainer.callback_metrics["train_loss"]))

    torch.manual_seed(0)
    rows = torch.randint(0, 16, (48, 32), generator=torch.Generator().manual_seed(0))  # 16 of 256 tokens: learnable
    config = tiny_gpt(**VARIANTS["all"], window_attn_skip_freq=2)
    module = MegatronLMModule(config, lr=3e-3)
    one_process_trainer(12, callbacks=[Record()]).fit(module, DataLoader(list(rows), batch_size=4))
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 1.0, losses
    assert len(first_sinks) == 4  # one per layer, trained
    assert all(not torch.equal(a, b.detach()) for a, b in zip(first_sinks, _sinks(module), strict=True))


def _sinks(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for name, p in module.named_parameters() if name.endswith("softmax_offset")]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"window_size": (4, 4)}, r"window_size=\(4, 4\): causal sliding windows"),
        ({"window_size": (-1, 0)}, r"window_size=\(-1, 0\)"),
        ({"window_attn_skip_freq": 2}, "window_attn_skip_freq=2 picks the sliding-window layers"),
        ({"window_size": (4, 0), "window_attn_skip_freq": 1}, "window_attn_skip_freq=1"),
        ({"window_size": (4, 0), "window_attn_skip_freq": (1, 0)}, "num_layers=4"),
        ({"softmax_type": "sigmoid"}, "softmax_type"),
        ({"softmax_scale": 0.0}, "softmax_scale=0.0 must be > 0"),
        ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping=-1.0 must be > 0"),
        ({"attn_logit_softcapping": 30.0, "kernels": "local"}, "attn_logit_softcapping=30.0 with kernels='local'"),
        ({"multi_latent_attention": True, "softmax_type": "learnable"}, "softmax_type='learnable' with multi_latent"),
    ],
)
def test_bad_variant_configs_are_named(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_gpt(**overrides)


def test_variants_validate_at_any_context_parallel_size() -> None:
    from lightning_megatron.parallel.sizes import ParallelSizes

    every = {"window_size": (3, 0), "softmax_type": "learnable", "attn_logit_softcapping": 5.0, "softmax_scale": 0.3}
    tiny_gpt(**every).validate_parallel(ParallelSizes(cp=2, tp=2, sequence_parallel=True))
    tiny_gpt(**every, kernels="auto").validate_parallel(ParallelSizes(cp=2))  # 'auto': the torch kernels
    # Transformer Engine would take them to its own CP attention: refused, naming the kernels that run them.
    with pytest.raises(ValueError, match=r"window_size=\(3, 0\) with cp=2 and kernels='te'.*kernels='torch'"):
        tiny_gpt(window_size=(3, 0), kernels="te").validate_parallel(ParallelSizes(cp=2))
    with pytest.raises(ValueError, match="softmax_type='learnable' with cp=2 and kernels='te'"):
        tiny_gpt(softmax_type="learnable", kernels="te").validate_parallel(ParallelSizes(cp=2))
    tiny_gpt(softmax_scale=0.3, kernels="te").validate_parallel(ParallelSizes(cp=2))
    tiny_gpt(window_size=(3, 0), kernels="te").validate_parallel(ParallelSizes(tp=2, sequence_parallel=True))
    assert tiny_gpt(window_size=[3, 0], window_attn_skip_freq=[1, 0, 1, 0]).window_size == (3, 0)  # YAML lists


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("variant", ["window", "window_sinks", "all"])
def test_flex_variants_match_the_reference(variant: str, packed: bool) -> None:
    """On GPU the variants run FlexAttention (window as a block mask, soft-cap as score_mod, sinks via the
    log-sum-exp): same output and gradients as the explicit float32 reference path."""
    from lightning_megatron.kernels.variants import Variant, allowed_mask, attend_variant, masked_attention

    fields, seq, device = VARIANTS[variant], 512, torch.device("cuda")
    window = fields.get("window_size", (None,))[0]
    variant_ = Variant(window=None if window is None else 100, softcap=fields.get("attn_logit_softcapping"))
    layout = None
    if packed:
        positions = torch.cat([torch.arange(n) for n in (100, 37, 200, 75, 100)]).to(device)
        documents = (positions == 0).cumsum(0, dtype=torch.int32).expand(2, seq)
        layout = SequenceLayout(positions=positions[None], documents=documents, seq_length=seq)
    torch.manual_seed(0)
    q = torch.randn(2, 8, seq, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 4, seq, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = (
        torch.linspace(-1, 2, 8, device=device, requires_grad=True) if "sinks" in variant or variant == "all" else None
    )
    scale = fields.get("softmax_scale") or 64**-0.5
    got = attend_variant(q, k, v, layout, variant_, sink, scale, 0.0, False)
    assert layout is None or ("variant_block_mask", variant_.window) in layout.cache  # the flex path ran
    allowed = allowed_mask(layout, seq, seq, variant_.window, device)
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    want = masked_attention(*(t.float() for t in (q, k, v)), allowed, scale, variant_.softcap, sink, 0.0, False)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    want_grads = torch.autograd.grad(want.square().sum(), inputs, retain_graph=True)
    grads = torch.autograd.grad(got.float().square().sum(), inputs)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_flex_variants_at_a_context_parallel_rank_match_the_reference(packed: bool) -> None:
    """CP rank 1 of 2 on GPU: its queries (chunks 1 and 2 of 4, 150 tokens each: FlexAttention's 128-token blocks
    straddle the chunks' edges) against the whole row with a window of 100 that crosses those edges, sinks and
    soft-capping, on FlexAttention's block mask: the explicit float32 reference path's output and gradients."""
    from lightning_megatron.kernels.variants import Variant, allowed_mask, attend_variant, masked_attention
    from lightning_megatron.parallel.context import ContextParallel, token_index

    seq, device, variant = 600, torch.device("cuda"), Variant(window=100, softcap=1.5)
    cp = ContextParallel(2, 1)
    index = token_index(seq, cp, device)
    positions = torch.cat([torch.arange(n) for n in (100, 37, 288, 75, 100)]).to(device)
    documents = (positions == 0).cumsum(0, dtype=torch.int32).expand(2, seq) if packed else None
    layout = SequenceLayout(
        positions=positions[index][None], documents=documents, query_index=index, seq_length=seq, cp=cp
    )  # fmt: skip
    torch.manual_seed(0)
    q = torch.randn(2, 8, seq // 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 4, seq, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = torch.linspace(-1, 2, 8, device=device, requires_grad=True)
    got = attend_variant(q, k, v, layout, variant, sink, 0.125, 0.0, False)
    assert ("variant_block_mask", variant.window) in layout.cache  # the flex path ran
    allowed = allowed_mask(layout, seq // 2, seq, variant.window, device)
    want = masked_attention(*(t.float() for t in (q, k, v)), allowed, 0.125, variant.softcap, sink, 0.0, False)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    inputs = [q, k, v, sink]
    want_grads = torch.autograd.grad(want.square().sum(), inputs, retain_graph=True)
    for g, w in zip(torch.autograd.grad(got.float().square().sum(), inputs), want_grads, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


def test_local_kernels_with_variants_are_refused_on_cpu() -> None:
    """Megatron's local attention builds its window mask and sink parameter on the GPU: on CPU the plan refuses it,
    naming the kernels that work there."""
    from lightning_megatron.gpt.plan import KernelPlan

    config = tiny_gpt(window_size=(3, 0), kernels="local")
    with pytest.raises(ValueError, match=r"kernels='local'\) with attention variants .* use kernels='torch'"):
        KernelPlan.resolve(config, "cpu")
    assert KernelPlan.resolve(tiny_gpt(window_size=(3, 0)), "cpu").kernels == "torch"


@pytest.mark.multiprocess
def test_variant_model_continues_at_tp2_with_sp_and_at_cp2(tmp_path: Path) -> None:
    """One process trains 4 steps with every variant (window on alternate layers, learnable sinks, soft-capping, a
    query scale), checkpointing at step 2; TP=2 with sequence parallelism (the sinks split by heads from the full
    saved vector) and CP=2 (rows of 32 in chunks of 8: the window of 4 crosses the chunks' edges) resume that
    checkpoint side by side and follow the one-process curve and validation."""
    from tests.conftest import assert_continues_at_tp2_with_sp

    variants = {"window_size": (3, 0), "window_attn_skip_freq": 2, "softmax_type": "learnable",
                "attn_logit_softcapping": 5.0, "softmax_scale": 0.2}  # fmt: skip
    assert_continues_at_tp2_with_sp({**variants, "kernels": "torch"}, tmp_path, also=({"cp": 2},))


@pytest.mark.multiprocess
def test_variant_model_on_packed_rows_continues_at_tp2_sp_cp2(tmp_path: Path) -> None:
    """As above on packed rows (documents of 3-20 tokens in rows of 32: the window, the sinks and the document mask
    together, each CP rank's queries at their places in the row), resumed at TP=2 with SP and at TP=2 + SP x CP=2
    (four processes: the sinks split by heads, the rows by CP)."""
    from tests.conftest import assert_continues_at_tp2_with_sp

    variants = {"window_size": (3, 0), "window_attn_skip_freq": 2, "softmax_type": "learnable",
                "attn_logit_softcapping": 5.0}  # fmt: skip
    model = {**variants, "kernels": "torch"}
    tp_cp = {"devices": 4, "tp": 2, "sp": True, "cp": 2}
    assert_continues_at_tp2_with_sp(model, tmp_path, also=(tp_cp,), data={"packed": True})
