"""A checkpoint directory received from elsewhere: it cannot make a load read a file outside itself, switch its
integrity checks off by deleting or planting a file, or hide a tensor of another size behind an opaque error.

Every case tampers with a copy of one shared checkpoint (``saved`` in ``tests/conftest.py``) and, where its metadata
must name the tampering, forges the metadata checksums too: checksums catch damage, not forgery, so what is tested
is the check itself. (The HF side: ``tests/test_hf_untrusted.py``.)
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule
from lightning_megatron.checkpointing import opening
from lightning_megatron.checkpointing.integrity import checks, checksums
from tests.conftest import flip_bit, recording_opens
from tests.tiny_gpt_runs import DATA, tiny_model, tiny_trainer


def _copy(saved: dict[str, Path], tmp_path: Path, which: str = "full") -> Path:
    path = tmp_path / "received" / f"{which}.ckpt"
    shutil.copytree(saved[which], path)
    return path


def _resume(path: Path) -> None:
    tiny_trainer(3).fit(tiny_model(), DataLoader(DATA, batch_size=8), ckpt_path=str(path))


def _validate(path: Path) -> None:
    tiny_trainer().validate(
        MegatronLMModule.load_from_checkpoint(path), DataLoader(DATA[:8], batch_size=8), verbose=False
    )


def _rewrite_metadata(path: Path, change: object) -> None:
    """Apply ``change(metadata)`` to the checkpoint's ``.metadata``, with forged metadata checksums."""
    metadata = checks.read_metadata(path)
    change(metadata)  # type: ignore[operator]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    checksums.record_metadata(path)


# ---------------------------------------------------------------------------------------------- containment
@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_storage_entry_naming_a_file_outside_the_checkpoint_is_refused(
    saved: dict, tmp_path: Path, where: str
) -> None:
    path = _copy(saved, tmp_path)
    outside = tmp_path / "elsewhere.distcp"  # a copy of the real shard: read, it would load without an error
    shutil.copy(path / "__0_0.distcp", outside)
    name = str(outside) if where == "absolute" else "../../elsewhere.distcp"

    def point_outside(metadata: object) -> None:
        for info in metadata.storage_data.values():  # type: ignore[attr-defined]
            info.relative_path = name

    _rewrite_metadata(path, point_outside)
    refused = r"\.metadata \(the storage entry of .*\) names the file '.*elsewhere"
    for load in (_resume, MegatronLMModule.load_from_checkpoint):
        with recording_opens() as opened, pytest.raises(ValueError, match=refused):
            load(path)
        assert opened  # the checkpoint's own files were opened (.metadata, metadata.json, ...): the hook works
        assert not [name for name in opened if "elsewhere" in name]  # the file outside never was


@pytest.mark.parametrize("name", ["__0_0.distcp", "metadata.json", "checksums_0.json"])
def test_a_symlink_leaving_the_checkpoint_is_refused(saved: dict, tmp_path: Path, name: str) -> None:
    path = _copy(saved, tmp_path)
    outside = tmp_path / f"elsewhere-{name}"
    (path / name).rename(outside)  # the same bytes, reached through a link that leaves the directory
    (path / name).symlink_to(outside)
    with pytest.raises(ValueError, match=rf"names {path / name}, a symlink that leads to {outside}, outside {path}"):
        MegatronLMModule.load_from_checkpoint(path)
    # A link inside the directory is the directory's own business (ModelCheckpoint(save_last="link") makes those).
    (path / name).unlink()
    (path / f"real-{name}").write_bytes(outside.read_bytes())
    (path / name).symlink_to(path / f"real-{name}")
    MegatronLMModule.load_from_checkpoint(path)


# ---------------------------------------------------------------------------------------------- integrity
def test_a_removed_checksum_table_does_not_switch_verification_off(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    flip_bit(path, "decoder.layers.mlp.linear_fc1.weight")
    (path / "checksums_0.json").unlink()  # metadata_checksums.json says the checkpoint had checksums
    for load in (_resume, _validate):
        with pytest.raises(ValueError, match=r"__0_0\.distcp has no recorded checksums: checkpoint .* is damaged"):
            load(path)


def test_every_checksum_file_removed_is_refused(saved: dict, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    flip_bit(path, "decoder.layers.mlp.linear_fc1.weight")
    (path / "metadata_checksums.json").unlink()  # the shards' tables alone still prove there were checksums
    with pytest.raises(ValueError, match=r"metadata_checksums\.json is missing while the shards .* have checksums"):
        MegatronLMModule.load_from_checkpoint(path)
    for table in path.glob("checksums_*.json"):  # every trace on disk gone: the common state still says so
        table.unlink()
    for load in (_resume, MegatronLMModule.load_from_checkpoint):
        with pytest.raises(ValueError, match=r"was saved with checksums \(crc32 .*\) and its checksum files .* gone"):
            load(path)


def test_a_checkpoint_without_any_checksums_loads_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As one written by another tool or an older version: nothing says it had checksums."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.tiny_gpt_runs import tiny_fit

    monkeypatch.setattr(checksums, "SCHEME", None)  # what a checkpoint saved without the marker holds
    tiny_fit(1, ModelCheckpoint(dirpath=tmp_path, filename="old", every_n_train_steps=1))
    path = tmp_path / "old.ckpt"
    for table in [path / "metadata_checksums.json", *path.glob("checksums_*.json")]:
        table.unlink()
    with pytest.warns(UserWarning, match=r"old\.ckpt has no checksums \(written by another tool or version\)"):
        _validate(path)


def test_a_planted_common_pt_is_refused(saved: dict, tmp_path: Path) -> None:
    """Megatron reads a legacy ``common.pt`` instead of the common state stored (and checksummed) in the shards."""
    path = _copy(saved, tmp_path)
    common = opening.read_common_state(path)
    common["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] = 0  # re-train seen samples
    torch.save(common, path / "common.pt")
    for load in (_resume, MegatronLMModule.load_from_checkpoint):
        with pytest.raises(ValueError, match=r"common\.pt does not belong to checkpoint .*: its common state"):
            load(path)


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    "key", ["decoder.layers.mlp.linear_fc1.weight", "optimizer.state.exp_avg.output_layer.weight"],
    ids=["swiglu-factory", "optimizer"],
)  # fmt: skip
def test_a_size_bomb_in_the_metadata_is_named(saved: dict, tmp_path: Path, key: str) -> None:
    """A tensor the metadata claims to hold 10^12 elements: refused before anything is read or allocated, naming the
    tensor with its saved and expected shapes (also SwiGLU's two-halves factory entries and the optimizer state)."""
    path = _copy(saved, tmp_path)

    def inflate(metadata: object) -> None:
        metadata.state_dict_metadata[key].size = torch.Size([10**6, 10**6])  # type: ignore[attr-defined]

    _rewrite_metadata(path, inflate)
    expected = r"holds a model of another shape: 1 tensor\(s\) of another shape or kind, e.g. "
    with pytest.raises(ValueError, match=expected + rf"{key}: saved \(1000000, 1000000\), expected \("):
        _resume(path)


def test_an_integer_tensor_in_place_of_a_weight_is_named(saved: dict, tmp_path: Path) -> None:
    """Metadata that stores a weight as int32: torch's reader would cast it into the float parameter without a word."""
    path = _copy(saved, tmp_path)
    key = "output_layer.weight"

    def as_integers(metadata: object) -> None:
        metadata.state_dict_metadata[key].properties.dtype = torch.int32  # type: ignore[attr-defined]

    _rewrite_metadata(path, as_integers)
    with pytest.raises(ValueError, match=rf"{key}: saved as torch.int32, expected torch.float32"):
        _validate(path)
