"""Opening a sharded checkpoint for reading: every load starts with :func:`open_checkpoint`, then
:func:`read_common`, before anything is read collectively.

What a checkpoint directory received from elsewhere can and cannot do here:

* name a file outside itself -- an absolute or ``..`` storage entry in ``.metadata``, a symlink leading out: refused,
  naming the entry (:mod:`.contained`);
* run code -- ``.metadata`` is unpickled with an allow-list of DCP's classes, everything else weights-only
  (:mod:`.checks`);
* switch its integrity checks off by deleting files -- a checkpoint that was checksummed (its
  ``metadata_checksums.json``, any ``checksums_<rank>.json``, or the marker in its common state) needs all its
  tables; a legacy ``common.pt``, which Megatron would read instead of the common state stored in the shards, is
  refused beside one. Only a checkpoint with no trace of checksums at all loads unverified, with a warning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron.checkpointing.contained import inside
from lightning_megatron.checkpointing.integrity import checks, checksums
from lightning_megatron.checkpointing.save.saving import PARTIAL_SUFFIX

CHECKSUMS_KEY = "megatron_checksums"
"""Common-state entry of a checkpoint whose files have checksums (:mod:`.checksums`): their scheme."""
_LEGACY_COMMON = "common.pt"  # Megatron's older place for the common state; it prefers it when present
_OWN_FILES = (".metadata", "metadata.json", checksums.METADATA_TABLE, _LEGACY_COMMON)


def open_checkpoint(path: Path) -> Any:
    """Check that ``path`` is a complete checkpoint MegatronStrategy wrote, with intact metadata that runs no code,
    every file it names inside it and present; return its torch DCP metadata (nothing else is read)."""
    _check_is_checkpoint(path)
    for name in [*_OWN_FILES, *(table.name for table in checksums.tables(path))]:
        if (path / name).exists() or (path / name).is_symlink():
            inside(path, name, f"checkpoint {path}'s {name}")
    checksums.verify_metadata(path)
    marker = path / "metadata.json"
    try:
        json.loads(marker.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{marker} is damaged (not valid JSON: {error}); checkpoint {path} cannot be read") from error
    metadata = checks.read_metadata(path)
    checks.check_files(path, metadata)
    _check_no_legacy_common(path, metadata)
    return metadata


def _check_is_checkpoint(path: Path) -> None:
    if path.name.endswith(PARTIAL_SUFFIX):
        final = path.with_name(path.name.removesuffix(PARTIAL_SUFFIX))
        raise ValueError(f"{path} is an unfinished save (a run stopped while writing it); load {final} or an older one")
    if path.is_file():
        raise ValueError(
            f"{path} is a file (a plain Lightning/torch.save checkpoint), not one MegatronStrategy wrote: those are "
            "directories (ModelCheckpoint's epoch=...-step=....ckpt/ or last.ckpt/, written by every rank). Pass "
            "such a directory; a plain LightningModule's file loads with that module's class and strategy"
        )
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete Megatron sharded checkpoint (no metadata.json); checkpoints written by "
            "MegatronStrategy are directories holding metadata.json, .metadata and *.distcp shard files"
        )


def _check_no_legacy_common(path: Path, metadata: Any) -> None:
    """A ``common.pt`` beside a common state stored in the shards (or beside checksums) was not written with the
    checkpoint, and Megatron would read it instead of the verified common state."""
    legacy = path / _LEGACY_COMMON
    if not (legacy.exists() or legacy.is_symlink()):
        return
    in_shards = any(index.fqn.startswith("common_state") for index in metadata.storage_data)
    if in_shards or checksums.read(path) is not None:
        raise ValueError(
            f"{legacy} does not belong to checkpoint {path}: its common state (loops, callbacks, hyper-parameters) is "
            "stored in its shards and covered by its checksums, and Megatron would read common.pt instead. It was "
            "placed there after the save; remove it, or resume from another checkpoint"
        )


def read_common_state(path: str | Path) -> dict[str, Any]:
    """The checkpoint's non-tensor entries (Lightning's dict, the ModelConfig, ...), unpickled ``weights_only``,
    after :func:`open_checkpoint`'s checks and the common state's checksums."""
    path = Path(path)
    return read_common(path, open_checkpoint(path))


def read_common(path: Path, metadata: Any) -> dict[str, Any]:
    """The common state of the checkpoint :func:`open_checkpoint` opened, its checksums verified first (a checkpoint
    whose common state says it had checksums, and has none left, is refused; one without any loads with a warning)."""
    from megatron.core import dist_checkpointing

    recorded = checksums.read(path)
    common_items = [index for index in metadata.storage_data if index.fqn.startswith("common_state")]
    checksums.verify(path, metadata, items=common_items, recorded=recorded)
    try:
        with checks.weights_only():
            common = dist_checkpointing.load_common_state_dict(str(path))
    except (Exception, CheckpointException) as error:
        raise ValueError(
            f"the common state of checkpoint {path} cannot be read safely ({type(error).__name__}: {error}); only "
            "tensors, containers and numbers are unpickled; is the checkpoint damaged or from an untrusted source?"
        ) from error
    if recorded is None and common.get(CHECKSUMS_KEY):
        raise ValueError(
            f"checkpoint {path} was saved with checksums ({common[CHECKSUMS_KEY]}) and its checksum files "
            "(checksums_<rank>.json, metadata_checksums.json) are gone: it cannot be verified. Restore them with the "
            "checkpoint from its copy, or resume from another checkpoint"
        )
    if recorded is None:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"checkpoint {path} has no checksums (written by another tool or version): loaded unverified")
    return common
