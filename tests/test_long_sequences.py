"""Packed sequences, context parallelism and token-budget micro-batches: conventions, kernels and errors (one process).

The multi-process runs (packed and CP layouts resuming one process's checkpoint, token budgets at PP=2) are in
tests/test_layouts.py; parity with ``transformers`` per document (1 process: tests/test_hf.py; TP=2, PP=2 x VPP=2,
CP=2: tests/test_hf_layouts.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from lightning_megatron import MegatronLMModule, MegatronStrategy, TokenFileDataModule, pack_sequences, tiny_gpt
from lightning_megatron.data.packing import first_fit
from lightning_megatron.data.tokens import write_token_file
from lightning_megatron.gpt import specs
from lightning_megatron.gpt.lm import shift_labels
from lightning_megatron.gpt.plan import KernelPlan
from lightning_megatron.gpt.sequences import rank_tokens, without_default_positions
from lightning_megatron.kernels.documents import SequenceLayout, attend, document_mask
from lightning_megatron.micro_batches import MicroBatching, group_by_tokens, micro_batching
from lightning_megatron.parallel.context import ContextParallel, gather_order, token_index
from lightning_megatron.parallel.sizes import ParallelSizes
from lightning_megatron.training.guards import check_token_batch
from tests.conftest import one_process_megatron


@pytest.fixture(scope="module")
def megatron_state() -> Iterator[None]:
    with one_process_megatron(port=29611):
        yield


DOCS = [torch.arange(10, 10 + n) for n in (5, 9, 3, 7, 6)]


# ----------------------------------------------------------------------------------------------- packing helper
def test_packed_rows_follow_transformers_flattening() -> None:
    rows = pack_sequences(DOCS, 16)
    assert [r["input_ids"].shape for r in rows] == [torch.Size([16])] * 2
    collator = transformers.DataCollatorWithFlattening(return_tensors="pt")
    for row in rows:
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [16]
        parts = [row["input_ids"][a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
        real = [p for p, a in zip(parts, starts, strict=False) if not row["labels"][a:].eq(-100).all()]
        want = collator([{"input_ids": p.tolist()} for p in real])
        n = want["input_ids"].shape[1]
        for key in ("input_ids", "position_ids", "labels"):
            assert row[key][:n].tolist() == want[key][0].tolist(), key
        assert row["labels"][n:].eq(-100).all()
        assert row["attention_mask"].tolist() == [1] * n + [0] * (16 - n)  # padding: out of value losses too
        assert row["position_ids"][n:].tolist() == list(range(16 - n))
    # first-fit: 5 and 9 fill row 0 up to 14; 3 does not fit there and opens row 1, which 7 and 6 then fill
    assert first_fit([5, 9, 3, 7, 6], 16) == [[0, 1], [2, 3, 4]]
    assert first_fit([4, 4, 4, 4], 8, window=1) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="document 1 has 20 tokens, more than row_length=16"):
        pack_sequences([DOCS[0], torch.arange(20)], 16)


def test_token_file_packed_mode(tmp_path: Path) -> None:
    eos = 1
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 100, int(n)), eos) for n in rng.integers(3, 30, 400)]
    write_token_file(docs, tmp_path / "t.bin")
    data = TokenFileDataModule(
        str(tmp_path / "t.bin"), seq_length=32, batch_size=4, val_fraction=0.1, packed=True, eos_id=eos
    )
    data.setup("fit")
    rows = [data.train_set[i] for i in range(len(data.train_set))] + [data.val_set[i] for i in range(len(data.val_set))]
    found = []
    for row in rows:
        check_token_batch({k: v[None] for k, v in row.items()}, 128, 32)
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [32]
        found += [row["input_ids"][a:b].tolist() for a, b in zip(starts[:-1], starts[1:], strict=True)]
    # Every document whole, once; the rest is padding (EOS ids) at rows' ends.
    assert sorted(d.tolist() for d in docs) == sorted(d for d in found if set(d) != {eos})
    with pytest.raises(ValueError, match="packed=True needs eos_id"):
        TokenFileDataModule(str(tmp_path / "t.bin"), seq_length=32, packed=True)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"position_ids": torch.tensor([[1, 2, 3, 4]])}, r"row 0 start at 1.*starts a document at position 0"),
        ({"position_ids": torch.tensor([[0, 1, 2, 1]])}, r"go from 2 to 1 at index 3.*restart at 0"),
        ({"position_ids": torch.tensor([[0, 1, 9, 10]])}, r"go from 1 to 9 at index 2.*count up by one"),
        ({"position_ids": torch.tensor([[0, 1, 2]])}, r"position_ids has shape \(1, 3\), but input_ids has \(1, 4\)"),
        ({"labels": torch.tensor([[0, 1]])}, r"labels has shape \(1, 2\), but input_ids has \(1, 4\)"),
        ({"position_ids": torch.tensor([[0.0, 1, 2, 3]])}, r"position_ids is a tensor of dtype torch.float32"),
    ],
    ids=["no start", "drop", "jump", "positions shape", "labels shape", "float"],
)
def test_bad_packed_batches_raise(change: dict, match: str) -> None:
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), **change}
    with pytest.raises((ValueError, TypeError), match=match):
        check_token_batch(batch, 128, 8)


def test_plain_positions_keep_the_fast_path() -> None:
    # position_ids that every row would get anyway (one document from 0) are dropped on the host: no document masks.
    plain = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "position_ids": torch.arange(4).expand(2, 4)}
    assert "position_ids" not in without_default_positions(plain)
    packed = {**plain, "position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]])}
    assert without_default_positions(packed) is packed


def test_labels_never_cross_documents() -> None:
    # Without labels the module still masks each document's last position (its next token starts another document).
    row = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], 6)[0]
    _, mask = shift_labels({"input_ids": row["input_ids"][None], "position_ids": row["position_ids"][None]})
    assert mask[0].tolist() == [1, 1, 0, 1, 0, 0]  # 5->6, 6->7, (7->8 no), 8->9, (9->pad no), last


# ----------------------------------------------------------------------------------------------- kernels
def _gpt(config):  # noqa: ANN202
    from megatron.core.models.gpt import GPTModel

    tc = config.to_transformer_config(kernels="torch", params_dtype=torch.float32)
    return GPTModel(config=tc, transformer_layer_spec=specs.block_spec(config, tc, None, "torch"),
                    **config.gpt_model_kwargs("torch"))  # fmt: skip


def test_packed_step_equals_documents_alone(megatron_state: None) -> None:
    """Logits and gradients of one packed row equal those of its documents run one by one (GQA, RoPE)."""
    config = tiny_gpt(kernels="torch", num_query_groups=2)
    torch.manual_seed(0)
    model = _gpt(config)
    row = {k: v[None] for k, v in pack_sequences(DOCS[:3], 20)[0].items()}

    def loss(batch: dict) -> torch.Tensor:
        tokens = rank_tokens(batch)
        logits = model(tokens.input_ids, tokens.position_ids, None, packed_seq_params=tokens.layout).float()
        targets, mask = shift_labels(batch)
        picked = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        return -(picked * mask).sum(), logits

    packed_loss, packed_logits = loss(row)
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total, start = 0.0, 0
    for doc in DOCS[:3]:
        doc_loss, logits = loss({"input_ids": doc[None]})
        torch.testing.assert_close(packed_logits[0, start : start + len(doc)], logits[0], rtol=1e-5, atol=1e-5)
        total, start = total + doc_loss, start + len(doc)
    total.backward()
    torch.testing.assert_close(packed_loss, total)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_context_parallel_attention_equals_full_attention(rank: int, packed: bool) -> None:
    """One CP rank's queries against the whole row's K/V (what the all-gather hands it) give that rank's rows of
    full causal (document) attention -- the prefix-chunk kernel for plain rows, the document mask for packed ones."""
    cp, seq = ContextParallel(3, rank), 24
    q, k, v = (torch.randn(2, 4, seq, 8, dtype=torch.float64) for _ in range(3))
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4])
    documents = (positions == 0).cumsum(0).expand(2, seq) if packed else None
    index = token_index(seq, cp, torch.device("cpu"))
    layout = SequenceLayout(positions=index[None], documents=documents, query_index=index, seq_length=seq, cp=cp)

    def sdpa(q, k, v, mask, causal):  # noqa: ANN001, ANN202
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)

    allowed = torch.zeros(2, 1, seq, seq, dtype=torch.bool)  # built by hand, not by document_mask
    for i in range(seq):
        for j in range(i + 1):
            allowed[:, :, i, j] = documents is None or bool(documents[0, i] == documents[0, j])
    want = sdpa(q, k, v, allowed, False)[:, :, index]
    got = attend(q[:, :, index], k, v, layout, sdpa, 0.0, 8**-0.5)
    torch.testing.assert_close(got, want)


def test_gather_order_inverts_the_cp_layout() -> None:
    seq, size = 16, 2
    blocks = torch.cat([token_index(seq, ContextParallel(size, r), torch.device("cpu")) for r in range(size)])
    assert token_index(seq, ContextParallel(2, 0), torch.device("cpu")).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert blocks[gather_order(seq, size, torch.device("cpu"))].tolist() == list(range(seq))


def test_packed_batches_need_the_torch_kernels(megatron_state: None) -> None:
    module = MegatronLMModule(tiny_gpt(kernels="local"))
    module.plan = KernelPlan("local")
    row = {k: v[None] for k, v in pack_sequences(DOCS[:2], 16)[0].items()}
    with pytest.raises(ValueError, match=r"packed batch \(position_ids\).*kernels='local'.*kernels='torch'"):
        module.rank_tokens(row)


def test_value_module_on_packed_rows_equals_documents_alone() -> None:
    """Values of a packed row are those of each document alone; the padding document adds nothing to the loss."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronValueModule

    def trainer() -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=1), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip

    torch.manual_seed(0)
    module = MegatronValueModule(tiny_gpt(kernels="torch"))
    docs = DOCS[:3]  # 5 + 9 + 3 tokens in one row of 20: 3 padding tokens
    row = pack_sequences(docs, 20)[0]
    row["returns"] = (row["input_ids"] % 7).float()
    alone = []
    for doc in docs:
        mask = torch.zeros(9, dtype=torch.long)
        mask[: len(doc)] = 1
        ids = torch.cat([doc, torch.zeros(9 - len(doc), dtype=torch.long)])
        alone.append({"input_ids": ids, "attention_mask": mask, "returns": (ids % 7).float()})
    packed_values = trainer().predict(module, DataLoader([row], batch_size=1))[0][0]  # [20]
    alone_values = torch.cat(trainer().predict(module, DataLoader(alone, batch_size=1)))  # [3, 9]
    start = 0
    for i, doc in enumerate(docs):
        torch.testing.assert_close(packed_values[start : start + len(doc)], alone_values[i, : len(doc)])
        start += len(doc)
    packed_loss = trainer().validate(module, DataLoader([row], batch_size=1))[0]["val_loss"]
    alone_loss = trainer().validate(module, DataLoader(alone, batch_size=3))[0]["val_loss"]
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)


# ----------------------------------------------------------------------------------------------- token budget
def test_token_budget_groups() -> None:
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(100, 8001, 64)]
    groups = group_by_tokens(lengths, 16384)
    assert sorted(i for g in groups for i in g) == list(range(64))
    assert all(len(g) * max(lengths[i] for i in g) <= 16384 for g in groups)
    assert len(groups) <= 1.3 * sum(lengths) / 16384 + 1  # little padding: similar lengths grouped
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=7999 is smaller than the longest.*8000"):
        group_by_tokens([8000, 10], 7999)


def test_budgeted_micro_batches_are_cut_to_their_longest_sample() -> None:
    mask = torch.zeros(6, 32, dtype=torch.long)
    for i, n in enumerate((32, 3, 30, 5, 4, 31)):
        mask[i, :n] = 1
    batch = {"input_ids": torch.arange(6 * 32).reshape(6, 32), "attention_mask": mask, "loss_mask": mask}
    parts = MicroBatching(max_tokens=64, length_multiple=4).split(batch)
    # rounded up to multiples of 4: 32, 4, 32, 8, 4, 32 -> [32, 32], [32, 8 (cut to 32)], [4, 4]
    assert sorted(p["input_ids"].shape[1] for p in parts) == [4, 32, 32]
    assert all(p["input_ids"].numel() <= 64 for p in parts)
    assert sorted(int(r[0]) // 32 for p in parts for r in p["input_ids"]) == list(range(6))
    assert sum(int(p["attention_mask"].sum()) for p in parts) == int(mask.sum())  # no real token cut away


@pytest.mark.parametrize(
    ("sizes", "tokens", "match"),
    [
        (ParallelSizes(pp=2, vpp=2), 64, r"max_tokens_per_micro_batch=64 with vpp=2.*use vpp=None"),
        (ParallelSizes(ep=2), 64, r"max_tokens_per_micro_batch=64 with ep=2.*use ep=1"),
        (ParallelSizes(), 0, r"max_tokens_per_micro_batch=0 must be a positive integer"),
    ],
    ids=["vpp", "ep", "zero"],
)
def test_token_budget_errors(sizes: ParallelSizes, tokens: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        micro_batching(sizes, 1, tokens)
    with pytest.raises(ValueError, match=match):  # the strategy's constructor, before any group exists
        MegatronStrategy(**{k: v for k, v in dataclasses.asdict(sizes).items() if v not in (1, None, False)},
                         max_tokens_per_micro_batch=tokens)  # fmt: skip


def test_token_budget_rounds_for_context_and_sequence_parallelism() -> None:
    assert micro_batching(ParallelSizes(tp=2, cp=2, sequence_parallel=True), 1, 64).length_multiple == 4
    assert micro_batching(ParallelSizes(cp=3), 1, 64).length_multiple == 6


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cp_rank", [None, 1])
def test_flex_attention_matches_the_reference_mask(cp_rank: int | None) -> None:
    """On GPU packed rows run FlexAttention with a document block mask: same result as the boolean-mask SDPA."""
    seq, device = 512, torch.device("cuda")
    lengths = [100, 37, 200, 75, 100]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    documents = (positions == 0).cumsum(0, dtype=torch.int32).expand(2, seq)
    cp = ContextParallel(2, cp_rank) if cp_rank is not None else ContextParallel(1, 0)
    index = token_index(seq, cp, device) if cp_rank is not None else None
    layout = SequenceLayout(positions=positions[None], documents=documents, query_index=index, seq_length=seq, cp=cp)
    q, k, v = (torch.randn(2, 8, seq, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    q_local = q[:, :, index] if index is not None else q

    def sdpa(q, k, v, mask, causal):  # noqa: ANN001, ANN202
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)

    got = attend(q_local, k, v, layout, sdpa, 0.0, 64**-0.5)
    assert "block_mask" in layout.cache  # the flex path ran
    want = sdpa(q_local.float(), k.float(), v.float(), document_mask(layout, device), False)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # The reference first, keeping the q_local indexing both graphs share (the compiled one cannot retain its graph).
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v), retain_graph=True)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)
