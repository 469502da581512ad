"""fp8 block-quantized HF checkpoints (DeepSeek-V3/R1, Kimi-K2 and other ``quant_method: fp8`` releases).

Such a checkpoint stores most linear weights as ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` per block of
``weight_block_size`` (rows x columns; the last block of a dimension may be partial): the weight is the fp8 value
times its block's scale. :func:`block_fp8` reads config.json's ``quantization_config`` (refusing every other
method or setting by name), :func:`check_scales` checks that exactly the fp8 weights have a scale of the right shape,
and :class:`DequantizedSlice` reads a row/column range of an fp8 weight as float32, reading the fp8 values and scales
of that range only -- a tensor-parallel rank never materialises the full-size weight in float. :func:`quantize` is
the inverse, for ``save_hf(weight_format="fp8_block")``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

FP8 = "F8_E4M3"
"""safetensors' name of ``torch.float8_e4m3fn``."""
SCALE_SUFFIX = "_scale_inv"
"""``<weight name><SCALE_SUFFIX>``: the weight's per-block scales (what multiplies the fp8 values back)."""
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn``: a block's largest magnitude is written as it."""
SCALE_DTYPES = ("F32", "BF16", "F16")
MXFP4_METHOD = "mxfp4"
"""``quant_method`` of MXFP4 checkpoints (GPT-OSS's experts), read by :mod:`lightning_megatron.gpt.hf.mxfp4`."""
# The settings read, each with the value it must have (absent: transformers' FineGrainedFP8Config default, which
# is the only value read). Another value changes what the tensors mean (e5m2 values, 1-byte ue8m0 scales, fp4
# experts, static activation scales) and is refused rather than half-read.
_REQUIRED = {"fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "float", "expert_dtype": "fp8"}


@dataclass(frozen=True)
class BlockFP8:
    """config.json's ``quantization_config`` of an fp8 block-quantized checkpoint."""

    block: tuple[int, int]
    """``weight_block_size``: rows x columns of the weight that share one scale."""
    not_converted: tuple[str, ...] = ()
    """``modules_to_not_convert``: modules whose weights stay in bf16/fp32 (transformers' patterns)."""

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The ``_scale_inv`` shape of a 2-D weight: one scale per block, partial last blocks included."""
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])

    def listed_unconverted(self, weight: str) -> str | None:
        """The ``modules_to_not_convert`` pattern that names ``weight``'s module, if any."""
        return unconverted_pattern(self.not_converted, weight)


def unconverted_pattern(patterns: tuple[str, ...], weight: str) -> str | None:
    """The pattern of ``patterns`` (a ``modules_to_not_convert``) that names ``weight``'s module, if any
    (transformers' rule: from the start to a module boundary, as a regex with that boundary, or as a suffix)."""
    module = weight.rpartition(".")[0]
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for pattern in patterns:
        try:
            re.compile(pattern)
            regex = pattern
        except re.error:  # not a regex: a literal name
            regex = re.escape(pattern)
        if re.match(rf"(?:{regex}){boundary}", module) or module.endswith(pattern):
            return pattern
    return None


def block_fp8(config: Mapping[str, Any]) -> BlockFP8 | None:
    """The fp8 block quantization config.json declares (None without ``quantization_config``, or with MXFP4's, which
    :mod:`lightning_megatron.gpt.hf.mxfp4` reads); ValueError naming the field and its value for any other method
    or setting."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"config.json's quantization_config is {q!r}, not a mapping of settings")
    method = q.get("quant_method")
    if method == MXFP4_METHOD:  # read by lightning_megatron.gpt.hf.mxfp4
        return None
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported: of quantized checkpoints only fp8 "
            "block-quantized ones (quant_method='fp8' with weight_block_size, as DeepSeek-V3 and Kimi-K2 ship) and "
            "GPT-OSS's MXFP4 experts (quant_method='mxfp4') are read. Use the model's unquantized "
            "float32/float16/bfloat16 weights"
        )
    for field, value in _REQUIRED.items():
        if q.get(field, value) != value:
            raise ValueError(
                f"quantization_config.{field}={q[field]!r} is not supported: fp8 block-quantized checkpoints are "
                f"read with {field}={value!r} only"
            )
    size = q.get("weight_block_size")
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(type(n) is int and n > 0 for n in size)):
        raise ValueError(
            f"quantization_config.weight_block_size={size!r} is not supported: fp8 checkpoints are read with one "
            "scale per block of [rows, columns] (e.g. [128, 128]); per-tensor or per-channel scales are not read"
        )
    skip = q.get("modules_to_not_convert", q.get("ignored_layers"))
    if skip is not None and not (isinstance(skip, list | tuple) and all(isinstance(s, str) for s in skip)):
        raise ValueError(f"quantization_config.modules_to_not_convert={skip!r} is not a list of module names")
    return BlockFP8(block=(size[0], size[1]), not_converted=tuple(skip or ()))


def check_scales(
    quantization: BlockFP8 | None, weights: Mapping[str, tuple[int, ...]], files: Mapping[str, str],
    lazy: Callable[[str], Any], path: Path,
) -> set[str]:  # fmt: skip
    """The scale tensors of the fp8 ``weights`` (name -> shape, all present in ``files``): every fp8 weight has
    one, of its block grid's shape, and no other weight has one. ``lazy``: a raw lazy slice by name (headers only
    are read). ValueError naming the tensor and its file otherwise."""
    scales: set[str] = set()
    if quantization is None:  # an fp8 weight is refused as not floating (load.check_floating), scales or not
        return scales
    for name, shape in weights.items():
        scale, where = name + SCALE_SUFFIX, path / files[name]
        if (dtype := lazy(name).get_dtype()) != FP8:
            if scale in files:
                raise ValueError(
                    f"{scale} in {path / files[scale]} scales {name}, which is {dtype}, not {FP8}: only fp8 weights "
                    "have scales"
                )
            continue
        if (pattern := quantization.listed_unconverted(name)) is not None:
            raise ValueError(
                f"{name} in {where} is {FP8}, but quantization_config.modules_to_not_convert lists {pattern!r} "
                "(its module stays unquantized): the files and config.json disagree"
            )
        if len(shape) != 2 or not name.endswith(".weight"):
            raise ValueError(f"{name} in {where} is {FP8}; only 2-D linear weights are read block-quantized")
        if scale not in files:
            raise ValueError(f"{name} in {where} is {FP8} but has no {scale}: its per-block scales are missing")
        scale_dtype, scale_shape = lazy(scale).get_dtype(), tuple(lazy(scale).get_shape())
        if scale_dtype not in SCALE_DTYPES or scale_shape != quantization.scale_shape(shape):
            raise ValueError(
                f"{scale} in {path / files[scale]} is {scale_dtype} {scale_shape}; {name} {shape} in blocks of "
                f"weight_block_size={list(quantization.block)} needs {quantization.scale_shape(shape)} in "
                f"{' / '.join(SCALE_DTYPES)}"
            )
        scales.add(scale)
    return scales


class DequantizedSlice:
    """An fp8 weight's lazy safetensors slice, read as float32: indexing it (``[:]``, ``[rows]``, ``[:, cols]``,
    ``[rows, cols]``; unit steps) reads the fp8 values of that range and the scales of the blocks it touches."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int]) -> None:
        self.weight, self.scale, self.block = weight, scale, block

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> Tensor:
        rows, cols = _ranges(index, self.get_shape())
        if not rows or not cols:
            return torch.empty(len(rows), len(cols))
        (b0, b1), first_row, first_col = self.block, rows.start // self.block[0], cols.start // self.block[1]
        scale = self.scale[first_row : -(-rows.stop // b0), first_col : -(-cols.stop // b1)].float()
        # Each block row's scales spread over this range's columns: [block rows, columns] (the scale grid's size
        # times a block's width, far smaller than the range).
        offset = cols.start - first_col * b1
        column_scales = scale.repeat_interleave(b1, dim=1)[:, offset : offset + len(cols)]
        fp8 = self.weight[rows.start : rows.stop, cols.start : cols.stop]  # the range's fp8 values only
        out = torch.empty(fp8.shape, dtype=torch.float32)
        for i, start in enumerate(range(first_row * b0, rows.stop, b0)):  # one block row at a time
            lo, hi = max(start, rows.start) - rows.start, min(start + b0, rows.stop) - rows.start
            out[lo:hi].copy_(fp8[lo:hi]).mul_(column_scales[i])
        return out


def _ranges(index: Any, shape: list[int]) -> tuple[range, range]:
    """The row and column ranges a 2-D slice index selects (unit-step slices only: what the loader reads)."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 2 or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
        raise TypeError(f"a block-quantized weight is read by unit-step row/column slices, not {index!r}")
    full = (*parts, slice(None))[:2]
    rows, cols = (range(*s.indices(n)) for s, n in zip(full, shape, strict=True))
    return rows, cols


def quantize(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a 2-D weight in blocks of ``block``: each block's largest magnitude
    becomes :data:`FP8_MAX` (scale_inv = amax / 448; fp8 = weight / scale_inv)."""
    (rows, cols), (b0, b1) = weight.shape, block
    grid = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.nn.functional.pad(weight.float(), (0, grid[1] * b1 - cols, 0, grid[0] * b0 - rows))
    blocks = padded.reshape(grid[0], b0, grid[1], b1)
    # An all-zero block keeps scale 1 (0 / 1 = 0) rather than dividing by zero.
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    fp8 = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8.reshape(padded.shape)[:rows, :cols].contiguous(), scale


def stored_sizes(
    shapes: Mapping[str, tuple[int, ...]], itemsize: int, fp8: set[str], block: tuple[int, int]
) -> dict[str, int]:
    """Bytes of each tensor a save writes, in file order: ``itemsize`` per element, but an ``fp8`` weight at one
    byte per element followed by its float32 scales."""
    sizes = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if name not in fp8:
            sizes[name] = (4 if name.endswith(KEEP_FP32) else itemsize) * numel
            continue
        sizes[name] = numel
        sizes[name + SCALE_SUFFIX] = 4 * math.prod(BlockFP8(block).scale_shape(shape))
    return sizes


KEEP_FP32 = ("e_score_correction_bias",)
"""Tensors written in float32 whatever the save's dtype: the router's correction bias, float32 in the HF checkpoints
and in transformers (it only ranks experts, by differences that bf16 would round away)."""


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(KEEP_FP32) else dtype


def stored(name: str, tensor: Tensor, dtype: torch.dtype, fp8: set[str], block: tuple[int, int]) -> list[Any]:
    """``[(name, tensor)]`` as a save writes it (on CPU, contiguous): in ``dtype`` (:data:`KEEP_FP32` in float32),
    or an ``fp8`` weight quantized with its scales after it."""
    tensor = tensor.detach().to("cpu")
    if name not in fp8:
        return [(name, tensor.to(stored_dtype(name, dtype)).contiguous())]
    weight, scale = quantize(tensor, block)
    return [(name, weight), (name + SCALE_SUFFIX, scale)]
