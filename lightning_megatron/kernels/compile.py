"""torch.compile for the torch-native kernels: compiled on GPU (one fused kernel per function), eager elsewhere."""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _compiled(fn: Any) -> Any:
    # Default dynamic-shape handling: static for the first shape, one dynamic recompile when shapes vary
    # (predict/log-probs over variable lengths), instead of a compile per shape up to dynamo's limit.
    return torch.compile(fn)


def for_device(fn: Any, device: torch.device) -> Any:
    """``fn`` compiled once for CUDA devices (no float32 copies of big inputs, no chain of elementwise kernels);
    ``fn`` itself on CPU, where compiling costs more than it saves."""
    return _compiled(fn) if device.type == "cuda" else fn
