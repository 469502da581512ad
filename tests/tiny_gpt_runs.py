"""The tiny GPT's one-process CPU runs shared by the fault, checkpoint and callback tests (``test_faults.py``,
``test_save_failures.py``, ``test_untrusted_checkpoints.py``, ``test_module_habits.py``, ``test_weight_averaging.py``
and ``tests/conftest.py``'s ``saved`` checkpoints): its data, Trainer, module and a fit that records the losses.

A helper module, not a test module: test modules import its names; it imports no test module.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens

DATA = synthetic_tokens(48, 32, 256, seed=5)


def tiny_trainer(max_steps: int = 4, strategy: MegatronStrategy | None = None, **kwargs: object) -> L.Trainer:
    """A one-process CPU Trainer (``MegatronStrategy(micro_batch_size=2)`` unless ``strategy``): no logger,
    checkpointing, progress bar, summary or sanity check unless ``kwargs`` say so."""
    defaults: dict = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy or MegatronStrategy(micro_batch_size=2), max_steps=max_steps,
        enable_model_summary=False, num_sanity_val_steps=0, **{**defaults, **kwargs},
    )  # fmt: skip


def tiny_model(**kwargs: object) -> MegatronLMModule:
    """The tiny GPT's module (decay over 8 steps; ``kwargs``: the module's other arguments)."""
    return MegatronLMModule(tiny_gpt(), decay_steps=8, **kwargs)


class StepLosses(L.Callback):
    """The training loss of each step, by global step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses[trainer.global_step] = float(outputs["loss"])


def tiny_fit(
    steps: int, *callbacks: L.Callback, ckpt_path: str | None = None, batch_size: int = 8, **kwargs: object
) -> dict[int, float]:
    """``steps`` steps of a fresh ``tiny_model`` on ``DATA`` (checkpointing on when a callback is a ``Checkpoint``;
    ``kwargs``: ``tiny_trainer``'s); the loss of each step, by global step."""
    losses = StepLosses()
    enable = any(isinstance(c, Checkpoint) for c in callbacks)
    trainer = tiny_trainer(steps, callbacks=[losses, *callbacks], enable_checkpointing=enable, **kwargs)
    trainer.fit(tiny_model(), DataLoader(DATA, batch_size=batch_size), ckpt_path=ckpt_path)
    return losses.losses
