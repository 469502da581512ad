"""What one run of :class:`~lightning_megatron.MegatronStrategy` holds, from ``setup_environment`` to ``teardown``.

A run is one ``trainer.fit`` / ``validate`` / ``test`` / ``predict``. What outlives it -- Megatron's process groups
(reused by the next run of the same strategy), the optimizer and LR schedule (kept for ``trainer.save_checkpoint``
after ``fit``: ``training/retained.py``) -- stays on the strategy; what each run builds and must undo is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_megatron import schedule
from lightning_megatron.compat import patches
from lightning_megatron.contract import ModelHooks
from lightning_megatron.parallel import ddp


@dataclass(kw_only=True)
class RunState:
    """One run's state. Between runs the strategy holds an idle one (no chunks, no patches, default hooks)."""

    hooks: ModelHooks = field(default_factory=ModelHooks)
    """The model family's hooks (``MegatronLightningModule.model_hooks()``), asked once when the run starts."""
    patches: patches.PatchStack = field(default_factory=patches.PatchStack)
    """Every process-wide patch of the run, removed at its teardown (``patches.py``)."""
    rng: dict[str, Any] | None = None
    """The global RNG states from before the run seeded them, restored at its teardown."""
    log_names: schedule.LogNames = field(default_factory=schedule.LogNames)
    """The ``loss_fn`` log names every pipeline stage knows."""
    run_chunks: list[nn.Module] | None = None
    """What the schedule runs: the module's chunks, precision-wrapped (and DDP-wrapped for fit); set in ``setup``."""
    ddp_chunks: list[nn.Module] | None = None
    """The chunks in Megatron's DDP (fit only): the schedule's and optimizer's view of the gradients."""
    step: schedule.TrainStep | None = None
    """The optimizer step in progress (between ``training_step`` and the logging after ``optimizer_step``)."""
    failed: bool = False
    """The run raised (not a preemption): peers may be dead, so teardown must not wait for them."""

    def release(self) -> None:
        """Undo what the run built around the chunks: Megatron's schedule hooks and the family's per-run state."""
        ddp_chunks, run_chunks = self.ddp_chunks, self.run_chunks
        self.ddp_chunks = self.run_chunks = self.step = None
        if ddp_chunks:
            ddp.clear_hooks(ddp_chunks[0].config)
        self.hooks.run_ended(run_chunks or [])
