"""Hugging Face in: read a local HF directory's config and, per rank, only the weight slices its chunks need.

:class:`HFCheckpoint` opens a directory (config.json and the safetensors headers only); :func:`open_pretrained`
turns it into a checked ``(HFCheckpoint, ModelConfig)`` pair, which is what every ``from_hf`` path builds on. When
the strategy builds a chunk, :func:`load_chunk` reads from the safetensors files only the slices of each tensor that
this rank's tensor-parallel shard and pipeline / virtual-pipeline layers need (``safe_open(...).get_slice``), so no
rank materialises the full model. An fp8 block-quantized checkpoint (``quantization_config`` with
``quant_method: fp8``) is read the same way, each slice dequantized as it is read (:mod:`.quantized`), and so are
GPT-OSS's MXFP4 experts (``quant_method: mxfp4``; :mod:`.mxfp4`): a rank reads the blocks of its own experts' rows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from lightning_megatron.checkpointing.contained import hf_roots, inside
from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.gpt.hf import mxfp4, pickled, quantized
from lightning_megatron.gpt.hf.fields import architecture, pretrained_config
from lightning_megatron.gpt.hf.mapping import adapter_params, chunk_params, expert_ranges, hf_weight_shapes
from lightning_megatron.gpt.hf.params import (
    SPLIT_DIM,
    Kind,
    Param,
    combine,
    expert_piece,
    piece_of,
    rank_block,
    stacked,
)
from lightning_megatron.gpt.hf.registry import family_of_hf
from lightning_megatron.gpt.lora.config import LoRAConfig, is_adapter_param

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
# Files of an HF model directory that save_pretrained carries over from the directory the model was loaded from.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip
# The dtypes a weight may have, in safetensors' names: an integer or quantized tensor (int8, fp8, ...) copied into a
# floating-point parameter would be cast silently, into weights that are wrong but train.
FLOATING = ("F32", "F16", "BF16")


def side_files(path: Path, config: dict[str, Any]) -> list[str]:
    """The files beside the weights that ``save_hf`` carries over: :data:`SIDE_FILES` and the remote code modules
    config.json's ``auto_map`` names (``configuration_deepseek.DeepseekV3Config`` -> ``configuration_deepseek.py``;
    Kimi-K2), as ``save_pretrained`` copies them; those present in ``path``. Copied, never imported or run here."""
    modules = []
    for value in (config.get("auto_map") or {}).values():
        for reference in value if isinstance(value, list) else [value]:
            if isinstance(reference, str) and "--" not in reference and "." in reference:  # "--": another repo's
                modules.append(reference.rpartition(".")[0] + ".py")
    names = [*SIDE_FILES, *dict.fromkeys(modules)]
    return [name for name in names if "/" not in name and (path / name).is_file()]


@dataclass(frozen=True)
class HFCheckpoint:
    """A local HF model directory: its config.json and which safetensors file holds each tensor."""

    path: Path
    """The directory."""
    config: dict[str, Any]
    """config.json as written."""
    files: dict[str, str]
    """Tensor name -> safetensors (or, opted in, PyTorch pickle) file name in ``path``."""

    allow_pickle: bool = False
    """Whether PyTorch pickle files among ``files`` may be read (opted in; ``torch.load(weights_only=True)``)."""

    @classmethod
    def open(cls, path: str | Path, allow_pickle: bool = False) -> HFCheckpoint:
        """Read config.json and the safetensors index (or the single file's header).

        Every file the directory names (config.json, an index's weight files, the side files ``save_hf`` copies)
        must lie inside it -- or, for a hub-cache snapshot, in its repository's blobs -- and is checked here once,
        so that later reads join names freely. Pickled weights (``.bin``, ``.pt``, ``.pth``, wherever they are
        named) are refused unless ``allow_pickle=True``; even then they are read with
        ``torch.load(weights_only=True)``, which builds tensors and containers only, never arbitrary objects.
        """
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json")
        roots = hf_roots(path)
        config = json.loads(inside(path, "config.json", "the model directory", roots).read_text())
        for side in side_files(path, config):
            inside(path, side, "the model directory", roots)
        if (path / SAFETENSORS_INDEX).is_file():
            files = index_files(path, SAFETENSORS_INDEX, roots)
        elif (path / SAFETENSORS_FILE).is_file():
            with open_safetensors(inside(path, SAFETENSORS_FILE, "the model directory", roots)) as f:
                files = dict.fromkeys(f.keys(), SAFETENSORS_FILE)
        else:
            files = _pickle_files(path, allow_pickle, roots)
        if not allow_pickle and (named := sorted({f for f in files.values() if f.endswith(pickled.SUFFIXES)})):
            raise ValueError(
                f"{path / SAFETENSORS_INDEX} names PyTorch pickle files ({', '.join(named[:3])}); only safetensors "
                "are read by default (pickles can run code when loaded). Pass allow_pickle=True for a trusted "
                "directory (read with torch.load(weights_only=True)), or convert it once with transformers"
            )
        quantized.block_fp8(config)  # an unsupported quantization_config is refused here, before any rank reads
        if mxfp4.mxfp4_config(config) is not None and not family_of_hf(architecture(config)).mxfp4_weights:
            raise ValueError(
                f"quantization_config.quant_method='mxfp4' in {path / 'config.json'}: MXFP4 weights are read for "
                f"GPT-OSS's experts only, not {architecture(config)}'s"
            )
        return cls(path=path, config=config, files=files, allow_pickle=allow_pickle)

    @functools.cached_property
    def quantization(self) -> quantized.BlockFP8 | None:
        """config.json's fp8 block quantization (None for float weights); ValueError for any other kind."""
        return quantized.block_fp8(self.config)

    @functools.cached_property
    def mxfp4(self) -> mxfp4.MXFP4 | None:
        """config.json's MXFP4 quantization (None for other checkpoints)."""
        return mxfp4.mxfp4_config(self.config)

    def mxfp4_weights(self) -> set[str]:
        """The (float) names of the weights stored as MXFP4 blocks and scales; none without MXFP4."""
        if self.mxfp4 is None:
            return set()
        return {n.removesuffix(mxfp4.BLOCKS) for n in self.files if n.endswith(mxfp4.BLOCKS)}

    def fp8_weights(self) -> set[str]:
        """The names of the weights stored block-quantized (fp8 with a scale); none without quantization_config."""
        if self.quantization is None:
            return set()
        with self.lazy_tensors(raw=True) as lazy:  # headers only
            scaled = [n for n in self.files if n + quantized.SCALE_SUFFIX in self.files]
            return {n for n in scaled if lazy(n).get_dtype() == quantized.FP8}

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError unless the files hold exactly the tensors ``config`` needs, with the right shapes (and,
        block-quantized, exactly the fp8 weights' scales; MXFP4, the blocks and scales of the packed weights)."""
        want = hf_weight_shapes(config, include_tied=False)
        quantizable = family_of_hf(architecture(self.config)).mxfp4_weights
        with self.lazy_tensors(raw=True) as lazy:  # headers only: nothing is read
            packed = mxfp4.packed_weights(self.mxfp4, want, self.files, lazy, self.path, quantizable)
            missing = [name for name in want if name not in self.files and name not in packed]
            if missing:
                where = SAFETENSORS_INDEX if (self.path / SAFETENSORS_INDEX).is_file() else SAFETENSORS_FILE
                raise ValueError(
                    f"{len(missing)} tensor(s) that {architecture(self.config)} with this config.json needs are "
                    f"missing from {self.path / where}: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                )
            stored = {name: shape for name, shape in want.items() if name not in packed}  # (packed: checked above)
            scales = quantized.check_scales(self.quantization, stored, self.files, lazy, self.path)
            for name, expected in stored.items():  # in model order: the first wrong tensor is the one reported
                tensor, where = lazy(name), self.path / self.files[name]
                if name + quantized.SCALE_SUFFIX not in scales:  # (an fp8 weight with its scale: checked above)
                    check_floating(name, tensor.get_dtype(), where)
                if (shape := tuple(tensor.get_shape())) != expected:
                    raise ValueError(f"{name} in {where} has shape {shape}, but config.json implies {expected}")
        self._check_explained(
            want.keys() | scales | {n + part for n in packed for part in (mxfp4.BLOCKS, mxfp4.SCALES)}
        )

    def _check_explained(self, expected: set[str]) -> None:
        """Raise ValueError if the files hold a tensor outside ``expected`` that the model does not skip."""
        # Tied checkpoints may still store lm_head; rotary caches are recomputed.
        skipped, hf = family_of_hf(architecture(self.config)).skipped, pretrained_config(self.config)
        extra = [
            n
            for n in self.files
            if n not in expected and n != "lm_head.weight" and not n.endswith("inv_freq")
            and not skipped(n, hf)
        ]  # fmt: skip
        if extra:
            raise ValueError(
                f"{self.path} has tensors this config.json does not explain: {', '.join(sorted(extra)[:4])}; "
                "is config.json from another model?"
            )

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of config.json and each weight file's name, size and first MiB (its header and the start of
        its tensors): the same for a copy of the model anywhere, another for other weights of the same shape.
        Read once (every checkpoint save and load of a LoRA module asks for it)."""
        digest = hashlib.sha256((self.path / "config.json").read_bytes())
        for file in sorted(set(self.files.values())):
            with open(self.path / file, "rb") as f:
                digest.update(f"{file}:{(self.path / file).stat().st_size}:".encode() + f.read(2**20))
        return digest.hexdigest()[:16]

    @contextmanager
    def lazy_tensors(self, raw: bool = False) -> Iterator[Callable[[str], Any]]:
        """``lazy(name)``: a tensor's lazy safetensors slice (index it to read); each file is opened once. An fp8
        weight of a block-quantized checkpoint, and an MXFP4 weight (by its float name), read as float32,
        dequantized slice by slice, unless ``raw``."""
        with ExitStack() as stack:
            handles: dict[str, tuple[Any, set[str]]] = {}  # file -> its handle, the names it holds

            def stored(name: str) -> Any:
                file = self.files[name]
                if file not in handles:
                    handles[file] = self._open_file(file, stack)
                handle, held = handles[file]
                if name not in held:
                    named_by = next((i for i in (SAFETENSORS_INDEX, pickled.INDEX) if (self.path / i).is_file()), None)
                    raise ValueError(
                        f"{named_by or self.path} maps {name} to {file}, which does not hold it (it holds {len(held)} "
                        f"tensors: {', '.join(sorted(held)[:4])}{' ...' if len(held) > 4 else ''}): the index and the "
                        "weight files are probably from different saves; fetch them again together"
                    )
                return pickled.Slice(handle[name]) if isinstance(handle, dict) else handle.get_slice(name)

            def lazy(name: str) -> Any:
                if not raw and self.mxfp4 is not None and name not in self.files and name + mxfp4.BLOCKS in self.files:
                    return mxfp4.DequantizedExperts(name, stored(name + mxfp4.BLOCKS), stored(name + mxfp4.SCALES))
                tensor = stored(name)
                if raw or self.quantization is None or tensor.get_dtype() != quantized.FP8:
                    return tensor
                if (scale := name + quantized.SCALE_SUFFIX) not in self.files:
                    raise ValueError(f"{name} in {self.path / self.files[name]} is fp8 but has no {scale}")
                return quantized.DequantizedSlice(tensor, stored(scale), self.quantization.block)

            yield lazy

    def _open_file(self, file: str, stack: ExitStack) -> tuple[Any, set[str]]:
        if not file.endswith(pickled.SUFFIXES):
            handle = stack.enter_context(open_safetensors(self.path / file))
            return handle, set(handle.keys())
        if not self.allow_pickle:  # open() refuses these already; this guards an HFCheckpoint built otherwise
            raise ValueError(f"{self.path / file} is a PyTorch pickle, read only with allow_pickle=True")
        tensors = pickled.load(self.path / file)
        return tensors, set(tensors)


def index_files(path: Path, index: str, roots: Sequence[Path]) -> dict[str, str]:
    """``index``'s ``weight_map`` (tensor name -> file name), every file it names checked: inside ``path`` (or
    ``roots``, see :func:`~lightning_megatron.checkpointing.contained.inside`) and there."""
    data = json.loads(inside(path, index, "the model directory", roots).read_text())
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path / index} has no weight_map (tensor name -> file name): is it an index of weights?")
    checked: set[str] = set()
    for tensor, file in weight_map.items():
        what = f"{index}'s weight_map entry for {tensor}"
        if not isinstance(file, str):
            raise ValueError(f"{what} is {file!r}, not a file name (e.g. 'model-00001-of-00002.safetensors')")
        if file not in checked and not inside(path, file, what, roots).is_file():
            raise ValueError(
                f"{what} names {file}, which is not a file in {path}: the download or copy is probably incomplete; "
                "fetch the missing file"
            )
        checked.add(file)
    return dict(weight_map)


def _pickle_files(path: Path, allow_pickle: bool, roots: Sequence[Path]) -> dict[str, str]:
    """Tensor name -> file of a directory of pickled weights, if opted in (no safetensors there)."""
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in pickled.SUFFIXES)
    if pickles and allow_pickle and (path / pickled.INDEX).is_file():
        return index_files(path, pickled.INDEX, roots)
    if pickles and allow_pickle:
        return pickled.files(path, roots)
    if pickles:
        raise ValueError(
            f"{path} holds PyTorch pickle weights ({', '.join(pickles[:3])}); only safetensors are read by "
            "default (pickles are read whole on every rank and can run code when loaded). Convert once with "
            "transformers: AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path), or pass "
            "allow_pickle=True for a trusted directory (read with torch.load(weights_only=True))"
        )
    raise FileNotFoundError(f"{path} has no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}")


def check_floating(name: str, dtype: str, file: Path) -> None:
    """Raise ValueError unless ``dtype`` (safetensors' name, e.g. "BF16") is one a weight may have."""
    if dtype == quantized.FP8:
        raise ValueError(
            f"{name} in {file} is {dtype} (fp8), but config.json has no quantization_config saying how it is scaled: "
            "fp8 weights are read only from block-quantized checkpoints (quant_method='fp8', weight_block_size, "
            "with each weight's _scale_inv)"
        )
    if dtype not in FLOATING:
        raise ValueError(
            f"{name} in {file} is {dtype}; only floating-point weights ({', '.join(FLOATING)} in safetensors' names) "
            "are read: an integer or quantized tensor (GPTQ, AWQ, bitsandbytes, FP8, ...) would be cast into wrong "
            "weights. Use the model's unquantized float32/float16/bfloat16 weights"
        )


def open_safetensors(file: Path) -> Any:
    """``safe_open(file)``; a truncated or damaged file raises ``ValueError`` naming it (safetensors' own error only
    names the header)."""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as error:
        size = file.stat().st_size if file.is_file() else 0
        raise ValueError(
            f"{file} is incomplete or damaged ({size} bytes; safetensors: {error}): a download or copy was probably "
            "cut short; fetch that file again"
        ) from error


def load_chunk(chunk: nn.Module, checkpoint: HFCheckpoint, config: ModelConfig, vp_stage: int | None) -> None:
    """Copy this rank's shard of the HF tensors into a freshly built ``GPTModel`` chunk (lazy slice reads)."""
    from megatron.core import parallel_state as ps

    experts = expert_ranges(config, ps.get_expert_model_parallel_world_size())[ps.get_expert_model_parallel_rank()]
    layers = _layers(chunk, vp_stage)
    params = chunk_params(config, pre=chunk.pre_process, post=chunk.post_process, **layers, experts=experts)
    # LoRA adapters are not HF weights: they start from their own seeded init (lightning_megatron.gpt.lora).
    own = {name: p for name, p in chunk.named_parameters() if not is_adapter_param(name)}
    # Buffers an HF tensor maps to (DeepSeek-V3's router bias) are loaded too; the others are computed.
    mapped = {p.megatron for p in params}
    own.update({name: b for name, b in chunk.named_buffers() if name in mapped})
    unmapped = sorted(set(own) - {p.megatron for p in params})
    if unmapped:  # a parameter left at its random init would silently break parity
        raise RuntimeError(f"no HF tensor maps to {unmapped}; the HF mapping does not cover this model")
    _copy_shards(own, params, checkpoint, config)


def load_adapter_chunk(
    chunk: nn.Module, adapter: HFCheckpoint, config: ModelConfig, lora: LoRAConfig, vp_stage: int | None
) -> None:
    """Copy this rank's shard of a PEFT adapter's tensors into the chunk's LoRA factors (every one of them)."""
    from megatron.core import parallel_state as ps

    experts = expert_ranges(config, ps.get_expert_model_parallel_world_size())[ps.get_expert_model_parallel_rank()]
    params = []
    for p in adapter_params(config, lora, **_layers(chunk, vp_stage)):
        if p.expert is None or experts is None:
            params.append(p)
        elif p.expert in experts:  # this expert-parallel rank's experts, by local index
            params.append(dataclasses.replace(p, expert=p.expert - experts.start))
    own = {name: p for name, p in chunk.named_parameters() if is_adapter_param(name)}
    assert set(own) == {p.megatron for p in params}, sorted(set(own) ^ {p.megatron for p in params})
    _copy_shards(own, params, adapter, config)


def _layers(chunk: nn.Module, vp_stage: int | None) -> dict[str, int]:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return {"offset": get_transformer_layer_offset(chunk.config, vp_stage), "num_layers": len(chunk.decoder.layers)}


def _copy_shards(own: dict[str, Tensor], params: list[Param], checkpoint: HFCheckpoint, config: ModelConfig) -> None:
    from megatron.core import parallel_state

    dense = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    # Experts are split over the expert-tensor-parallel group (Megatron's default: as large as TP).
    expert = parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    with checkpoint.lazy_tensors() as lazy, torch.no_grad():
        pieces = ExpertPieces(lazy, config.num_moe_experts or 1)
        for p in params:
            rank, tp = dense if p.expert is None else expert
            local = read_local(p, lazy, pieces, rank, tp, config)
            target = own[p.megatron] if p.expert is None else own[p.megatron][p.expert]
            if local.shape != target.shape:
                raise ValueError(f"{[n for n, _ in p.hf]} make {p.megatron} {tuple(local.shape)}, not {target.shape}")
            target.copy_(local)


def read_local(
    p: Param, lazy: Callable[[str], Any], pieces: ExpertPieces, rank: int, tp: int, c: ModelConfig
) -> Tensor:
    """This tensor-parallel rank's local tensor of ``p`` (of ``tp``), from the lazy slices of its HF tensors."""
    read = [pieces.read(name, p.kind, rank, tp) if pieces.is_piece(name)
            else read_shard(lazy(name), p.kind, rank, tp) for name, _ in p.hf]  # fmt: skip
    return combine(p, read, c, tp)


class ExpertPieces:
    """One expert's piece of a tensor on fused experts: a rank's block of GPT-OSS's expert weight (read alone: that
    expert's rows of an MXFP4 weight's blocks, never all experts dequantized), or PEFT's factor (its tensor read
    once, whole: adapters are small and interleave the experts)."""

    def __init__(self, lazy: Callable[[str], Any], num_experts: int) -> None:
        self.lazy, self.num_experts = lazy, num_experts
        self.read_tensors: dict[str, Tensor] = {}

    @staticmethod
    def is_piece(name: str) -> bool:
        return expert_piece(name)[1] is not None

    def read(self, name: str, kind: Kind, rank: int, tp: int) -> Tensor:
        whole, expert = expert_piece(name)
        assert expert is not None
        if stacked(whole):
            return read_shard(ExpertSlice(self.lazy(whole), expert), kind, rank, tp)
        if whole not in self.read_tensors:
            self.read_tensors = {whole: self.lazy(whole)[:]}  # pieces of one tensor come one after another
        return rank_block(kind, piece_of(whole, self.read_tensors[whole], expert, self.num_experts), rank, tp)


class ExpertSlice:
    """Expert ``expert`` of a lazy slice of stacked experts ``[E, ...]``, as a lazy slice of ``[...]``."""

    def __init__(self, lazy: Any, expert: int) -> None:
        self.lazy, self.expert = lazy, expert

    def get_shape(self) -> list[int]:
        return list(self.lazy.get_shape())[1:]

    def __getitem__(self, index: Any) -> Tensor:
        return self.lazy[(self.expert, *(index if isinstance(index, tuple) else (index,)))]


def read_shard(lazy: Any, kind: Kind, rank: int, tp: int) -> Tensor:
    """Read only rank's block of a tensor of ``kind``: its contiguous 1/tp along the kind's split dimension (all of
    it for a replicated kind; a "halves" tensor is read whole, then cut)."""
    dim = SPLIT_DIM[kind]
    if kind == "halves":
        return rank_block(kind, lazy[:], rank, tp)
    if dim is None:
        return lazy[:]
    size = lazy.get_shape()[dim] // tp
    block = slice(rank * size, (rank + 1) * size)
    return lazy[block] if dim == 0 else lazy[:, block]


def open_pretrained(
    path: str | Path, *, seq_length: int | None = None, config_overrides: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> tuple[HFCheckpoint, ModelConfig]:  # fmt: skip
    """The HF directory at ``path`` and the :class:`~lightning_megatron.ModelConfig` of its model, checked against
    each other (names and shapes) before any process starts. Every ``from_hf`` constructor starts here.

    Args:
        path: the model directory (config.json + safetensors).
        seq_length: longest sequence to train on; default ``max_position_embeddings`` (capped by a sliding window).
        config_overrides: other ``ModelConfig`` fields to change (dropout, recompute, ...); architecture fields
            must keep matching the weights.
        allow_pickle: read PyTorch pickle weights when there are no safetensors (see :meth:`HFCheckpoint.open`).
    """
    checkpoint = HFCheckpoint.open(path, allow_pickle=allow_pickle)
    config = ModelConfig.from_hf(checkpoint.config, seq_length=seq_length, **(config_overrides or {}))
    checkpoint.check(config)
    return checkpoint, config
