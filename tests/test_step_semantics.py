"""What an optimizer step is, in one process: before the first one (distributed optimizer, the default) a save
resumes exactly, a first-step error stays the user's own with ``OnExceptionCheckpoint``, and ``Tuner.lr_find`` runs
with its own learning rates and puts the model back; on a GPU, k accumulated batches make the step of one batch k
times larger. (Accumulation over data- and pipeline-parallel ranks: ``test_data_parallel.py``.)"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, OnExceptionCheckpoint
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens

DATA = synthetic_tokens(48, 32, 256, seed=5)
# Samples with 4-31 loss tokens (labels -100 after that): the batches of a step count different numbers of tokens.
MASKED = [
    {"input_ids": row, "labels": torch.where(torch.arange(32) < 4 + (i * 7) % 28, row, -100)}
    for i, row in enumerate(DATA)
]


def _trainer(max_steps: int = 3, async_save: bool = False, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2, async_save=async_save),
        max_steps=max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        **{"enable_checkpointing": False, **kwargs},
    )  # fmt: skip


def _model() -> MegatronLMModule:
    return MegatronLMModule(tiny_gpt(), lr=3e-3, warmup_steps=1, decay_steps=8)


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if len(self.losses) < trainer.global_step:  # a batch that stepped the optimizer (not one accumulated)
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            self.lrs.append(float(trainer.callback_metrics["lr"]))
            self.norms.append(float(trainer.callback_metrics["grad_norm"]))  # the scale Adam would hide


class SaveAtStart(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        trainer.save_checkpoint(self.path)


def test_a_save_before_the_first_step_resumes_exactly(tmp_path: Path) -> None:
    full = Record()
    _trainer(callbacks=[SaveAtStart(tmp_path / "start.ckpt"), full]).fit(_model(), DataLoader(DATA, batch_size=4))
    resumed = Record()
    trainer = _trainer(callbacks=[resumed])
    trainer.fit(_model(), DataLoader(DATA, batch_size=4), ckpt_path=str(tmp_path / "start.ckpt"))
    assert resumed.losses == full.losses  # the initial state: weights, an untouched optimizer, the LR schedule
    assert len(full.losses) == 3


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_first_step_error_stays_the_users_own_with_on_exception_checkpoint(tmp_path: Path, async_save: bool) -> None:
    bad = DATA.clone()
    bad[:, 0] = 10_000  # a token id beyond the vocabulary: the most common first-step error
    # (with async saves, the checkpoint on the way out is written at once: the run's teardown follows)
    trainer = _trainer(callbacks=[OnExceptionCheckpoint(tmp_path)], enable_checkpointing=True, async_save=async_save)
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        trainer.fit(_model(), DataLoader(bad, batch_size=4))
    # The checkpoint written on the way out holds the initial state and resumes.
    resumed = Record()
    _trainer(callbacks=[resumed]).fit(
        _model(), DataLoader(DATA, batch_size=4), ckpt_path=str(tmp_path / "on_exception.ckpt")
    )
    full = Record()
    _trainer(callbacks=[full]).fit(_model(), DataLoader(DATA, batch_size=4))
    assert resumed.losses == full.losses


class RecordingLM(MegatronLMModule):
    """Records the learning rate each step ran at (lr_find replaces the Trainer's callbacks while it runs)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.lrs = [*getattr(self, "lrs", []), float(self.trainer.callback_metrics["lr"])]


def test_lr_find_trains_with_its_learning_rates_and_restores_the_model(tmp_path: Path) -> None:
    model = RecordingLM(tiny_gpt(), lr=3e-3, warmup_steps=1, decay_steps=8)
    trainer = _trainer(max_steps=20, default_root_dir=tmp_path)
    loader = DataLoader(DATA, batch_size=4)
    found = Tuner(trainer).lr_find(model, loader, num_training=14, early_stop_threshold=None)
    assert found is not None
    assert model.lrs == pytest.approx(found.results["lr"], rel=1e-5)  # each step ran at lr_find's rate
    assert model.lrs[-1] > 100 * model.lrs[0]
    assert not list(tmp_path.glob(".lr_find*"))  # its checkpoint is removed
    # The suggestion (update_attr=True, the default) is the rate the next fit's optimizer gets.
    suggestion = found.suggestion()
    assert suggestion is not None
    assert model.configure_optimizers().config.lr == suggestion != 3e-3
    # The model is put back: a fit afterwards (at the old rate) starts where a fresh one does.
    model.hparams.lr = 3e-3
    after, fresh = Record(), Record()
    _trainer(callbacks=[after]).fit(model, DataLoader(DATA, batch_size=4))
    initial = _model()
    _trainer(callbacks=[fresh]).fit(initial, DataLoader(DATA, batch_size=4))
    assert after.losses == fresh.losses


def _fit_accumulating(accelerator: str, precision: str, batch_size: int, accumulation: int | str) -> tuple:
    seen = Record()
    scheduled = accumulation == "scheduler"
    callbacks = [seen, GradientAccumulationScheduler({0: 2})] if scheduled else [seen]
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, precision=precision, strategy=MegatronStrategy(micro_batch_size=2),
        max_steps=3, accumulate_grad_batches=1 if scheduled else accumulation, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = _model()
    trainer.fit(model, DataLoader(MASKED, batch_size=batch_size))
    return seen, [p.detach().float().cpu() for p in model.parameters()], trainer.global_step


@pytest.mark.parametrize(
    ("accelerator", "precision", "accumulation"),
    [
        ("cpu", "32-true", 2),
        ("cpu", "32-true", "scheduler"),  # GradientAccumulationScheduler({0: 2})
        # bf16 with the GPU's fused weight-gradient accumulation into main_grad
        pytest.param("gpu", "bf16-mixed", 2, marks=pytest.mark.gpu),
    ],
)
def test_accumulation_equals_the_doubled_batch(accelerator: str, precision: str, accumulation: int | str) -> None:
    """k=2 batches of 2 make one optimizer step equal to one batch of 4 (token-weighted: the batches hold different
    numbers of loss tokens): loss, LR, gradient norm, weights, global_step."""
    single, weights, steps = _fit_accumulating(accelerator, precision, 4, 1)
    accumulated, weights_acc, steps_acc = _fit_accumulating(accelerator, precision, 2, accumulation)
    assert steps == steps_acc == 3
    assert accumulated.losses == pytest.approx(single.losses, rel=1e-5 if accelerator == "cpu" else 1e-3)
    assert accumulated.lrs == pytest.approx(single.lrs)
    # The gradient itself, before Adam normalises its scale away: divided by the tokens of both batches, once.
    assert accumulated.norms == pytest.approx(single.norms, rel=1e-5 if accelerator == "cpu" else 1e-2)
    for a, b in zip(weights_acc, weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class SkipsRestOfFirstEpoch(MegatronLMModule):
    """Lightning's documented way to cut an epoch short: ``on_train_batch_start`` returning -1 (here mid-window)."""

    def on_train_batch_start(self, batch: object, batch_idx: int) -> int | None:
        return -1 if self.trainer.current_epoch == 0 and batch_idx == 1 else None


def test_a_window_cut_short_leaves_nothing_to_the_next_step() -> None:
    """The first epoch's lone accumulated batch is dropped as Lightning drops it (its next window zeroes the
    gradients), so the first optimizer step is that of the next epoch's two batches alone."""
    runs = []
    for cls in (SkipsRestOfFirstEpoch, MegatronLMModule):
        seen = Record()
        trainer = _trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[seen], use_distributed_sampler=False)
        model = cls(tiny_gpt(), lr=3e-3, warmup_steps=1, decay_steps=8)
        trainer.fit(model, DataLoader(MASKED[:8], batch_size=2))  # the same order every epoch
        runs.append((seen, [p.detach().clone() for p in model.parameters()]))
    (cut, weights_cut), (plain, weights) = runs
    assert cut.losses == plain.losses
    assert cut.norms == plain.norms
    for a, b in zip(weights_cut, weights, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
