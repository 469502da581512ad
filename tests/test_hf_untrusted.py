"""A Hugging Face or PEFT directory from elsewhere: what its files may name and hold, checked before anything is built.

Each case is a tiny model directory tampered with one way: an index entry or a symlink that leads out of the
directory, a pickle named where only safetensors are read, an integer tensor, an index that maps a tensor to the
wrong shard; and an export into a directory with planted symlinks. Each asserts the named error (or that the link was
replaced) and that the files outside the directory, which a load would read or an export overwrite, are untouched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_megatron import LoRAConfig, MegatronLMModule, MegatronStrategy
from lightning_megatron.gpt.hf.load import HFCheckpoint, open_pretrained
from lightning_megatron.gpt.hf.peft import open_adapter
from tests.conftest import Payload
from tests.hf_dense_models import make_hf_model, make_peft_adapter

NAME = "model.layers.0.mlp.up_proj.weight"
SEQ = 16


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("source") / "hf")


@pytest.fixture
def hf(source: Path, tmp_path: Path) -> Path:
    """A fresh copy of the model to tamper with."""
    return Path(shutil.copytree(source, tmp_path / "hf"))


@pytest.fixture
def elsewhere(source: Path, tmp_path: Path) -> Path:
    """Outside the model directory: a valid weights file (so a load that followed a name there would succeed)."""
    (tmp_path / "elsewhere").mkdir()
    return Path(shutil.copy(source / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors"))


def _index(hf: Path, weight_map: dict[str, str]) -> None:
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _shard(hf: Path) -> dict[str, str]:
    """Split hf's weights into layer 0's and the rest's shards with an index; its weight map."""
    tensors = load_file(hf / "model.safetensors")
    first = {n: t for n, t in tensors.items() if n.startswith("model.layers.0.")}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": {
        n: t for n, t in tensors.items() if n not in first}}  # fmt: skip
    for file, part in files.items():
        save_file(part, hf / file, metadata={"format": "pt"})
    (hf / "model.safetensors").unlink()
    weight_map = {name: file for file, part in files.items() for name in part}
    _index(hf, weight_map)
    return weight_map


# ---------------------------------------------------------------------------------------------- containment
@pytest.mark.parametrize("entry", ["absolute", "dotdot"])
def test_an_index_entry_outside_the_directory_is_refused(hf: Path, elsewhere: Path, entry: str) -> None:
    name = str(elsewhere) if entry == "absolute" else "../elsewhere/model.safetensors"
    _index(hf, {**dict.fromkeys(load_file(hf / "model.safetensors"), "model.safetensors"), NAME: name})
    refused = rf"index\.json's weight_map entry for {NAME} names the file '{name}', which is not a relative name"
    with pytest.raises(ValueError, match=refused):
        MegatronLMModule.from_hf(hf)  # (refused when the directory is opened, before any weight is read)


@pytest.mark.parametrize("file", ["model.safetensors", "config.json", "generation_config.json"])
def test_a_symlink_leaving_the_directory_is_refused(hf: Path, elsewhere: Path, file: str) -> None:
    target = shutil.copy(hf / file, elsewhere.parent / file) if file != "model.safetensors" else elsewhere
    (hf / file).unlink()
    (hf / file).symlink_to(target)
    names = rf"the model directory names .*hf/{file}"
    with pytest.raises(ValueError, match=rf"{names}, a symlink that leads to .*elsewhere/{file}, outside"):
        open_pretrained(hf)


def test_a_hub_cache_snapshot_loads(source: Path, tmp_path: Path) -> None:
    """Hub-cache layout: snapshots/<revision>/<file> -> ../../blobs/<hash>; a link out of the repository is not."""
    repo = tmp_path / "models--tiny--llama"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(p.name for p in source.iterdir())):
        shutil.copy(source / file, repo / "blobs" / f"blob{i}")
        (snapshot / file).symlink_to(f"../../blobs/blob{i}")
    checkpoint, config = open_pretrained(snapshot)
    with checkpoint.lazy_tensors() as lazy:
        assert torch.equal(lazy(NAME)[:], load_file(source / "model.safetensors")[NAME])
    assert checkpoint.fingerprint == HFCheckpoint.open(source).fingerprint
    shutil.copy(source / "generation_config.json", tmp_path / "outside.json")
    (snapshot / "generation_config.json").unlink()
    (snapshot / "generation_config.json").symlink_to("../../../outside.json")
    with pytest.raises(ValueError, match=r"generation_config\.json, a symlink that leads to .*outside\.json, outside"):
        open_pretrained(snapshot)


def test_a_peft_adapter_file_leaving_its_directory_is_refused(hf: Path, tmp_path: Path) -> None:
    adapter = make_peft_adapter(hf, tmp_path / "adapter", targets=("q_proj", "v_proj"))
    _, config = open_pretrained(hf)
    open_adapter(adapter, config)  # as made: loads
    (tmp_path / "elsewhere").mkdir()
    moved = Path(shutil.move(adapter / "adapter_model.safetensors", tmp_path / "elsewhere"))
    (adapter / "adapter_model.safetensors").symlink_to(moved)
    with pytest.raises(ValueError, match=r"the adapter directory names .*adapter_model\.safetensors, a symlink that"):
        MegatronLMModule.from_hf(hf, adapter=adapter)


# ---------------------------------------------------------------------------------------------- what is read
def test_a_pickle_named_by_the_safetensors_index_needs_the_opt_in(hf: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({NAME: Payload(marker)}, hf / "evil.bin")
    _index(hf, {**dict.fromkeys(load_file(hf / "model.safetensors"), "model.safetensors"), NAME: "evil.bin"})
    with pytest.raises(ValueError, match=r"index\.json names PyTorch pickle files \(evil\.bin\).*allow_pickle=True"):
        MegatronLMModule.from_hf(hf)
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"evil\.bin cannot be read with torch\.load\(weights_only=True\)"):
        MegatronLMModule.from_hf(hf, allow_pickle=True)  # opted in: still no code runs
    assert not marker.exists()


def test_a_pickled_peft_adapter_is_refused(hf: Path, tmp_path: Path) -> None:
    adapter = make_peft_adapter(hf, tmp_path / "adapter", targets=("q_proj", "v_proj"))
    (adapter / "adapter_model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"x": Payload(marker)}, adapter / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is a PyTorch pickle .* only adapter_model\.safetensors"):
        MegatronLMModule.from_hf(hf, adapter=adapter)
    assert not marker.exists()


@pytest.mark.parametrize("format", ["safetensors", "pickle"])
def test_an_integer_tensor_is_refused(hf: Path, format: str) -> None:
    tensors = load_file(hf / "model.safetensors")
    tensors[NAME] = tensors[NAME].to(torch.int32)  # same shape: only its dtype is wrong
    (hf / "model.safetensors").unlink()
    if format == "safetensors":
        save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    else:
        torch.save(tensors, hf / "pytorch_model.bin")
    dtype = "I32" if format == "safetensors" else "int32"
    with pytest.raises(ValueError, match=rf"{NAME} in .*hf/\S+ is {dtype}; only floating-point weights"):
        open_pretrained(hf, allow_pickle=True)


def test_a_tensor_mapped_to_the_wrong_shard_is_named(hf: Path) -> None:
    weight_map = _shard(hf)
    open_pretrained(hf)  # as written: loads
    _index(hf, {**weight_map, NAME: "model-00002-of-00002.safetensors"})
    with pytest.raises(ValueError, match=rf"index\.json maps {NAME} to model-00002-of-00002\.safetensors, which does "
                       r"not hold it \(it holds 30 tensors: lm_head\.weight, "):  # fmt: skip
        open_pretrained(hf)


def test_a_missing_shard_is_named(hf: Path) -> None:
    weight_map = _shard(hf)
    (hf / "model-00001-of-00002.safetensors").unlink()
    first = next(name for name, file in weight_map.items() if file == "model-00001-of-00002.safetensors")
    with pytest.raises(ValueError, match=rf"entry for {first} names model-00001-of-00002\.safetensors, which is not"):
        open_pretrained(hf)


# ---------------------------------------------------------------------------------------------- export
class Save(L.Callback):
    def __init__(self, merged: Path, adapter: Path) -> None:
        self.merged, self.adapter = merged, adapter

    def on_predict_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        module.save_hf(self.merged)
        module.save_hf(self.adapter, adapter=True)


def test_an_export_replaces_planted_symlinks(hf: Path, tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    planted = {tmp_path / "out" / f for f in ("model.safetensors", "config.json", "generation_config.json")}
    planted |= {tmp_path / "adapter" / f for f in ("adapter_model.safetensors", "adapter_config.json")}
    for link in planted:
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(victim)
    module = MegatronLMModule.from_hf(hf, seq_length=SEQ, lora=LoRAConfig(rank=2, alpha=4.0))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[Save(tmp_path / "out", tmp_path / "adapter")],
    )  # fmt: skip
    trainer.predict(module, DataLoader(torch.zeros(2, SEQ, dtype=torch.long), batch_size=2))
    assert victim.read_bytes() == b"precious"
    assert not any(link.is_symlink() for link in planted)
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary left
    _, config = open_pretrained(tmp_path / "out")
    open_adapter(tmp_path / "adapter", config)
