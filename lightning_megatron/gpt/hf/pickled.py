"""Opt-in reading of PyTorch pickle weights (``pytorch_model.bin``) for :meth:`MegatronLMModule.from_hf`.

Pickles can run code when loaded; they are read only when the user passes ``allow_pickle=True``, and then with
``torch.load(weights_only=True)``, which builds tensors and containers and refuses any other object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SUFFIXES = (".bin", ".pt", ".pth")
INDEX = "pytorch_model.bin.index.json"


def load(file: Path) -> dict[str, Tensor]:
    """A trusted-by-opt-in pickle: tensors and containers only (``weights_only``), memory-mapped."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ValueError(f"{file} cannot be read with torch.load(weights_only=True): {error}") from error


def files(path: Path) -> dict[str, str]:
    """Tensor name -> pickle file name in ``path`` (from the index, else by reading each file)."""
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    names: dict[str, str] = {}
    # Weight files only: an HF Trainer directory also holds training_args.bin, optimizer.pt, rng_state.pth, ...
    for file in sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.name.startswith("pytorch_model")):
        names.update(dict.fromkeys(load(file), file.name))
    return names


class Slice:
    """The part of safetensors' lazy slice API the loader uses, over a loaded tensor."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> Tensor:
        return self.tensor[index]
