"""Checks that run before a sharded checkpoint is loaded, so that a bad file fails with a clear error on every rank
instead of deep inside a collective, and nothing in it can run code.

* :func:`read_metadata` reads torch DCP's ``.metadata`` (a pickle that torch itself loads with plain
  ``pickle.load``) with an unpickler that only builds DCP's metadata classes, sizes and dtypes.
* :func:`check_files` checks that every shard file the metadata names exists and is long enough (a truncated or
  deleted shard is named).
* :func:`check_shapes` compares the checkpoint's tensors (and the saved ``ModelConfig``) with the model's.
* :func:`weights_only` makes every ``torch.load`` inside Megatron/torch's loading ``weights_only=True`` (torch DCP
  unpickles non-tensor entries with ``weights_only=False``).
* :func:`check_loadable` runs at save time: an entry that this loading would refuse fails the save, not the resume.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.checkpointing.contained import inside
from lightning_megatron.training.averaging import KEY_PREFIX

# DCP metadata classes and what they hold; nothing else may be built from a .metadata file.
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_SAFE_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # A file-name prefix (one string) in the local plans Megatron keeps for reusing a cached save plan.
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)

# ModelConfig fields that decide which tensors exist and their shapes; others (dropout, recompute, RoPE base)
# may change between runs on purpose.
STRUCTURAL_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "vocab_size", "normalization", "add_bias_linear", "add_qkv_bias", "gated_linear_unit", "qk_layernorm",
    "share_embeddings_and_output_weights", "position_embedding_type", "num_moe_experts", "moe_ffn_hidden_size",
)  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(path: Path) -> Any:
    """torch DCP's ``Metadata`` of the checkpoint at ``path``, read without running arbitrary pickled code."""
    file = path / ".metadata"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: {path} is not a complete Megatron sharded checkpoint")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as error:  # truncated, tampered or foreign: any failure means "do not load"
        raise ValueError(f"{file} is damaged or was tampered with ({type(error).__name__}: {error})") from error
    if not hasattr(metadata, "storage_data") or not hasattr(metadata, "state_dict_metadata"):
        raise ValueError(f"{file} is not torch distributed-checkpoint metadata (got {type(metadata).__name__})")
    return metadata


def check_files(path: Path, metadata: Any) -> None:
    """Every shard file the metadata refers to lies inside ``path`` (:mod:`.contained`), exists and holds the bytes
    the metadata says it does."""
    needed: dict[str, int] = {}
    first: dict[str, str] = {}  # a tensor stored in each file, to name its entry
    for index, info in metadata.storage_data.items():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        first.setdefault(info.relative_path, index.fqn)
    for name, size in sorted(needed.items()):
        file = inside(path, name, f"{path / '.metadata'} (the storage entry of {first[name]})")
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: checkpoint {path} is incomplete; resume from another one")
        actual = file.stat().st_size
        if actual < size:
            raise ValueError(
                f"{file} is truncated ({actual} bytes, the checkpoint's metadata says at least {size}); "
                f"checkpoint {path} is damaged; resume from another one"
            )


def config_mismatch(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[str]:
    """``field: saved X, now Y`` for every structural ModelConfig field that differs."""
    if not saved or not current:
        return []
    fields = [*STRUCTURAL_FIELDS]
    if current.get("position_embedding_type") == "learned_absolute":
        fields.append("seq_length")  # the position table has seq_length rows
    return [f"{f}: saved {saved.get(f)!r}, now {current.get(f)!r}" for f in fields if saved.get(f) != current.get(f)]


def optimizer_split_error(path: Path, saved: int, wanted: int, optimizer: str) -> ValueError:
    """The error for a checkpoint whose optimizer state is split into another number of optimizers than this run's
    (MoE at another expert-parallel size) where Megatron builds the optimizer's state itself (:mod:`.optimizer_state`
    builds, and :mod:`.optimizer_split` resplits, that of the default distributed Adam only)."""
    return ValueError(
        f"checkpoint {path} holds the state of {saved} optimizer(s) and this run builds {wanted} (Megatron splits the "
        "dense and the expert parameters' optimizers when expert parallelism gives them other data-parallel groups), "
        f"and this run's optimizer ({optimizer}: precision-aware, hybrid-device or Megatron-FSDP) has its state built "
        "by Megatron, which does not load across that split. Resume at the expert-parallel size that wrote it, use "
        "the default distributed Adam, or start from its weights: YourModule.load_from_checkpoint(path), then "
        "trainer.fit without ckpt_path (a fresh optimizer)"
    )


def check_shapes(
    path: Path,
    metadata: Any,
    state: Mapping[str, Any],
    config_diff: list[str],
    optional: Mapping[str, Any] | None = None,
) -> None:
    """Raise ``ValueError`` naming the fields/tensors when the checkpoint holds a model of another shape: a tensor of
    ``state`` it lacks, or one of ``state`` or ``optional`` (e.g. the optimizer state, whose keys may be another
    expert-parallel split's: :mod:`.optimizer_split`) it holds with another shape."""
    saved = metadata.state_dict_metadata
    wrong, missing, seen = [], [], set()
    model = list(sharded_tensors(state))
    needed = {id(item) for item in model}
    for item in [*model, *sharded_tensors(optional or {})]:
        if item.key in seen:  # one tensor's several shards (SwiGLU's halves, a layer stack)
            continue
        seen.add(item.key)
        if item.key not in saved:
            if id(item) in needed:
                missing.append(item.key)
            continue
        size = getattr(saved[item.key], "size", None)  # None: stored as bytes, not as a tensor
        dtype = getattr(getattr(saved[item.key], "properties", None), "dtype", None)
        if size is None or tuple(size) != tuple(item.global_shape):
            shape = "bytes" if size is None else tuple(size)
            wrong.append(f"{item.key}: saved {shape}, expected {tuple(item.global_shape)}")
        elif dtype is not None and dtype.is_floating_point != item.dtype.is_floating_point:  # would be cast silently
            wrong.append(f"{item.key}: saved as {dtype}, expected {item.dtype}")
    if not (config_diff or wrong or missing):
        return
    parts = []
    if config_diff:
        parts.append("ModelConfig differs (" + "; ".join(config_diff) + ")")
    if wrong:
        parts.append(f"{len(wrong)} tensor(s) of another shape or kind, e.g. " + "; ".join(wrong[:3]))
    if missing:
        parts.append(f"{len(missing)} tensor(s) not in the checkpoint, e.g. " + ", ".join(missing[:3]))
    raise ValueError(
        f"checkpoint {path} holds a model of another shape: {'. '.join(parts)}. Resume with the ModelConfig it was "
        "saved with (parallel sizes may differ), or start a new run (to load the weights both hold into another "
        "model: YourModule.load_from_checkpoint(path, strict=False))"
    )


def sharded_tensors(state: Mapping[str, Any]) -> Iterator[Any]:
    """Every ``ShardedTensor`` a load of ``state`` reads: also those a ``ShardedTensorFactory`` builds (SwiGLU's
    ``linear_fc1`` is stored as two halves), whose shapes a plain walk over ``state`` would miss."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for item in nested_values(dict(state)):
        if isinstance(item, ShardedTensorFactory):
            yield from sharded_tensors({"built": item.build()})
        elif isinstance(item, ShardedTensor):
            yield item


def check_nothing_left_out(path: Path, metadata: Any, state: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if the checkpoint holds model tensors that ``state`` does not ask for."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    # A weight and its average stand for each other: either may be asked for (training.averaging).
    asked = {item.key.removeprefix(KEY_PREFIX) for item in nested_values(dict(state)) if isinstance(item, ShardedBase)}
    saved = (k for k in metadata.state_dict_metadata if not k.startswith(("optimizer.", "common_state", KEY_PREFIX)))
    if extra := sorted(k for k in saved if k not in asked):
        raise ValueError(
            f"checkpoint {path} holds {len(extra)} trained tensor(s) this module has no place for, e.g. "
            f"{', '.join(extra[:3])}; build it with the LoRAConfig it was saved with (load_from_checkpoint reads it)"
        )


@contextlib.contextmanager
def weights_only() -> Iterator[None]:
    """Force ``torch.load(weights_only=True)`` for the duration (torch reads this variable on every call)."""
    name = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    previous = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def check_loadable(state: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first entry of ``state`` that ``torch.load(weights_only=True)`` would refuse
    (e.g. a ``pathlib.Path`` hyper-parameter), so that a checkpoint which could never be resumed is not written."""
    for key, value in state.items():
        _check_entry(f"[{key!r}]", value)


def _check_entry(where: str, value: Any) -> None:
    if _round_trips(value):
        return
    children: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        children = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    for child_where, child in children:
        _check_entry(child_where, child)  # raises for the innermost entry that fails
    raise ValueError(
        f"checkpoint entry {where} is a {type(value).__module__}.{type(value).__qualname__}, which loading refuses "
        "(checkpoints are read with torch.load(weights_only=True): tensors, containers, numbers and strings); store "
        "it as one of those (e.g. str(path)), or allow the class with torch.serialization.add_safe_globals([...])"
    )


def _round_trips(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # unpicklable, or refused by the weights-only unpickler: either way not loadable
        return False
    return True
