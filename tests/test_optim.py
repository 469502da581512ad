"""The torch Adam inside Megatron's optimizer uses the implementation that fits the device, also after a resume."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data import synthetic_tokens


def _torch_groups(trainer: L.Trainer) -> list[dict]:
    optimizer = trainer.strategy.megatron_optimizer
    return [g for inner in optimizer.chained_optimizers for g in inner.optimizer.param_groups]


class MarkFused(L.Callback):
    """Make the saved param groups look like a GPU run's (fused AdamW) without stepping with them here."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        for group in _torch_groups(trainer):
            group["fused"], group["foreach"] = True, None


def _fit(tmp_path: Path, max_steps: int, callbacks: list, resume: str | None = None) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    data = DataLoader(synthetic_tokens(16, 32, 256), batch_size=4)
    trainer.fit(MegatronLMModule(tiny_gpt(), decay_steps=4), data, ckpt_path=resume)
    return trainer


class Inspect(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        optimizer = trainer.strategy.megatron_optimizer
        self.fused = [g["fused"] for g in _torch_groups(trainer)]
        self.steps = [s["step"] for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values()]


def test_resume_of_a_gpu_checkpoint_on_cpu_uses_the_cpu_adam(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path, 2, [saver, MarkFused()])
    inspect = Inspect()
    resumed = _fit(tmp_path, 3, [inspect], resume=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed.global_step == 3
    assert inspect.fused
    assert not any(inspect.fused)  # the saved flags were GPU ones; on CPU the strategy turns fused off again
    assert inspect.steps
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in inspect.steps)
