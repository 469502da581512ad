"""Lightning's weight averaging (``WeightAveraging``, ``EMAWeightAveraging``) for a model MegatronStrategy shards.

Lightning's callbacks keep an ``AveragedModel``: a deep copy of the whole LightningModule, made in ``setup`` -- before
``configure_model`` builds the Megatron chunks, so it averages nothing -- and saved in the checkpoint's ``state_dict``,
which sharded checkpoints do not hold. :class:`MegatronWeightAveraging` keeps the same settings, the same
``should_update`` rule and the same moments (after each optimizer step and epoch as ``should_update`` says; the
average swapped into the model for validation and copied into it when training ends), but each rank averages its own
shard of the weights in fp32 (:class:`~lightning_megatron.training.averaging.WeightAverage`), and checkpoints save the
average sharded beside the weights, resharded with them at any layout. MegatronStrategy puts one in place of each
Lightning ``WeightAveraging`` (with its settings and its ``should_update``) at ``connect``.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from typing import Any, override

import lightning as L
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging

from lightning_megatron.compat import lightning_internals
from lightning_megatron.contract import MegatronRuntime
from lightning_megatron.modules.base import megatron_module
from lightning_megatron.training.averaging import WeightAverage


class MegatronWeightAveraging(WeightAveraging):
    """Lightning's ``WeightAveraging`` on the weights MegatronStrategy shards (see the module).

    Args:
        device: where each rank keeps its average: the weights' device (``None``) or ``"cpu"`` (each update then
            copies the weights to the host and waits for them).
        use_buffers: Lightning's; the chunks' buffers (counters, routing biases) are not weights and are never
            averaged under Megatron, whatever its value.
        kwargs: ``avg_fn`` or ``multi_avg_fn`` as for ``torch.optim.swa_utils.AveragedModel``; neither: the
            equal-weight average of every update (SWA).

    Override :meth:`should_update` as for Lightning's callback. :attr:`average` is this fit's average;
    ``with callback.swapped_in(module):`` puts it in the weights' place, e.g. for ``module.save_hf(path)``.
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any) -> None:
        super().__init__(device=device, use_buffers=use_buffers, **kwargs)
        self.average: WeightAverage | None = None
        """This fit's average (from ``setup``)."""
        self._swap: AbstractContextManager[None] | None = None

    def _new_average(self) -> WeightAverage:
        device, _, kwargs = lightning_internals.weight_averaging_settings(self)  # Lightning's, as given to __init__
        avg_fn, multi_avg_fn = kwargs.get("avg_fn"), kwargs.get("multi_avg_fn")
        # Lightning's EMA function: updated in one pass, in place (multi_avg_fn wins over avg_fn, as in torch).
        decay = ema_decay(avg_fn) if multi_avg_fn is None else None
        user_fn = None if decay is not None else avg_fn
        return WeightAverage(decay=decay, avg_fn=user_fn, multi_avg_fn=multi_avg_fn, device=device)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, MegatronRuntime):
            raise TypeError(f"{type(self).__name__} averages a model sharded by MegatronStrategy; use Lightning's own")
        # Bound to the chunks when they exist (the strategy's first save plan, or on_fit_start).
        self.average = megatron_module(pl_module).weight_average = self._new_average()

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.average is not None
        self.average.bind(list(megatron_module(pl_module).chunks))

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # As Lightning's: once per optimizer step (not per accumulated batch), asking should_update(step_idx).
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._update(trainer)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._update(trainer)
            self._latest_update_epoch = trainer.current_epoch

    def _update(self, trainer: L.Trainer) -> None:
        assert self.average is not None
        assert isinstance(trainer.strategy, MegatronRuntime)
        if trainer.strategy.params_deferred:  # overlap_param_gather: this step's weights are not all here yet
            trainer.strategy.sync_params()
        self.average.update()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.average is not None
        trainer.strategy.sync_params()  # type: ignore[attr-defined]  (setup checked the strategy)
        self.average.copy_to_weights()  # as Lightning's: the model ends as the average

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Within fit only: trainer.validate(ckpt_path=...) loads a checkpoint's average as the weights itself.
        if self.average is not None and self._swap is None and trainer.state.fn == "fit":
            trainer.strategy.sync_params()  # type: ignore[attr-defined]  (a deferred gather would undo the swap)
            self._swap = self.average.swapped_in()
            self._swap.__enter__()

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swap is not None:
            swap, self._swap = self._swap, None
            swap.__exit__(None, None, None)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_validation_epoch_end(trainer, pl_module)  # a validation cut short gives the weights back

    def swapped_in(self, pl_module: L.LightningModule) -> AbstractContextManager[None]:
        """``with callback.swapped_in(module):`` the average in the weights' place (e.g. to ``save_hf`` it), the
        weights back afterwards. Collective under ``overlap_param_gather`` (finishes the parameter all-gather)."""
        module = megatron_module(pl_module)
        if self.average is None:
            raise RuntimeError(f"{type(self).__name__} has no average before trainer.fit set it up")
        module.trainer.strategy.sync_params()  # type: ignore[attr-defined]
        return self.average.swapped_in()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "num_averaged": self._num_averaged()}

    def _num_averaged(self) -> int:
        return 0 if self.average is None else self.average.num_averaged

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]
        if self.average is not None:
            self.average.num_averaged = int(state_dict.get("num_averaged", 0))

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        pass  # the sharded save holds the average beside the weights (module.weight_average)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        pass  # loaded by the strategy with the weights


class MegatronEMA(MegatronWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` on a sharded model: an exponential moving average of the weights,
    ``averaged = decay * averaged + (1 - decay) * current``, updated every ``update_every_n_steps`` optimizer steps
    from step ``update_starting_at_step`` (or every step from epoch ``update_starting_at_epoch``) -- the same arguments
    and rule as Lightning's, on :class:`MegatronWeightAveraging`."""

    def __init__(
        self, device: torch.device | str | int | None = None, use_buffers: bool = True, decay: float = 0.999,
        update_every_n_steps: int = 1, update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(device=device, use_buffers=use_buffers)
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def _new_average(self) -> WeightAverage:
        return WeightAverage(decay=self.decay, device=lightning_internals.weight_averaging_settings(self)[0])

    should_update = EMAWeightAveraging.should_update  # Lightning's own rule, on these same attributes


def ema_decay(avg_fn: Any) -> float | None:
    """The decay of Lightning's / torch's EMA function (``torch.optim.swa_utils.get_ema_avg_fn(decay)``, which
    ``EMAWeightAveraging`` passes), so that the average is updated in place; ``None`` for any other function."""
    function = inspect.unwrap(avg_fn) if callable(avg_fn) else None  # under torch.no_grad()'s wrapper
    code = getattr(function, "__code__", None)
    if function is None or function.__module__ != "torch.optim.swa_utils" or code is None:
        return None
    if function.__name__ != "ema_update" or "decay" not in code.co_freevars:
        return None
    decay = function.__closure__[code.co_freevars.index("decay")].cell_contents  # type: ignore[index]
    return float(decay) if isinstance(decay, int | float) else None


def adopt(trainer: L.Trainer) -> None:
    """When a run starts: each Lightning ``WeightAveraging`` callback (``EMAWeightAveraging`` and subclasses that
    change only ``__init__``/``should_update`` included) is replaced by a :class:`MegatronWeightAveraging` with its
    settings and its ``should_update``; ``StochasticWeightAveraging``, or a subclass that changes other hooks, raises
    ``TypeError`` naming what to use instead. The module's average of an earlier run is forgotten: only a run's own
    averaging callback (its ``setup``) gives it one, which its checkpoints then save."""
    megatron_module(trainer.lightning_module).weight_average = None
    for index, callback in enumerate(trainer.callbacks):
        if isinstance(callback, StochasticWeightAveraging):
            raise TypeError(
                "StochasticWeightAveraging is not supported by MegatronStrategy: it averages a deep copy of the "
                "module made before the Megatron chunks exist, and its SWA learning rates would overwrite the LR "
                "Megatron's scheduler sets. Use lightning_megatron.MegatronWeightAveraging() (the equal-weight "
                "average of the weights, updated as its should_update says; override it, e.g. to start at an epoch) "
                "and set the learning-rate schedule in the module's OptimizerSpec"
            )
        if isinstance(callback, WeightAveraging) and not isinstance(callback, MegatronWeightAveraging):
            trainer.callbacks[index] = _replacement(callback)


_LIGHTNING_CLASSES = (WeightAveraging, EMAWeightAveraging)


def _replacement(callback: WeightAveraging) -> MegatronWeightAveraging:
    users = [
        cls for cls in type(callback).__mro__ if issubclass(cls, WeightAveraging) and cls not in _LIGHTNING_CLASSES
    ]
    hooks = {name for cls in users for name, value in vars(cls).items() if inspect.isfunction(value)}
    # Lightning's hooks and WeightAveraging's own methods; a helper of the subclass's own (for should_update) is fine.
    if extra := sorted(name for name in hooks - {"__init__", "should_update"} if hasattr(WeightAveraging, name)):
        raise TypeError(
            f"{type(callback).__name__} overrides {', '.join(extra)} of Lightning's WeightAveraging, whose averaged "
            "copy of the module cannot hold a model MegatronStrategy shards; subclass "
            "lightning_megatron.MegatronWeightAveraging (same arguments and should_update) instead"
        )
    # Lightning keeps the settings in private attributes (docs/lightning.md, "Lightning internals").
    device, use_buffers, kwargs = lightning_internals.weight_averaging_settings(callback)
    replacement = MegatronWeightAveraging(device=device, use_buffers=use_buffers, **kwargs)
    replacement.should_update = callback.should_update  # type: ignore[method-assign]  (its rule, e.g. EMA's start)
    return replacement
