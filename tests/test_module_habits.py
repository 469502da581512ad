"""Lightning habits of a module, in one process: its torchmetrics metrics sync over the data-parallel group during a
run and get their default back after it (the multi-process comparisons are in ``test_layouts.py``), and
``load_from_checkpoint`` takes Lightning's ``map_location``, ``hparams_file``, ``strict`` and ``weights_only``."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.core.saving import save_hparams_to_tags_csv
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric, MetricCollection, SumMetric

from lightning_megatron import MegatronLMModule, tiny_gpt
from lightning_megatron.parallel.metrics import metric_process_group
from lightning_megatron.training.offload import Offloader
from tests.tiny_gpt_runs import DATA, tiny_model, tiny_trainer


# ---------------------------------------------------------------------------------------------- torchmetrics
class Groups(L.Callback):
    """The process groups of the module's metrics while it validates, and the group of the run's metrics."""

    def on_validation_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.run = metric_process_group()
        self.seen = {name: getattr(pl_module, name).process_group for name in ("rows", "own", "changed")}
        self.seen["nested"] = pl_module.nested["mean"].process_group
        pl_module.changed.process_group = self.changed_to = object()  # the user's own choice, mid-run


def _broken(*args: object, **kwargs: object) -> None:
    raise RuntimeError("teardown step failed")


@pytest.mark.parametrize("teardown_fails", [False, True], ids=["teardown", "failed_teardown"])
def test_metrics_sync_over_the_data_parallel_group_during_a_run_only(
    monkeypatch: pytest.MonkeyPatch, teardown_fails: bool
) -> None:
    model, own = tiny_model(), object()  # a group of the user's (never computed here)
    model.rows, model.changed, model.own = SumMetric(), SumMetric(), SumMetric(process_group=own)
    model.nested = MetricCollection({"mean": MeanMetric()})
    groups = Groups()
    if teardown_fails:  # a teardown step before the metrics' raises: they still get their default back
        monkeypatch.setattr(Offloader, "reload", _broken)
    with pytest.raises(RuntimeError, match="teardown step failed") if teardown_fails else contextlib.nullcontext():
        tiny_trainer(callbacks=[groups]).validate(model, DataLoader(DATA[:8], batch_size=8), verbose=False)
    assert groups.run is not None  # one process: a data-parallel group of one rank, not torchmetrics' default
    assert groups.seen == {"rows": groups.run, "nested": groups.run, "changed": groups.run, "own": own}
    assert model.rows.process_group is None
    assert model.nested["mean"].process_group is None
    assert model.own.process_group is own  # the user's, left alone
    assert model.changed.process_group is groups.changed_to  # changed during the run: the user's now


# ---------------------------------------------------------------------------------------------- load_from_checkpoint
def _validate(module: MegatronLMModule) -> float:
    out = tiny_trainer().validate(module, DataLoader(DATA[:8], batch_size=8), verbose=False)
    return out[0]["val_loss"]


@pytest.fixture(scope="module")
def plain(saved: dict[str, Path]) -> dict[str, Any]:
    """The weights-only checkpoint loaded without Lightning's arguments, and validated."""
    module = MegatronLMModule.load_from_checkpoint(saved["weights"])
    return {"module": module, "val_loss": _validate(module)}


def test_load_from_checkpoint_map_location(saved: dict[str, Path], plain: dict[str, Any]) -> None:
    # Every device and mapping is alike: each rank reads its shard onto the device of the Trainer that runs it.
    for location in (None, torch.device("cpu"), "cuda:1", {"cuda:1": "cuda:0"}):
        assert MegatronLMModule.load_from_checkpoint(saved["weights"], map_location=location).weights_checkpoint
    module = MegatronLMModule.load_from_checkpoint(saved["weights"], map_location="cpu")
    assert _validate(module) == plain["val_loss"]
    with pytest.raises(TypeError, match=r"map_location=<function.*callable.*cannot be applied to a sharded read"):
        MegatronLMModule.load_from_checkpoint(saved["weights"], map_location=lambda storage, location: storage)


def test_load_from_checkpoint_hparams_file(saved: dict[str, Path], tmp_path: Path) -> None:
    yaml = tmp_path / "hparams.yaml"
    yaml.write_text("lr: 0.0005\nwarmup_steps: 3\n")
    module = MegatronLMModule.load_from_checkpoint(saved["weights"], hparams_file=yaml)
    settings = module.optimizer_settings
    # The file's hyper-parameters replace the checkpoint's (decay_steps=8 there: back to the default here).
    assert (settings.lr, settings.warmup_steps, settings.decay_steps) == (5e-4, 3, None)
    assert module.config == tiny_gpt()  # the ModelConfig is the checkpoint's (saved apart from the hyper-parameters)
    overridden = MegatronLMModule.load_from_checkpoint(saved["weights"], hparams_file=yaml, lr=1e-4)
    assert (overridden.optimizer_settings.lr, overridden.optimizer_settings.warmup_steps) == (1e-4, 3)
    csv = tmp_path / "hparams.csv"
    save_hparams_to_tags_csv(csv, {"lr": 0.002, "clip_grad": 0.5})
    from_csv = MegatronLMModule.load_from_checkpoint(saved["weights"], hparams_file=csv).optimizer_settings
    assert (from_csv.lr, from_csv.clip_grad) == (0.002, 0.5)
    with pytest.raises(ValueError, match=r"hparams_file='.*hparams.json'.*\.yaml, \.yml or \.csv"):
        MegatronLMModule.load_from_checkpoint(saved["weights"], hparams_file=tmp_path / "hparams.json")
    with pytest.raises(FileNotFoundError, match=r"hparams_file='.*missing.yaml' does not exist"):
        MegatronLMModule.load_from_checkpoint(saved["weights"], hparams_file=tmp_path / "missing.yaml")


def test_load_from_checkpoint_weights_only(saved: dict[str, Path]) -> None:
    for weights_only in (None, True):  # what every load does
        assert MegatronLMModule.load_from_checkpoint(saved["full"], weights_only=weights_only).weights_checkpoint
    with pytest.raises(ValueError, match=r"weights_only=False.*always read weights-only.*add_safe_globals"):
        MegatronLMModule.load_from_checkpoint(saved["full"], weights_only=False)


def test_load_from_checkpoint_strict(saved: dict[str, Path], plain: dict[str, Any]) -> None:
    # QK layer norms the checkpoint lacks; tied embeddings: no output layer, which the checkpoint holds.
    other = dataclasses.replace(tiny_gpt(), qk_layernorm=True, share_embeddings_and_output_weights=True)
    with pytest.raises(TypeError, match=r"strict='no'"):
        MegatronLMModule.load_from_checkpoint(saved["weights"], strict="no")
    with pytest.raises(ValueError, match=r"another shape.*qk_layernorm: saved False, now True"):  # strict by default
        _validate(MegatronLMModule.load_from_checkpoint(saved["weights"], config=other))
    module = MegatronLMModule.load_from_checkpoint(saved["weights"], config=other, strict=False)
    kept, ignored = "decoder.layers.self_attention.q_layernorm.weight", "ignored: output_layer.weight"
    with pytest.warns(UserWarning, match=rf"strict=False.*initial values.*{kept}.*{ignored}"):
        _validate(module)
    chunk, loaded = module.chunks[0], plain["module"].chunks[0]
    assert torch.equal(chunk.embedding.word_embeddings.weight, loaded.embedding.word_embeddings.weight)
    assert torch.equal(chunk.decoder.layers[3].mlp.linear_fc2.weight, loaded.decoder.layers[3].mlp.linear_fc2.weight)
    assert torch.all(chunk.decoder.layers[0].self_attention.q_layernorm.weight == 1)  # its init
    with pytest.raises(ValueError, match=r"of another shape.*word_embeddings"):  # still checked
        _validate(
            MegatronLMModule.load_from_checkpoint(saved["weights"], config=tiny_gpt(vocab_size=128), strict=False)
        )
