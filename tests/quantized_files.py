"""Quantized HF checkpoints written by the tests that quantize a float model themselves (MXFP4 GPT-OSS, block-fp8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_quantized(
    source: Path,
    path: Path,
    files: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization: dict[str, Any],
    reference: dict[str, torch.Tensor],
) -> tuple[Path, Path]:
    """``files`` as the two shards of a checkpoint at ``path`` (named by an index), with ``source``'s config plus
    ``quantization_config``; and the reference beside it (``<name>_dequantized``): ``source`` with ``reference`` as
    its weights. Returns both paths."""
    path.mkdir()
    shards = {"model-00001-of-00002.safetensors": files[0], "model-00002-of-00002.safetensors": files[1]}
    for file, part in shards.items():
        save_file(part, path / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    ref = path.with_name(path.name + "_dequantized")
    shutil.copytree(source, ref)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    return path, ref
