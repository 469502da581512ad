"""Megatron's optimizer and LR schedule as Lightning sees them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, override

import lightning as L
import torch

from lightning_megatron.module import OptimizerSpec


@dataclass(frozen=True)
class StepStats:
    """What the last optimizer step reported."""

    lr: float
    grad_norm: float | None
    skipped: bool


class LightningOptimizerAdapter(torch.optim.Optimizer):
    """The face Megatron's optimizer shows to Lightning's automatic optimization.

    Lightning's closure order is training_step -> ``zero_grad`` -> backward -> ``step``; our training_step already
    produced the gradients (Megatron's schedule runs backward), so ``zero_grad`` must not clear them: the strategy
    zeroes Megatron's grad buffers itself before each schedule run. ``step`` runs Megatron's optimizer (grad
    clipping and the distributed-optimizer all-gather included) and then the LR schedule.
    """

    def __init__(
        self,
        optimizer: Any,
        scheduler: Any,
        on_step: Callable[[StepStats], None],
        should_step: Callable[[Any], bool] | None = None,
    ) -> None:
        # Deliberately not Optimizer.__init__: the parameters and state belong to Megatron's optimizer.
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._on_step = on_step
        self._should_step = should_step  # gets the step's loss; False skips the update (non-finite policy)
        self.defaults: dict[str, Any] = {}
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
        if self._should_step is not None and not self._should_step(loss):
            # Weights, optimizer state and LR schedule stay as they were (as Megatron does for overflowed steps).
            self._on_step(StepStats(lr=lr, grad_norm=None, skipped=True))
            return loss
        update_successful, grad_norm, _ = self._optimizer.step()
        if update_successful:
            self._scheduler.step(increment=1)
        self._on_step(StepStats(lr=lr, grad_norm=grad_norm, skipped=not update_successful))
        return loss

    @override
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the Megatron optimizer's state is saved sharded by MegatronStrategy.save_checkpoint")


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
    config = spec.config
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if spec.lr_warmup_steps > 0 else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr or 0.0,
        lr_warmup_steps=spec.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, spec.lr_warmup_steps + 1),
        lr_decay_style=spec.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        # A resumed run must continue the saved schedule; a mismatch raises instead of being overridden.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer``'s parts, else itself); each holds a torch
    optimizer as ``.optimizer``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def use_fused_adam(optimizer: Any, fused: bool) -> int:
    """Switch the torch Adam(W) inside Megatron's optimizer to torch's fused CUDA kernel (or back); returns how many
    parameter groups use it.

    Without Transformer Engine or apex, megatron-core builds ``torch.optim.AdamW`` with its default
    (multi-tensor "foreach") implementation: about 8% of a 1B model's step on an H200. ``fused`` is a
    per-group switch read at every step, so flipping it keeps every parameter, state tensor and checkpoint
    as they are. Call it again after loading a checkpoint: Megatron restores the saved groups' flags. The fused
    kernel wants the ``step`` counters on the parameters' device.
    """
    switched = 0
    for inner in inner_optimizers(optimizer):
        torch_optimizer = inner.optimizer
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
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


_LOCAL_CLIP_GRADS: dict[str, Any] = {}  # megatron-core's own fallbacks while ours are installed


def use_foreach_clip_grads() -> bool:
    """Give megatron-core's gradient clipping torch's multi-tensor kernels where it fell back to per-tensor loops.

    Without Transformer Engine or apex, ``megatron.core.optimizer.clip_grads`` computes the gradient norm with one
    ``torch.norm`` and one host read per parameter tensor -- a GPU synchronisation each, ~100 per step for a
    16-layer model -- and rescales clipped gradients one tensor at a time. ``torch._foreach_norm`` and
    ``torch._foreach_mul_`` (what ``torch.nn.utils.clip_grad_norm_`` uses) do the same arithmetic in a few kernels,
    leaving Megatron's single read of the total norm. Process-wide until :func:`restore_clip_grads`; does nothing
    (returns False) when Transformer Engine's or apex's kernels are in use.
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if _LOCAL_CLIP_GRADS or clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return bool(_LOCAL_CLIP_GRADS)
    _LOCAL_CLIP_GRADS.update(
        l2_norm_impl=clip_grads.l2_norm_impl, multi_tensor_scale_impl=clip_grads.multi_tensor_scale_impl
    )
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    return True


def restore_clip_grads() -> None:
    """Put megatron-core's own fallbacks back (see :func:`use_foreach_clip_grads`)."""
    from megatron.core.optimizer import clip_grads

    for name, fn in _LOCAL_CLIP_GRADS.items():
        setattr(clip_grads, name, fn)
    _LOCAL_CLIP_GRADS.clear()


def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], *args: Any) -> tuple:
    # Same contract as apex's amp_C.multi_tensor_l2norm (through Megatron's local multi_tensor_applier):
    # the L2 norm of all tensors together as a float32 tensor of shape [1], left on the device.
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    # amp_C.multi_tensor_scale's contract: dst = src * scale, tensor by tensor.
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))
