"""Weight averaging (EMA, SWA) on a sharded model: each rank keeps the average of its own shard of the weights.

:class:`WeightAverage` holds one fp32 tensor per trainable parameter of a rank's model chunks -- the rank's tensor-,
pipeline- and expert-parallel shard, the same on every data-parallel rank -- on the parameters' device (or in host
memory). :meth:`WeightAverage.update` folds the current weights in after an optimizer step (device tensors only: no
host synchronisation), :meth:`WeightAverage.swapped_in` puts the average in the weights' place for a while
(validation, an export) and back exactly, and :meth:`WeightAverage.sharded_state` describes it for a sharded
checkpoint with the weights' own sharding, so that it reshards across layouts as the weights do.

Cost: 4 bytes per parameter of the rank's shard, and an update reads the weights once and the average twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``avg_fn(averaged, current, num_averaged) -> new averaged`` (``torch.optim.swa_utils.AveragedModel``'s)."""
MultiAvgFn = Callable[[list[Tensor], list[Tensor], Tensor], None]
"""``multi_avg_fn(averaged, current, num_averaged)``, in place on lists (``AveragedModel``'s)."""
KEY_PREFIX = "weight_average."
"""A checkpoint's keys of the average: the weights' own keys behind this prefix."""
STATE_KEY = "weight_average"
"""Where the average's sharded entries sit in the state a checkpoint saves and loads."""


class WeightAverage:
    """The fp32 average of the trainable parameters of a rank's model chunks (see the module). The chunks are bound at
    the first call that passes them (after the strategy built them); the average starts as a copy of the weights.

    Args:
        decay: an exponential moving average with this decay: ``averaged = decay * averaged + (1 - decay) * current``;
            ``None``: ``avg_fn``/``multi_avg_fn``, or else the equal-weight mean of all updates (SWA).
        avg_fn, multi_avg_fn: ``AveragedModel``'s averaging functions (used when ``decay`` is None).
        device: where the average lives: the parameters' device (``None``) or ``"cpu"`` (an update then copies the
            weights to the host and waits for them).
    """

    def __init__(
        self, decay: float | None = None, avg_fn: AvgFn | None = None, multi_avg_fn: MultiAvgFn | None = None,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        if decay is not None and not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay={decay}: give a float in [0, 1] (averaged = decay*averaged + (1-decay)*current)")
        self.decay, self.avg_fn, self.multi_avg_fn = decay, avg_fn, multi_avg_fn
        self.device = None if device is None else torch.device(device)
        self.num_averaged = 0
        """Updates folded in so far (the first one copies the weights)."""
        self._params: list[list[tuple[str, nn.Parameter]]] | None = None
        self._averages: list[dict[str, Tensor]] = []

    @property
    def averages(self) -> list[dict[str, Tensor]]:
        """Per chunk, the average of each trainable parameter by name (empty before the chunks are bound)."""
        return self._averages

    def bind(self, chunks: Sequence[nn.Module]) -> None:
        """Start averaging the trainable parameters of ``chunks`` (once; later calls check it is the same model)."""
        params = [[(n, p) for n, p in chunk.named_parameters() if p.requires_grad] for chunk in chunks]
        if self._params is not None:
            if [[n for n, _ in c] for c in params] != [[n for n, _ in c] for c in self._params]:
                raise ValueError("WeightAverage is bound to another model's chunks; use one WeightAverage per module")
            self._params = params  # the same names: e.g. the chunks rebuilt
            return
        self._params = params
        pinned = self.device is not None and self.device.type == "cpu" and torch.cuda.is_available()
        self._averages = [
            {name: torch.empty(p.shape, dtype=torch.float32, device=self.device or p.device, pin_memory=pinned)
             for name, p in chunk_params}
            for chunk_params in params
        ]  # fmt: skip
        self.copy_from_weights()
        self.num_averaged = 0

    def _lists(self) -> tuple[list[Tensor], list[Tensor]]:
        if self._params is None:
            raise RuntimeError("WeightAverage has no chunks yet: bind(chunks) after the strategy built them")
        averaged = [avg[n] for params, avg in zip(self._params, self._averages, strict=True) for n, _ in params]
        return averaged, [p.detach() for params in self._params for _, p in params]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights into the average (the first update copies them, as ``AveragedModel`` does)."""
        averaged, current = self._lists()
        if not averaged:
            return
        if averaged[0].device != current[0].device:  # offloaded: the copies are waited for
            current = [c.to(averaged[0].device) for c in current]
        if self.num_averaged == 0:
            torch._foreach_copy_(averaged, current)
        elif self.decay is not None:
            ema_update(averaged, current, self.decay)
        else:
            self._custom_update(averaged, current)
        self.num_averaged += 1

    def _custom_update(self, averaged: list[Tensor], current: list[Tensor]) -> None:
        current = [c.to(a.dtype) for a, c in zip(averaged, current, strict=True)]  # bf16 weights, an fp32 average
        count = torch.tensor(self.num_averaged, device=averaged[0].device)
        if self.multi_avg_fn is not None:
            self.multi_avg_fn(averaged, current, count)
        elif self.avg_fn is not None:
            for average, value in zip(averaged, current, strict=True):
                average.copy_(self.avg_fn(average, value, count))
        else:  # the equal-weight mean of every update: averaged += (current - averaged) / (n + 1)
            difference = torch._foreach_sub(current, averaged)
            torch._foreach_add_(averaged, difference, alpha=1.0 / (self.num_averaged + 1))

    @torch.no_grad()
    def copy_from_weights(self) -> None:
        """Set the average to the current weights (its count unchanged)."""
        averaged, current = self._lists()
        torch._foreach_copy_(averaged, current)

    @torch.no_grad()
    def copy_to_weights(self) -> None:
        """Set the weights to the average (cast to their dtype)."""
        averaged, current = self._lists()
        torch._foreach_copy_(current, averaged)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the weights' place (cast to their dtype) inside the block; afterwards the weights are back,
        bit for bit (a copy of them is kept meanwhile: 2 bytes per parameter in bf16)."""
        _, current = self._lists()
        kept = [c.clone() for c in current]
        self.copy_to_weights()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(current, kept)

    def sharded_state(self, chunk_states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The average as sharded entries of a checkpoint: the entries of each chunk's sharded state dict
        (``chunk_states``, as the weights are saved or loaded) of the averaged parameters, holding the average, under
        the weights' keys behind :data:`KEY_PREFIX` -- sharded exactly as the weights."""
        if self._params is None:
            return {}
        state: dict[str, Any] = {}
        for index, (chunk_state, averages) in enumerate(zip(chunk_states, self._averages, strict=True)):
            state[f"chunk{index}"] = {name: averaged_entry(chunk_state[name], average)
                                      for name, average in averages.items()}  # fmt: skip
        return state

    @torch.no_grad()
    def load(self, loaded: dict[str, Any]) -> None:
        """Take the values of a checkpoint's average (what a load of :meth:`sharded_state` returned)."""
        for index, averages in enumerate(self._averages):
            for name, average in averages.items():
                value = loaded[f"chunk{index}"][name]
                if value is not average:
                    average.copy_(value)


def ema_update_eager(averaged: list[Tensor], current: list[Tensor], decay: float) -> None:
    """``averaged = decay * averaged + (1 - decay) * current``, in place: two passes over the average."""
    torch._foreach_mul_(averaged, decay)
    torch._foreach_add_(averaged, current, alpha=1.0 - decay)


_compiled: dict[str, Callable[..., None]] = {}


def ema_update(averaged: list[Tensor], current: list[Tensor], decay: float) -> None:
    """:func:`ema_update_eager`, on CUDA compiled into one pass per tensor (reads the average and the weights once,
    writes the average once: the update is bound by memory, and eagerly it moves 18 bytes per bf16 parameter instead
    of 10). Compiled once per run's shapes and decay (``dynamic=False``)."""
    if not averaged or not averaged[0].is_cuda or _compiled.get("ema") is ema_update_eager:
        ema_update_eager(averaged, current, decay)
        return
    if "ema" not in _compiled:
        _compiled["ema"] = torch.compile(ema_update_eager, fullgraph=True, dynamic=False)
    try:
        _compiled["ema"](averaged, current, decay)
    except Exception as error:  # noqa: BLE001  (a compiler that cannot build it: the same update, eagerly)
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"the compiled EMA update failed ({type(error).__name__}: {error}); updating eagerly")
        _compiled["ema"] = ema_update_eager
        ema_update_eager(averaged, current, decay)


def averaged_entry(entry: Any, data: Tensor | None = None) -> Any:
    """A sharded checkpoint entry of a weight (Megatron's ``ShardedTensor`` or ``ShardedTensorFactory``) as the entry
    of its average: the key behind :data:`KEY_PREFIX`, the same sharding, ``data`` (default: the entry's own data,
    which then receives the stored average when loaded)."""
    changes: dict[str, Any] = {"key": KEY_PREFIX + entry.key}
    if data is not None:
        changes["data"] = data
        if "dtype" in {field.name for field in dataclasses.fields(entry)}:
            changes["dtype"] = data.dtype
    return dataclasses.replace(entry, **changes)
