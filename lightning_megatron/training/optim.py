"""Megatron's optimizer and LR schedule as Lightning sees them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, override

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_megatron.compat.megatron_internals import torch_adams, torch_optimizers
from lightning_megatron.contract import OptimizerSpec, StepStats
from lightning_megatron.parallel import ddp
from lightning_megatron.parallel.precision import megatron_dtype_fields
from lightning_megatron.training import guards

if TYPE_CHECKING:
    from lightning_megatron.compat.patches import ForeachClipGrads


class LightningOptimizerAdapter(torch.optim.Optimizer):
    """The face Megatron's optimizer shows to Lightning's automatic optimization.

    Lightning's closure order is training_step -> ``zero_grad`` -> backward -> ``step``; our training_step already
    produced the gradients (Megatron's schedule runs backward), so ``zero_grad`` must not clear them: the strategy
    zeroes Megatron's grad buffers itself before each schedule run. ``step`` runs Megatron's optimizer (grad
    clipping and the distributed-optimizer all-gather included) and then the LR schedule. ``take_token_scale``
    returns the factor the gradients still wait for, if the DDP deferred it (``parallel/ddp.py``): Megatron's
    clipping applies it through ``clip`` (:meth:`ForeachClipGrads.token_scale`). ``after_update`` runs after each
    update: the strategy marks the fp8 weight casts stale there (``kernels/fp8.py:weights_changed``), since Megatron
    writes the new weights through its buffers, which the casts' own check (the version counters) does not see.
    """

    def __init__(
        self,
        optimizer: Any,
        scheduler: Any,
        on_step: Callable[[StepStats], None],
        should_step: Callable[[Any], bool] | None = None,
        take_token_scale: Callable[[], Any] | None = None,
        clip: ForeachClipGrads | None = None,
        after_update: Callable[[], None] | None = None,
    ) -> None:
        # Deliberately not Optimizer.__init__: the parameters and state belong to Megatron's optimizer.
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._on_step = on_step
        self._should_step = should_step  # gets the step's loss; False skips the update (non-finite policy)
        self._take_token_scale = take_token_scale
        self._clip = clip
        self._after_update = after_update
        # The torch optimizer's (e.g. Adam's betas, which LearningRateMonitor(log_momentum=True) looks for).
        self.defaults: dict[str, Any] = dict(torch_optimizers(optimizer)[0].defaults)
        self.state: dict[Any, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # see the class docstring

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        lr = float(self._optimizer.param_groups[0]["lr"])
        token_scale = self._take_token_scale() if self._take_token_scale is not None else None
        if self._should_step is not None and not self._should_step(loss):
            # Weights, optimizer state and LR schedule stay as they were (as Megatron does for overflowed steps).
            self._on_step(StepStats(lr=lr, grad_norm=None, skipped=True))
            return loss
        with self._clip.token_scale(token_scale) if self._clip is not None else nullcontext():
            update_successful, grad_norm, _ = self._optimizer.step()
        if self._after_update is not None:
            self._after_update()
        if isinstance(grad_norm, torch.Tensor):  # Megatron's no-sync clipping keeps it on the device, shape [1]
            grad_norm = grad_norm.detach().reshape(()).float()
        if update_successful:
            self._scheduler.step(increment=1)
        self._on_step(StepStats(lr=lr, grad_norm=grad_norm, skipped=not update_successful))
        return loss

    @override
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the Megatron optimizer's state is saved sharded by MegatronStrategy.save_checkpoint")


def check_spec(spec: object, module_name: str) -> OptimizerSpec:
    """``spec`` if it is an :class:`OptimizerSpec` (what ``configure_optimizers`` must return), ``TypeError`` else."""
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(
            f"{module_name}.configure_optimizers must return lightning_megatron.OptimizerSpec, "
            f"got {type(spec).__name__}"
        )
    return spec


def build(
    spec: OptimizerSpec, chunks: list[Any], trainer: L.Trainer, *, dtype: torch.dtype, distributed: bool, fused: bool
) -> tuple[Any, Any]:
    """Megatron's optimizer over the DDP-wrapped ``chunks`` -- its precision fields from ``dtype``,
    ``use_distributed_optimizer=distributed``, torch's fused Adam kernel if ``fused`` -- and its LR schedule."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = replace(spec.config, use_distributed_optimizer=distributed, **megatron_dtype_fields(dtype))
    optimizer = get_megatron_optimizer(config, chunks)
    use_fused_adam(optimizer, fused=fused)
    return optimizer, build_scheduler(optimizer, spec, trainer)


def build_scheduler(optimizer: Any, spec: OptimizerSpec, trainer: L.Trainer) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = spec.lr_decay_steps
    if decay_steps is None:
        total = trainer.estimated_stepping_batches
        if total == float("inf") or total < 1:
            raise ValueError(
                f"lr_decay_steps=None means 'decay over the whole run', but the Trainer's total steps are {total}; "
                "set Trainer(max_steps=...) or lr_decay_steps"
            )
        decay_steps = int(total)
    if spec.lr_decay_steps is not None and decay_steps <= spec.lr_warmup_steps:
        raise ValueError(
            f"lr_warmup_steps={spec.lr_warmup_steps} is not shorter than lr_decay_steps={decay_steps} (the schedule "
            "decays after the warm-up); use fewer warm-up steps (MegatronLMModule(warmup_steps=...)) or more decay "
            "steps"
        )
    if decay_steps <= spec.lr_warmup_steps:  # a short run (fast_dev_run, a smoke test) of a config with warm-up
        rank_zero_warn(
            f"lr_warmup_steps={spec.lr_warmup_steps} is not shorter than this run's {decay_steps} steps, over which "
            "lr_decay_steps=None decays: the LR warms up for the whole run and does not decay"
        )
        decay_steps = spec.lr_warmup_steps + 1
    config = spec.config
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if spec.lr_warmup_steps > 0 else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr or 0.0,
        lr_warmup_steps=spec.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=spec.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        # A resumed run continues the saved schedule and a mismatch raises, unless the spec asks for its own schedule
        # (then the checkpoint gives only the step count).
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=spec.override_lr_schedule,
    )


def setup(
    spec: OptimizerSpec,
    ddp_chunks: list[Any],
    trainer: L.Trainer,
    guard: guards.StepGuard,
    clip: ForeachClipGrads,
    *,
    dtype: torch.dtype,
    distributed: bool,
    fused: bool,
    after_update: Callable[[], None] | None = None,
) -> tuple[Any, Any, LightningOptimizerAdapter]:
    """Megatron's optimizer and LR schedule for ``spec`` (:func:`build`; torch's fused Adam if ``fused``), the
    adapter Lightning steps (:func:`lightning_adapter`, with the strategy's ``clip`` patch), and the
    schedule's hooks on the chunks' config (``parallel/ddp.py``). After each step ``guard`` records what it reported
    (raising, under the "error" policy, before any save) and ``after_update`` runs after each update. ``guard``'s
    "skip" policy decides before each update whether to step, at one GPU synchronisation per step."""
    nonfinite = guard.policy
    on_step = lambda stats: guard.record(stats, trainer.global_step)  # noqa: E731
    optimizer, scheduler = build(spec, ddp_chunks, trainer, dtype=dtype, distributed=distributed, fused=fused)
    should_step = None
    if nonfinite == "skip":  # with fp16, gradients are loss-scaled: Megatron's scaler handles their overflow
        check_grads = dtype != torch.float16
        should_step = lambda loss: guards.step_is_finite(loss, ddp_chunks, check_grads=check_grads)  # noqa: E731
    adapter = lightning_adapter(optimizer, scheduler, ddp_chunks, on_step, should_step, clip, after_update)
    ddp.set_schedule_hooks(ddp_chunks, optimizer)
    return optimizer, scheduler, adapter


def lightning_adapter(
    optimizer: Any,
    scheduler: Any,
    ddp_chunks: list[Any],
    on_step: Callable[[StepStats], None],
    should_step: Callable[[Any], bool] | None,
    clip: ForeachClipGrads,
    after_update: Callable[[], None] | None = None,
) -> LightningOptimizerAdapter:
    """The adapter Lightning steps. When Megatron clips on torch's multi-tensor kernels (``clip`` installed), the
    DDP's division by the token count is deferred into the clipping's multiply
    (``parallel/ddp.py:TokenScaleDeferringDDP``)."""
    folds = clip.installed and clips(optimizer)
    ddp.defer_token_scale(ddp_chunks, folds)
    take = (lambda: ddp.take_token_scale(ddp_chunks)) if folds else None
    return LightningOptimizerAdapter(
        optimizer, scheduler, on_step, should_step, take_token_scale=take, clip=clip, after_update=after_update
    )


def clips(optimizer: Any) -> bool:
    """Whether every part of a Megatron optimizer clips gradients by norm (``clip_grad > 0``)."""
    return all(part.config.clip_grad > 0 for part in getattr(optimizer, "chained_optimizers", [optimizer]))


def use_fused_adam(optimizer: Any | None, fused: bool) -> int:
    """Switch the torch Adam(W) inside Megatron's optimizer to torch's fused CUDA kernel (or back); returns how many
    parameter groups use it (0 without an optimizer: validate/test/predict).

    Without Transformer Engine or apex, megatron-core builds ``torch.optim.AdamW`` with its default
    (multi-tensor "foreach") implementation: about 8% of a 1B model's step on an H200. ``fused`` is a
    per-group switch read at every step, so flipping it keeps every parameter, state tensor and checkpoint
    as they are. Call it again after loading a checkpoint: Megatron restores the saved groups' flags. The fused
    kernel wants the ``step`` counters on the parameters' device.
    """
    switched = 0
    for torch_optimizer in torch_adams(optimizer) if optimizer is not None else ():
        for group in torch_optimizer.param_groups:
            on_gpu = all(p.is_cuda and p.is_floating_point() for p in group["params"])
            group["fused"] = fused and on_gpu
            group["foreach"] = None if group["fused"] else group.get("foreach")
            switched += int(group["fused"])
        place_adam_steps(torch_optimizer)
    return switched


def place_adam_steps(torch_optimizer: torch.optim.Optimizer) -> None:
    """Put each Adam ``step`` counter where its group's implementation wants it: the parameter's device for the
    fused kernel, the host otherwise (a device counter there would cost a sync per parameter per step)."""
    for group in torch_optimizer.param_groups:
        for param in group["params"]:
            step = torch_optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                device = param.device if group.get("fused") else torch.device("cpu")
                torch_optimizer.state[param]["step"] = step.to(device=device, dtype=torch.float32)
