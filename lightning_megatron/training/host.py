"""Device values read on the host without draining the GPU's queue."""

from __future__ import annotations

import torch
from torch import Tensor


class HostScalar:
    """A scalar on the host, copied from the device without waiting for the GPU.

    The copy is queued behind the work that produced the value; :meth:`get` waits for that copy only. Reading
    the loss with ``.item()`` after the optimizer step (what a progress bar does every step) would instead wait
    for the optimizer's kernels too, and keep the host from queueing the next step while they run.
    """

    def __init__(self, value: Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self._value = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._value.copy_(value.detach(), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._value = value.detach().to("cpu", copy=True)

    def ready(self) -> bool:
        """Whether :meth:`get` would return without waiting."""
        return self._ready is None or self._ready.query()

    def get(self) -> Tensor:
        """The value as a CPU tensor (waits for its copy, not for later GPU work)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._value
