"""Tokens per local expert, read where each consumer needs them: on the device or on the host.

The grouped expert GEMMs take the token counts as device offsets, so a layer's forward need not wait for them.
The per-expert loops (the CPU/reference path, the fp32 weight-gradient accumulation into ``main_grad``) need
them on the host. :class:`ExpertCounts` holds both: made from device counts, it starts their copy into pinned
host memory and waits for it only when :meth:`ExpertCounts.host` is first called. In training that call comes
in the layer's backward, long after the copy finished, so the host never stops the GPU's queue for the counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ExpertCounts"]


class ExpertCounts:
    """The rows of each local expert in a layer's expert-sorted tokens.

    Args:
        counts: one count per local expert: a tensor (on a GPU, its copy into pinned host memory starts now,
            without waiting; it is read on the host only when :meth:`host` is called) or a sequence of ints.
    """

    def __init__(self, counts: Tensor | Sequence[int]) -> None:
        self._device: Tensor | None = None
        self._host: tuple[int, ...] | None = None
        self._pending: tuple[Tensor, torch.cuda.Event] | None = None
        self._offsets: Tensor | None = None
        self._checked_rows: int | None = None
        if isinstance(counts, Tensor):
            self._device = counts
            if counts.is_cuda:
                pinned = torch.empty(counts.shape, dtype=torch.long, pin_memory=True)
                pinned.copy_(counts, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
                self._pending = (pinned, copied)
        else:
            self._host = tuple(int(n) for n in counts)

    def __len__(self) -> int:
        return len(self._host) if self._host is not None else self._device.shape[0]  # type: ignore[union-attr]

    @property
    def on_host(self) -> bool:
        """Whether the counts are known on the host (else :meth:`host` reads them from their tensor)."""
        return self._host is not None

    def host(self) -> tuple[int, ...]:
        """The counts as ints; from CUDA counts, this waits for their copy (queued when they were made)."""
        if self._host is None:
            if self._pending is not None:
                pinned, copied = self._pending
                copied.synchronize()
                self._host, self._pending = tuple(pinned.tolist()), None
            else:
                self._host = tuple(self._device.tolist())  # type: ignore[union-attr]
        return self._host

    def offsets(self, device: torch.device) -> Tensor:
        """The grouped kernel's ``offs``: int32 cumulative counts on ``device``, computed once."""
        if self._offsets is None:
            if self._device is not None and self._device.device == device:
                self._offsets = torch.cumsum(self._device, 0, dtype=torch.int32)
            else:
                offs = torch.tensor(list(itertools.accumulate(self.host())), dtype=torch.int32)
                # From pinned memory without blocking: a pageable copy would wait for the GPU work queued before it.
                self._offsets = offs.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else offs
        return self._offsets

    def assert_total(self, rows: int, device: torch.device) -> None:
        """Stop the run unless the counts add up to ``rows`` -- checked on ``device`` without waiting for it (on a
        GPU a device-side assert, which ends the process's CUDA context; on CPU a ``RuntimeError``)."""
        if self._checked_rows != rows:
            message = f"the {len(self)} experts' token counts must add up to the {rows} rows given"
            torch._assert_async(self.offsets(device)[-1] == rows, message)
            self._checked_rows = rows

    def tensor(self) -> Tensor:
        """The counts as a tensor (on the device where they came from one)."""
        return self._device if self._device is not None else torch.tensor(self.host())
