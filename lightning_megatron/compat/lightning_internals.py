"""Reads (and the few writes) of Lightning's private attributes; ``register.py`` lists them with why each is needed.

Lightning keeps some settings only in private attributes of its callbacks and strategy; the package reads them to
replace a callback by one with the same settings or to refuse what it cannot serve. Nothing of Lightning's is patched.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import ModelSummary


def compiled_by_lightning(module: Any) -> bool:
    """Whether Lightning marked ``module`` as unwrapped from ``torch.compile`` (``LightningModule._compiler_ctx``, what
    Lightning's own compile check reads)."""
    return getattr(module, "_compiler_ctx", None) is not None


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or ``None`` (``LightningModule._trainer``: the public ``trainer``
    property raises when there is none)."""
    return module._trainer


def summary_settings(callback: ModelSummary) -> tuple[int, dict[str, Any]]:
    """A ``ModelSummary`` callback's ``max_depth`` and summarize keyword arguments (``_max_depth``,
    ``_summarize_kwargs``)."""
    return callback._max_depth, dict(callback._summarize_kwargs)


def summary_table(summary: Any) -> Any:
    """The table columns of a ``ModelSummary`` utility (``_get_summary_data()``), as Lightning's ``on_fit_start``
    passes them to ``summarize``."""
    return summary._get_summary_data()


def builds_summary_itself(callback: ModelSummary) -> bool:
    """Whether ``callback``'s class builds its summary with its own ``_summary`` (the method Lightning's
    ``ModelSummary.on_fit_start`` calls)."""
    return type(callback)._summary is not ModelSummary._summary


def build_summary_with(callback: ModelSummary, build: Callable[..., Any]) -> None:
    """Make ``callback`` build its summary with ``build(callback, trainer, pl_module)``: an instance attribute in
    the place of the class's ``_summary``."""
    callback._summary = types.MethodType(build, callback)  # type: ignore[method-assign]


def lightning_summary(callback: ModelSummary, trainer: Any, pl_module: Any) -> Any:
    """The summary Lightning's ``ModelSummary._summary`` builds."""
    return ModelSummary._summary(callback, trainer, pl_module)


def weight_averaging_settings(callback: Any) -> tuple[Any, bool, dict[str, Any]]:
    """A ``WeightAveraging`` callback's ``device``, ``use_buffers`` and the keyword arguments of its
    ``AveragedModel`` (``_device``, ``_use_buffers``, ``_kwargs``)."""
    return callback._device, callback._use_buffers, dict(callback._kwargs)


def syncs_batchnorm(strategy: Any) -> bool:
    """Whether ``Trainer(sync_batchnorm=True)`` asked the strategy to convert BatchNorm layers (``_layer_sync``)."""
    return getattr(strategy, "_layer_sync", None) is not None


def evaluate_without_inference_mode(trainer: Any) -> None:
    """Run the Trainer's validate/test/predict loops under ``torch.no_grad`` instead of ``torch.inference_mode``
    (``inference_mode``, an attribute of Lightning's private loop classes, which Lightning sets itself under FSDP)."""
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


def lr_finder_ends_the_fit(callback: Any) -> bool:
    """Whether a ``LearningRateFinder`` is ``Tuner.lr_find``'s own, which ends the fit after its search
    (``_early_exit``)."""
    return bool(getattr(callback, "_early_exit", False))
