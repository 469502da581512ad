"""Which kernels build the layers: ``ModelConfig.kernels`` ("auto", "torch", "te", "local") resolved for a device."""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

Kernels = Literal["auto", "torch", "te", "local"]
Resolved = Literal["torch", "te", "local"]


@functools.cache
def te_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (it needs a CUDA toolchain to install)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken install (missing CUDA libraries) counts as absent
        return False
    return True


def resolve(kernels: Kernels, device_type: str, cp: int = 1) -> Resolved:
    """The concrete kernel set for ``kernels`` on ``device_type`` ("cuda" or "cpu") and context-parallel size ``cp``.

    ``"auto"``: Transformer Engine's spec when it imports, else the torch-native fast path, on GPU; Megatron's
    reference local spec on CPU, where compiled kernels buy nothing and only cost compile time -- except under
    context parallelism, which the reference attention cannot split (the torch-native path then, on CPU too).
    """
    if kernels == "auto":
        if device_type != "cuda":
            return "torch" if cp > 1 else "local"
        return "te" if te_available() else "torch"
    if kernels == "te":
        if not te_available():
            raise ValueError(
                "ModelConfig(kernels='te') needs Transformer Engine (`import transformer_engine.pytorch` failed); "
                "use kernels='torch' (torch-native fast path) or 'auto'"
            )
        if device_type != "cuda":
            raise ValueError("ModelConfig(kernels='te') runs on GPUs only; use kernels='torch' or 'local' on CPU")
    return kernels


_DESCRIPTIONS = {
    "torch": "torch (SDPA attention with RoPE inside, fused vocab-parallel cross entropy)",
    "local": "local (Megatron's reference torch spec: unfused attention; the default on CPU)",
    "te": "te (Transformer Engine)",
}


def describe(kernels: Resolved) -> str:
    """One line naming a resolved kernel set, and whether Transformer Engine is there (printed once per run)."""
    return f"kernels: {_DESCRIPTIONS[kernels]}" + ("" if te_available() else "; Transformer Engine not installed")
