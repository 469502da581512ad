"""MXFP4 HF checkpoints: GPT-OSS's releases (``quantization_config = {"quant_method": "mxfp4", ...}``).

Such a checkpoint stores each quantized weight ``W`` -- a layer's stacked experts, float layout ``[E, in, out]``
(``x @ W``) -- transposed and packed in blocks of :data:`BLOCK` values along ``in`` (OCP Microscaling, as
transformers' GPT-OSS reads it):

- ``<name>_blocks``: uint8 ``[E, out, in / 32, 16]``, 32 e2m1 (FP4) values per block, two per byte, the first of
  each pair in the low nibble;
- ``<name>_scales``: uint8 ``[E, out, in / 32]``, one e8m0 exponent per block.

A value is ``FP4 * 2 ** (scale - 127)``. :func:`mxfp4_config` reads config.json's ``quantization_config`` (refusing
every other setting by name), :func:`packed_weights` checks the blocks and scales against the float shapes the model
needs, and :class:`DequantizedExperts` reads an expert's row/column range of such a weight as float32, reading the
blocks and scales of that range only. :func:`quantize` is the inverse, for ``save_hf(weight_format="mxfp4")``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.gpt.hf.quantized import MXFP4_METHOD, unconverted_pattern

BLOCK = 32
"""Values per block (one scale each)."""
BLOCKS, SCALES = "_blocks", "_scales"
"""Suffixes of a quantized weight's two tensors: ``<name>_blocks`` and ``<name>_scales``."""
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""e2m1 by its 4-bit code: sign bit 8, then the magnitudes in order."""
NAN_SCALE = 255
"""e8m0's NaN: no finite block has it."""
DEFAULT_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
"""``modules_to_not_convert`` as GPT-OSS's releases list it: written for a model whose source was not MXFP4."""
# The settings quantization_config may have: the method, the unquantized modules, and transformers' load-time
# choice to dequantize (which changes nothing in the files). Any other changes what the tensors mean, or is unknown
# here: refused rather than half-read.
_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")
# e2m1 rounding, nearest value with ties to the even code: |x| above each midpoint (at it, for the midpoints whose
# upper neighbour is the even code) adds one to the code. Midpoints of 0|0.5, 0.5|1, 1|1.5, 1.5|2, 2|3, 3|4, 4|6.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_EMAX = 2
"""e2m1's largest exponent (6 = 1.5 * 2**2): a block's shared exponent is floor(log2(amax)) - 2 (OCP's rule)."""


@dataclass(frozen=True)
class MXFP4:
    """config.json's ``quantization_config`` of an MXFP4 checkpoint."""

    not_converted: tuple[str, ...] = ()
    """``modules_to_not_convert``: modules whose weights stay in bf16/fp32 (transformers' patterns)."""

    def listed_unconverted(self, weight: str) -> str | None:
        """The ``modules_to_not_convert`` pattern that names ``weight``'s module, if any."""
        return unconverted_pattern(self.not_converted, weight)

    def config_dict(self) -> dict[str, Any]:
        return {"quant_method": MXFP4_METHOD, "modules_to_not_convert": list(self.not_converted)}


def mxfp4_config(config: Mapping[str, Any]) -> MXFP4 | None:
    """The MXFP4 quantization config.json declares (None without one or for another method); ValueError naming the
    field and its value for a setting other than :data:`_FIELDS`."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != MXFP4_METHOD:
        return None
    for field, value in q.items():
        if field not in _FIELDS:
            raise ValueError(
                f"quantization_config.{field}={value!r} is not supported: MXFP4 checkpoints are read with "
                f"{', '.join(_FIELDS)} only (32-value blocks of e2m1 with an e8m0 scale, as GPT-OSS ships them)"
            )
    skip = q.get("modules_to_not_convert")
    if skip is not None and not (isinstance(skip, list | tuple) and all(isinstance(s, str) for s in skip)):
        raise ValueError(f"quantization_config.modules_to_not_convert={skip!r} is not a list of module names")
    return MXFP4(not_converted=tuple(skip or ()))


def packed_weights(
    quantization: MXFP4 | None, weights: Mapping[str, tuple[int, ...]], files: Mapping[str, str],
    lazy: Callable[[str], Any], path: Path, quantizable: tuple[str, ...],
) -> set[str]:  # fmt: skip
    """The names of ``weights`` (float name -> shape) stored as ``_blocks`` + ``_scales`` in ``files``, each checked:
    a weight ``quantizable`` names (suffixes: the family's) that ``modules_to_not_convert`` does not list, not also
    stored in float, with both tensors uint8 of the shapes its float shape implies. ``lazy``: a raw lazy slice by
    name (headers only are read). ValueError naming the tensor and its file otherwise."""
    packed: set[str] = set()
    if quantization is None:  # blocks without MXFP4's quantization_config are refused as unknown tensors
        return packed
    for name, shape in weights.items():
        blocks, scales = name + BLOCKS, name + SCALES
        if blocks not in files:
            continue
        where = path / files[blocks]
        if name in files:
            raise ValueError(
                f"{name} is in {path / files[name]} in float and in {where} as MXFP4 {blocks}: a weight is stored once"
            )
        if not name.endswith(quantizable) or len(shape) != 3:
            raise ValueError(f"{blocks} in {where}: only {' and '.join(quantizable)} weights are read in MXFP4")
        if (pattern := quantization.listed_unconverted(name)) is not None:
            raise ValueError(
                f"{blocks} in {where} is MXFP4, but quantization_config.modules_to_not_convert lists {pattern!r} (its "
                "module stays unquantized): the files and config.json disagree"
            )
        if scales not in files:
            raise ValueError(f"{blocks} in {where} has no {scales}: its per-block scales are missing")
        experts, rows, cols = shape
        if rows % BLOCK:
            raise ValueError(f"{name} {shape}: its {rows} input rows are not whole MXFP4 blocks of {BLOCK}")
        expected = {blocks: (experts, cols, rows // BLOCK, BLOCK // 2), scales: (experts, cols, rows // BLOCK)}
        for tensor, want in expected.items():
            dtype, got = lazy(tensor).get_dtype(), tuple(lazy(tensor).get_shape())
            if dtype != "U8" or got != want:
                raise ValueError(
                    f"{tensor} in {path / files[tensor]} is {dtype} {got}; {name} {shape} in MXFP4 needs U8 {want}"
                )
        packed.add(name)
    return packed


def dequantize(blocks: Tensor, scales: Tensor) -> Tensor:
    """Packed ``blocks [..., G, 16]`` and their ``scales [..., G]`` -> float32 values ``[..., G * 32]``."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32], low nibble first
    values = FP4_VALUES[codes]
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)


class DequantizedExperts:
    """An MXFP4 weight's ``_blocks`` and ``_scales`` lazy slices, read as the float32 ``[E, in, out]`` weight:
    indexing it (an expert or a unit-step expert slice, then unit-step row and column slices) reads, expert by
    expert, the blocks and scales that cover that range only."""

    def __init__(self, name: str, blocks: Any, scales: Any) -> None:
        self.name, self.blocks, self.scales = name, blocks, scales

    def get_shape(self) -> list[int]:
        experts, cols, groups, _ = self.blocks.get_shape()
        return [experts, groups * BLOCK, cols]

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> Tensor:
        experts, rows, cols, one = _ranges(index, self.get_shape())
        out = torch.empty(len(experts), len(rows), len(cols))
        for i, expert in enumerate(experts):
            out[i] = self._expert(expert, rows, cols)
        return out[0] if one else out

    def _expert(self, expert: int, rows: range, cols: range) -> Tensor:
        if not rows or not cols:
            return torch.empty(len(rows), len(cols))
        first, last = rows.start // BLOCK, -(-rows.stop // BLOCK)  # the blocks that cover the rows
        scales = self.scales[expert, cols.start : cols.stop, first:last]
        if (scales == NAN_SCALE).any():
            raise ValueError(f"{self.name}{SCALES} of expert {expert} holds e8m0 NaN scales ({NAN_SCALE})")
        values = dequantize(self.blocks[expert, cols.start : cols.stop, first:last], scales)  # [cols, blocks * 32]
        offset = rows.start - first * BLOCK
        return values[:, offset : offset + len(rows)].t()


def _ranges(index: Any, shape: list[int]) -> tuple[range, range, range, bool]:
    """The expert, row and column ranges a 3-D index selects, and whether the first was one expert (an int)."""
    parts = index if isinstance(index, tuple) else (index,)
    one = bool(parts) and isinstance(parts[0], int)
    if one:
        expert = parts[0] + shape[0] if parts[0] < 0 else parts[0]
        parts = (slice(expert, expert + 1), *parts[1:])
    if len(parts) > 3 or not all(isinstance(s, slice) and s.step in (None, 1) for s in parts):
        raise TypeError(f"an MXFP4 weight is read by an expert and unit-step row/column slices, not {index!r}")
    full = (*parts, slice(None), slice(None), slice(None))[:3]
    experts, rows, cols = (range(*s.indices(n)) for s, n in zip(full, shape, strict=True))
    return experts, rows, cols, one


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(blocks, scales)`` of a float ``[E, in, out]`` weight, expert by expert: each block's shared exponent is
    ``floor(log2(amax)) - 2`` (OCP's rule: the largest value lands in [4, 8) and saturates at 6), its values
    rounded to the nearest e2m1 with ties to even. Quantizing dequantized MXFP4 values gives them back exactly."""
    experts, rows, cols = weight.shape
    if rows % BLOCK:
        raise ValueError(f"an MXFP4 weight needs whole blocks of {BLOCK} input rows; this one has {rows}")
    blocks = torch.empty(experts, cols, rows // BLOCK, BLOCK // 2, dtype=torch.uint8)
    scales = torch.empty(experts, cols, rows // BLOCK, dtype=torch.uint8)
    for e in range(experts):  # one expert's float32 copy at a time
        groups = weight[e].detach().to("cpu", torch.float32).t().reshape(cols, rows // BLOCK, BLOCK)
        amax = groups.abs().amax(dim=-1)
        if not torch.isfinite(amax).all():
            raise ValueError(f"expert {e} of an MXFP4 weight holds inf or NaN: it has no MXFP4 form")
        exponent = torch.frexp(amax).exponent - 1 - _EMAX  # frexp: amax = m * 2**x, m in [0.5, 1)
        biased = torch.where(amax > 0, exponent + 127, 127).clamp(0, NAN_SCALE - 1)  # an all-zero block: 2**0
        scaled = torch.ldexp(groups, 127 - biased[..., None])
        magnitude = scaled.abs()
        codes = torch.zeros(scaled.shape, dtype=torch.uint8)
        for midpoint, tie_up in _MIDPOINTS:
            codes += (magnitude >= midpoint) if tie_up else (magnitude > midpoint)
        codes += 8 * torch.signbit(scaled).to(torch.uint8)
        blocks[e] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales[e] = biased.to(torch.uint8)
    return blocks, scales


def stored(name: str, weight: Tensor) -> list[tuple[str, Tensor]]:
    """``[(name_blocks, blocks), (name_scales, scales)]``: the weight as an MXFP4 checkpoint stores it."""
    blocks, scales = quantize(weight)
    return [(name + BLOCKS, blocks), (name + SCALES, scales)]


def stored_sizes(name: str, shape: tuple[int, ...]) -> dict[str, int]:
    """Bytes of the two tensors :func:`stored` writes for a weight of float ``shape``."""
    experts, rows, cols = shape
    return {name + BLOCKS: experts * cols * rows // 2, name + SCALES: experts * cols * rows // BLOCK}
