"""When a fit stages its saves' host buffers: at its start with a checkpoint callback that saves as it goes (the
first save then allocates nothing), not for an ``OnExceptionCheckpoint`` alone, ``fast_dev_run`` or no callback."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import one_process_trainer


class HeldAtStart(L.Callback):
    """The host buffers' bytes when training starts, and what the strategy says it staged."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        writer = trainer.strategy.checkpoint_writer
        self.bytes, self.prestaged = writer.buffers.bytes, dict(writer.prestaged)
        self.allocations = writer.buffers.allocations


def _fit(strategy: MegatronStrategy, *callbacks: L.Callback, steps: int = 2, **kwargs: object) -> HeldAtStart:
    held = HeldAtStart()
    checkpointing = any(isinstance(c, (ModelCheckpoint, OnExceptionCheckpoint)) for c in callbacks)
    trainer = one_process_trainer(steps, strategy=strategy, callbacks=[held, *callbacks],
                                  enable_checkpointing=checkpointing, **kwargs)  # fmt: skip
    data = DataLoader(synthetic_tokens(16, 32, 256, seed=3), batch_size=4)
    trainer.fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data)
    return held


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_fit_with_a_saving_callback_stages_at_its_start(tmp_path: Path, async_save: bool) -> None:
    strategy = MegatronStrategy(micro_batch_size=2, async_save=async_save)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    held = _fit(strategy, saver)
    assert held.bytes > 0
    assert held.prestaged["allocate_s"] > 0
    assert strategy.checkpoint_writer.last_save["allocate_s"] == 0  # the saves allocated nothing


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_weights_only_saves_beside_full_ones_without_model_weights_allocate_nothing(
    tmp_path: Path, async_save: bool
) -> None:
    # Full saves without the bf16 weights (save_model_weights=False) and weights-only saves (the bf16 weights alone)
    # hold different tensors: both are staged at the start.
    checkpoint = CheckpointConfig(async_save=async_save, save_model_weights=False)
    strategy = MegatronStrategy(micro_batch_size=2, use_distributed_optimizer=True, checkpoint=checkpoint)
    full = ModelCheckpoint(dirpath=tmp_path / "full", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    weights = ModelCheckpoint(dirpath=tmp_path / "weights", every_n_train_steps=2, save_weights_only=True)
    held = _fit(strategy, full, weights)
    assert held.prestaged["allocate_s"] > 0
    assert strategy.checkpoint_writer.buffers.allocations == held.allocations  # no save allocated
    assert [path.name for path in (tmp_path / "weights").iterdir()] == ["epoch=0-step=2.ckpt"]  # it saved


def test_an_on_exception_checkpoint_alone_stages_nothing(tmp_path: Path) -> None:
    held = _fit(MegatronStrategy(micro_batch_size=2), OnExceptionCheckpoint(dirpath=tmp_path))
    assert (held.bytes, held.prestaged) == (0, {})


def test_fast_dev_run_stages_nothing(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)
    held = _fit(MegatronStrategy(micro_batch_size=2), saver, steps=-1, fast_dev_run=2)
    assert (held.bytes, held.prestaged) == (0, {})


def test_an_earlier_fits_staging_time_is_not_reported_again() -> None:
    from lightning_megatron.checkpointing.writer import CheckpointWriter

    writer = CheckpointWriter(CheckpointConfig(keep_host_buffers=False))  # this one stages nothing
    writer.prestaged = {"prestage_s": 1.0}  # an earlier fit's

    def build(*args: object) -> dict:
        raise AssertionError("staged with keep_host_buffers=False")

    writer.prestage(build)
    assert writer.prestaged == {}
