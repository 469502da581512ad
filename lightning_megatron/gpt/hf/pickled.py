"""Opt-in reading of PyTorch pickle weights (``pytorch_model.bin``) for :meth:`MegatronLMModule.from_hf`.

Pickles can run code when loaded; they are read only when the user passes ``allow_pickle=True``, and then with
``torch.load(weights_only=True)``, which builds tensors and containers and refuses any other object.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.checkpointing.contained import inside

SUFFIXES = (".bin", ".pt", ".pth")
INDEX = "pytorch_model.bin.index.json"
# safetensors' names of the floating-point dtypes (what a lazy slice's get_dtype() says).
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def load(file: Path) -> dict[str, Tensor]:
    """A trusted-by-opt-in pickle: tensors and containers only (``weights_only``), memory-mapped."""
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ValueError(f"{file} cannot be read with torch.load(weights_only=True): {error}") from error
    if not isinstance(loaded, dict) or not all(isinstance(t, Tensor) for t in loaded.values()):
        raise ValueError(f"{file} holds a {type(loaded).__name__}, not a state dict (tensor name -> tensor)")
    return loaded


def files(path: Path, roots: Sequence[Path]) -> dict[str, str]:
    """Tensor name -> pickle file name in ``path`` (a directory without an index), by reading each file; each must
    lie inside ``path`` or ``roots``."""
    names: dict[str, str] = {}
    # Weight files only: an HF Trainer directory also holds training_args.bin, optimizer.pt, rng_state.pth, ...
    for file in sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.name.startswith("pytorch_model")):
        names.update(dict.fromkeys(load(inside(path, file.name, "the model directory", roots)), file.name))
    return names


class Slice:
    """The part of safetensors' lazy slice API the loader uses, over a loaded tensor."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return _DTYPE_NAMES.get(self.tensor.dtype, str(self.tensor.dtype).removeprefix("torch."))

    def __getitem__(self, index: Any) -> Tensor:
        return self.tensor[index]
