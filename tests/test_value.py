"""MegatronValueModule: layout parity from one checkpoint, per-token values on every rank, masking, clipping."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy, MegatronValueModule, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import run_here, run_worker

REL = 2e-4
# Tied embeddings: the value head replaces the tied vocabulary head, and at PP=2 nothing ties the first stage's
# embedding to the last stage's head any more (as an untied model, which differs in nothing else).
VALUE = {"module": "value", "model": {"share_embeddings_and_output_weights": True}}


@pytest.fixture(scope="module")
def value_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process: a checkpoint at step 2, and the run to step 4 with the values it then predicts."""
    tmp = tmp_path_factory.mktemp("value")
    # Checkpointing at step 2 on the way does not change the run (resume is bit-exact, tests/test_layouts.py).
    args = {**VALUE, "devices": 1, "max_steps": 4, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2}
    full = run_here({**args, "pred_out": str(tmp / "one")}, tmp)
    values = torch.load(tmp / "one.rank0.pt")
    return {"ckpt": str(tmp / "ckpt" / "epoch=0-step=2.ckpt"), "full": full, "values": values}


@pytest.mark.multiprocess
# One 4-process run covers both: the value head replicated over TP ranks and living on the last pipeline stage.
@pytest.mark.parametrize("layout", [{"devices": 4, "tp": 2, "pp": 2}], ids=["tp2_pp2"])
def test_value_layout_parity(layout: dict, value_reference: dict, tmp_path: Path) -> None:
    # Resume at the layout, train to step 4, then predict values [B, S] with the weights trained there.
    args = {**VALUE, **layout, "max_steps": 4, "resume": value_reference["ckpt"], "pred_out": str(tmp_path / "many")}
    resumed = run_worker(args, tmp_path)
    want = {k: v for k, v in value_reference["full"]["train"].items() if int(k) > 2}
    assert set(resumed["train"]) == set(want)
    for step, value in want.items():
        assert resumed["train"][step] == pytest.approx(value, rel=REL)
    one = value_reference["values"]
    for rank in range(layout["devices"]):
        values = torch.load(tmp_path / f"many.rank{rank}.pt")
        assert values.shape == one.shape == (16, 32)  # [B, S] on every rank
        torch.testing.assert_close(values, one, rtol=1e-4, atol=1e-5)


def _fit_one_step(batch: dict[str, torch.Tensor], clip_range: float | None = None) -> float:
    torch.manual_seed(0)
    model = MegatronValueModule(tiny_gpt(), lr=1e-3, decay_steps=2, clip_range=clip_range)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2, seed=7), max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record()],
    )  # fmt: skip
    items = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
    trainer.fit(model, DataLoader(items, batch_size=4))
    return losses[0]


def _batch() -> dict[str, torch.Tensor]:
    tokens = synthetic_tokens(4, 32, 256, seed=11)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[:, 20:] = 0
    return {"input_ids": tokens, "returns": torch.linspace(0, 1, 32).expand(4, 32).clone(), "loss_mask": mask}


def test_masked_positions_do_not_count() -> None:
    batch = _batch()
    changed = {**batch, "returns": batch["returns"].clone()}
    changed["returns"][:, 20:] = 100.0  # only masked positions change
    assert _fit_one_step(batch) == _fit_one_step(changed)
    unmasked = {**changed, "loss_mask": torch.ones(4, 32, dtype=torch.long)}
    assert _fit_one_step(unmasked) > 100 * _fit_one_step(batch)


def test_clipped_value_loss_is_at_least_the_plain_loss() -> None:
    batch = _batch()
    plain = _fit_one_step(batch)
    with_old = {**batch, "old_values": torch.full((4, 32), 5.0)}  # far from the current values: clipping bites
    assert _fit_one_step(with_old, clip_range=0.2) > plain
    assert _fit_one_step(with_old, clip_range=None) == plain  # old_values ignored without a clip range


def test_value_module_errors() -> None:
    with pytest.raises(ValueError, match=r"clip_range=0"):
        MegatronValueModule(tiny_gpt(), clip_range=0)
    with pytest.raises(TypeError, match=r"prediction"):  # values are what a value model predicts
        MegatronValueModule(tiny_gpt(), prediction="logprobs")
    assert not hasattr(MegatronValueModule, "compute_logprobs")  # no token distribution: the LM head's method
