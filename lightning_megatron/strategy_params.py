"""The parameter operations of :class:`~lightning_megatron.MegatronStrategy` that hooks and RL loops call between
steps: the step's gradient norms, finishing a deferred parameter all-gather, and releasing / bringing back the
weights, gradients and optimizer state (e.g. while a rollout engine uses the GPU).

A base class of the strategy, as :mod:`lightning_megatron.strategy_checkpoints` is; the strategy's state they use is
declared below, and ``MegatronStrategy`` sets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, override

from torch import Tensor

from lightning_megatron.parallel import ddp
from lightning_megatron.training.grad_norms import GradNormReads, grad_norms

if TYPE_CHECKING:
    from lightning_megatron.modules.base import MegatronLightningModule
    from lightning_megatron.runstate import RunState
    from lightning_megatron.training.accumulation import GradientAccumulation
    from lightning_megatron.training.guards import StepGuard
    from lightning_megatron.training.offload import Offloader


class ParameterOps:
    """Gradient norms, parameter sync and offload on Megatron's buffers (a base class of ``MegatronStrategy``)."""

    _run: RunState
    _accumulation: GradientAccumulation
    _grad_reads: GradNormReads
    _guard: StepGuard
    _offload: Offloader
    _megatron_optimizer: Any | None

    if TYPE_CHECKING:  # MegatronStrategy's own

        @property
        def module(self) -> MegatronLightningModule: ...

    def grad_norms(self) -> dict[str, Tensor]:
        """Collective, in ``on_before_optimizer_step``: the step's gradient norms, named as Lightning's
        ``grad_norm(module, 2)`` does, from Megatron's gradient buffers (``p.grad`` is None under Megatron)."""
        in_step = self._run.step is not None and not self._accumulation.deferring  # not between accumulated batches
        return grad_norms(self._run.ddp_chunks if in_step else None, self.module, self._grad_reads)

    @override
    def sync_params(self) -> None:
        """Finish a deferred parameter all-gather; first raise ``FloatingPointError`` for a non-finite update."""
        self._guard.check_pending()
        ddp.sync_params(self._run.ddp_chunks or [])

    @property
    @override
    def params_deferred(self) -> bool:
        return ddp.param_gather_deferred(self._run.ddp_chunks or [])

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Release (return the bytes) parameters and optimizer state to pinned host memory, gradients zeroed, what the
        model keeps derived from its weights (e.g. fp8 casts; uncounted) dropped; after :meth:`reload` every tensor is
        valid again and training goes on exactly as before."""
        nbytes = self._offload.release(
            lambda: self.module.chunks, self._megatron_optimizer, params=params, grads=grads, optimizer_state=optimizer
        )  # (raises first under CUDA graphs, whose replays write into the casts: those must stay then)
        self._run.hooks.weights_released(self.module.chunks)
        return nbytes

    def reload(self) -> None:
        """Bring back what :meth:`offload` released."""
        self._offload.reload()
