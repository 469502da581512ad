"""torchmetrics ``Metric`` objects of a run's LightningModule sync over Megatron's data-parallel group.

A ``Metric`` syncs its states over every rank (the default process group) in ``compute()``. Under tensor, pipeline
and context parallelism the ranks of one model replica see the same batch, so a metric updated from a hook's batch
holds the same values on each of them, and syncing over every rank counts them once per replica rank (a
``SumMetric`` of rows doubles at TP=2; means hide it). One rank per replica holds each sample: the data-parallel
group. The strategy binds the module's metrics to it when a run is set up (:func:`bind_metrics`) and unbinds them
at its teardown (:func:`unbind_metrics`), so a metric never keeps a finished run's group. A metric given its own
``process_group`` is left alone; one created after the run was set up (lazily, inside a hook) is not seen: create
it in ``__init__``/``configure_model``, or pass ``process_group=metric_process_group()``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_BOUND = "_lightning_megatron_bound_group"
"""Attribute on a metric this module bound: the group it set (what :func:`unbind_metrics` takes back)."""


def metric_process_group() -> Any | None:
    """The group a torchmetrics ``Metric`` of the running module syncs over: Megatron's data-parallel group, one rank
    per model replica (context-parallel peers are left out: they see the same samples, each a slice of their
    tokens); ``None`` when no parallel state exists (outside a run: torchmetrics' default, every rank)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=False)


def bind_metrics(module: nn.Module | None) -> list[nn.Module]:
    """Set ``process_group`` to :func:`metric_process_group` on every torchmetrics ``Metric`` among ``module``'s
    submodules (``MetricCollection`` members included) whose ``process_group`` is the default ``None`` -- or still a
    group an earlier bind set (a run whose teardown never came); returns the metrics it set."""
    from torchmetrics import Metric

    group = metric_process_group()
    if module is None or group is None:
        return []
    bound = []
    for metric in module.modules():
        if isinstance(metric, Metric) and _left_to_us(metric):
            metric.process_group = group
            setattr(metric, _BOUND, group)
            bound.append(metric)
    return bound


def unbind_metrics(module: nn.Module | None) -> list[nn.Module]:
    """Put ``process_group=None`` back on the metrics of ``module`` that :func:`bind_metrics` set and that still hold
    the group it set (one the user changed since is theirs); returns them. Local: safe after a failure."""
    from torchmetrics import Metric

    unbound = []
    for metric in module.modules() if module is not None else ():
        group = vars(metric).pop(_BOUND, None)
        if isinstance(metric, Metric) and group is not None and metric.process_group is group:
            metric.process_group = None
            unbound.append(metric)
    return unbound


def _left_to_us(metric: Any) -> bool:
    group = metric.process_group
    return group is None or group is vars(metric).get(_BOUND)
