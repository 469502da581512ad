"""Lightning's gradient accumulation (``Trainer(accumulate_grad_batches=k)``, ``GradientAccumulationScheduler``)
over Megatron's schedule: k DataLoader batches, one optimizer step.

Lightning runs the first k-1 batches of a window inside ``strategy.block_backward_sync()`` and the last one
through ``optimizer_step`` (also a shorter last window at the epoch's end). Each batch runs Megatron's schedule
(forward and backward of its micro-batches); gradients add up in Megatron's buffers. For the deferred batches the
schedule's gradient finalisation (the data-parallel reduction and the division by the token count) is held back and
its token count carried: the last batch's finalisation reduces once and divides by the tokens of the whole window,
so k batches give the gradient of one batch k times larger (token-weighted), as Lightning's DeepSpeed strategy
does with its engine's accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

from torch import Tensor

_HOOKS = ("finalize_model_grads_func", "no_sync_func", "grad_sync_func")


class GradientAccumulation:
    """Which batches of a window defer their gradient finalisation, and the tokens they carry to the last one."""

    def __init__(self) -> None:
        self.deferring = False
        """Inside ``block_backward_sync``: this batch does not end the window."""
        self.open = False
        """A window has begun (gradients from an earlier batch wait in the buffers)."""
        self._carried: Tensor | None = None

    @contextmanager
    def defer(self) -> Iterator[None]:
        """The strategy's ``block_backward_sync``: Lightning's signal that the next batch does not step."""
        previous, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = previous

    def begin(self, first: bool) -> bool:
        """Before a batch's schedule run: whether it starts a window (the gradient buffers must be zeroed then):
        ``first`` by Lightning's rule (``batch_idx % accumulate_grad_batches == 0``, as its ``zero_grad``), or the
        first batch after a step. A window abandoned halfway (an epoch cut short) leaves nothing behind."""
        starts, self.open = first or not self.open, True
        if starts:
            self._carried = None
        return starts

    @staticmethod
    def follow_schedule(trainer: Any) -> None:
        """At each training batch's start: ``trainer.accumulate_grad_batches`` as a ``GradientAccumulationScheduler``
        sets it for the current epoch. The scheduler sets it in ``on_train_epoch_start``, which Lightning does not call
        for the epoch a run resumes in the middle of: that epoch would go on with 1 batch a step."""
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        for callback in trainer.callbacks:
            if isinstance(callback, GradientAccumulationScheduler):
                trainer.accumulate_grad_batches = callback.get_accumulate_grad_batches(trainer.current_epoch)

    def close(self) -> None:
        """After the window's optimizer step (or when a run ends)."""
        self.open, self._carried = False, None

    @contextmanager
    def schedule_hooks(self, ddp_chunks: list[Any]) -> Iterator[None]:
        """Around one batch's schedule run: a deferred batch runs every micro-batch without gradient
        communication and keeps its token count; the window's last batch finalises with all of them."""
        config = ddp_chunks[0].config
        if not self.deferring and self._carried is None:
            yield  # k == 1: Megatron's hooks as they are
            return
        saved = {name: getattr(config, name) for name in _HOOKS}
        finalize = saved["finalize_model_grads_func"]
        with ExitStack() as stack:
            if self.deferring:
                for chunk in ddp_chunks:  # no reduction at all, also not the schedule's last micro-batch's
                    stack.enter_context(chunk.no_sync())
                config.no_sync_func, config.grad_sync_func = nullcontext, None
                config.finalize_model_grads_func = self._carry
            else:
                config.finalize_model_grads_func = self._with_carried(finalize)
            try:
                yield
            finally:
                for name, value in saved.items():
                    setattr(config, name, value)

    def _carry(self, model: Any, num_tokens: Tensor | None = None, **kwargs: Any) -> None:
        if num_tokens is not None:
            self._carried = num_tokens.clone() if self._carried is None else self._carried + num_tokens

    def _with_carried(self, finalize: Callable[..., Any]) -> Callable[..., Any]:
        def finalize_window(model: Any, num_tokens: Tensor | None = None, **kwargs: Any) -> Any:
            if num_tokens is not None and self._carried is not None:
                num_tokens = num_tokens + self._carried
            return finalize(model, num_tokens, **kwargs)

        return finalize_window
