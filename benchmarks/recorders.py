"""What the benchmarks record in their timed steps besides wall time: host-GPU synchronisations and Python's garbage
collections (used by every variant of benchmarks/throughput.py)."""

from __future__ import annotations

import collections
import gc
import os
import time
import traceback
import warnings
from typing import Any

import torch


class SyncCounter:
    """Host-GPU synchronisations (``torch.cuda.set_sync_debug_mode``) between ``start`` and ``stop``, counted by
    the innermost call sites outside torch. Pageable host-to-device copies synchronise inside the driver, unseen."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.counts: collections.Counter[str] = collections.Counter()
        self._context: Any = None

    def start(self) -> None:
        if not self.enabled:
            return
        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record  # restored by the context's exit
        torch.cuda.set_sync_debug_mode("warn")

    def _record(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" not in str(message):
            return  # another warning (e.g. a deprecation) that "always" let through
        frames = [f for f in traceback.extract_stack()[:-1] if not _is_internal(f.filename)]
        sites = " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" for f in reversed(frames[-4:]))
        self.counts[sites] += 1

    def stop(self) -> None:
        if self._context is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._context.__exit__(None, None, None)
            self._context = None


class GcPauses:
    """Python's garbage collections between ``start`` and ``stop`` (``gc.callbacks``): count per generation and
    wall time. A full (generation 2) collection walks every tracked object of the process -- hundreds of thousands
    after importing torch, Megatron and Lightning -- and one falling into the timed steps of one variant only adds its
    pause to that variant's step time."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.gen2_ms: list[float] = []
        self.total_ms = 0.0
        self._began = 0.0

    def _record(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._began) * 1e3
        self.counts[info["generation"]] += 1
        self.total_ms += ms
        if info["generation"] == 2:
            self.gen2_ms.append(round(ms, 1))

    def start(self) -> None:
        if self._record not in gc.callbacks:
            gc.callbacks.append(self._record)

    def stop(self) -> None:
        if self._record in gc.callbacks:
            gc.callbacks.remove(self._record)

    def report(self) -> dict[str, Any]:
        return {"collections": self.counts, "ms": round(self.total_ms, 1), "gen2_ms": self.gen2_ms}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_FILES = (__file__, os.path.join(os.path.dirname(__file__), "throughput.py"))  # the timing code, not a call site


def _is_internal(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename in _OWN_FILES or filename.endswith("/warnings.py")
