"""``safe_open`` that records every lazy-slice read, for tests of what the HF loader reads from safetensors files.

Imported as ``safe_open_reads`` by tests/hf_worker.py (run as a script from tests/) and as ``tests.safe_open_reads``
by the tests; both copies wrap safetensors' own ``safe_open``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from safetensors import safe_open


class RecordingSafeOpen:
    """``safe_open`` recording ``(tensor name, index, shape)`` of every ``get_slice(name)[index]`` read."""

    reads: list[tuple[str, Any, tuple[int, ...]]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = safe_open(*args, **kwargs)

    def __enter__(self) -> RecordingSafeOpen:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, name: str) -> Any:
        inner = self.inner.get_slice(name)

        class Recorded:
            get_shape, get_dtype = inner.get_shape, inner.get_dtype

            def __getitem__(self, index: Any) -> torch.Tensor:
                tensor = inner[index]
                RecordingSafeOpen.reads.append((name, index, tuple(tensor.shape)))
                return tensor

        return Recorded()

    @classmethod
    def elements(cls) -> int:
        """The tensor elements read since ``reads`` was last emptied."""
        return sum(math.prod(shape) for _, _, shape in cls.reads)
