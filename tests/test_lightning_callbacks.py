"""Lightning's callbacks and Trainer arguments under MegatronStrategy (one process, CPU): each works as Lightning
documents it for a plain LightningModule -- under the same Trainer arguments the loop runs the same batches,
validations and logger rows as for a plain module -- or raises at ``connect``, before any process group or model is
built, naming what to use instead (docs/lightning.md, "Lightning's callbacks and Trainer arguments")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    BasePredictionWriter,
    BatchSizeFinder,
    DeviceStatsMonitor,
    EarlyStopping,
    LambdaCallback,
    LearningRateFinder,
    LearningRateMonitor,
    ModelPruning,
    RichProgressBar,
    SpikeDetection,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.plugins import AsyncCheckpointIO
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLightningModule, MegatronLMModule, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.parallel import state as parallel_state
from tests.conftest import one_process_trainer

DATA = synthetic_tokens(48, 32, 256, seed=5)
LR = "lr-LightningOptimizerAdapter"  # LearningRateMonitor's name: the optimizer class Lightning sees


@pytest.fixture(autouse=True)
def torch_flags() -> Any:
    """Trainer(deterministic, benchmark) set process-wide torch flags (and CUBLAS_WORKSPACE_CONFIG) and leave them."""
    flags = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    with mock.patch.dict(os.environ):
        yield
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.benchmark = flags[1]


def _model() -> MegatronLMModule:
    return MegatronLMModule(tiny_gpt(), lr=3e-3, warmup_steps=2, decay_steps=8)


# ---------------------------------------------------------------------------------------------- callbacks that work
class Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.batches: list[tuple[list[int], tuple[int, ...]]] = []
        self.epochs: list[tuple[int, Any]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):  # noqa: ANN001
        self.batches.append((list(batch_indices), tuple(prediction.shape)))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:  # noqa: ANN001
        self.epochs.append((len(predictions), batch_indices))


def _hooks(seen: list[Any]) -> LambdaCallback:
    def batch_end(trainer: L.Trainer, module: Any, outputs: dict[str, Tensor], batch: Any, idx: int) -> None:
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        flags = torch.is_anomaly_enabled(), torch.are_deterministic_algorithms_enabled()
        seen.append(("train_batch_end", float(outputs["loss"]), metrics, flags))

    return LambdaCallback(
        on_fit_start=lambda *_: seen.append("fit_start"),
        on_before_optimizer_step=lambda *_: seen.append("before_optimizer_step"),
        on_train_batch_end=batch_end,
        on_validation_end=lambda *_: seen.append("validation_end"),
        on_train_end=lambda *_: seen.append("train_end"),
    )


def test_callbacks_that_work_in_one_fit(tmp_path: Path) -> None:
    """Timer, LearningRateMonitor, DeviceStatsMonitor, EarlyStopping, SpikeDetection, TQDMProgressBar,
    LambdaCallback, BasePredictionWriter, ModelCheckpoint; profiler="simple", detect_anomaly, deterministic."""
    seen: list[Any] = []
    timer, spike, writer = Timer(), SpikeDetection(), Writer()
    stop = EarlyStopping(monitor="val_loss", stopping_threshold=100.0)  # met at the first validation
    monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    callbacks = [timer, monitor, DeviceStatsMonitor(), stop, spike]
    trainer = one_process_trainer(
        -1, max_epochs=3, limit_train_batches=2, limit_val_batches=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
        callbacks=[*callbacks, TQDMProgressBar(), _hooks(seen), writer], enable_progress_bar=True,
        enable_checkpointing=True, profiler="simple", detect_anomaly=True, deterministic=True,
    )  # fmt: skip
    model = _model()
    trainer.fit(model, DataLoader(DATA, batch_size=4), DataLoader(DATA[:8], batch_size=4))
    steps = [event for event in seen if isinstance(event, tuple)]
    hooks = [event if isinstance(event, str) else event[0] for event in seen]
    assert hooks == ["fit_start", *["before_optimizer_step", "train_batch_end"] * 2, "validation_end", "train_end"]
    assert (trainer.global_step, stop.stopped_epoch) == (2, 0)  # EarlyStopping ended the fit after epoch 0
    assert timer.time_elapsed("train") > 0
    lrs = [(metrics[f"{LR}/pg1"], metrics[f"{LR}/pg2"], metrics["lr"]) for _, _, metrics, _ in steps]
    assert all(a == pytest.approx(b, rel=1e-6) == c for a, b, c in lrs)
    assert lrs[0][2] != lrs[1][2]  # warm-up: the rate changes
    momentum = [metrics[f"{LR}/pg1-momentum"] for _, _, metrics, _ in steps]
    assert momentum == pytest.approx([0.9, 0.9])  # Adam's beta1, from its betas
    logged = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")  # to the logger
    assert any(name.startswith("DeviceStatsMonitor.on_train_batch_start/cpu_") for name in logged)
    assert float(spike.last_val) == steps[-1][1] == pytest.approx(steps[-1][2]["train_loss"])  # the step's loss
    assert all(flags == (True, True) for *_, flags in steps)  # detect_anomaly, deterministic during the steps
    assert len(trainer.profiler.recorded_durations["[Strategy]MegatronStrategy.training_step"]) == 2
    assert "train_loss" in trainer.progress_bar_metrics
    assert list(tmp_path.rglob("epoch=0-step=2.ckpt"))
    trainer.predict(model, DataLoader(DATA[:8], batch_size=4), return_predictions=False)
    assert writer.batches == [([0, 1, 2, 3], (4, 32, 256)), ([4, 5, 6, 7], (4, 32, 256))]
    assert writer.epochs == [(2, [[[0, 1, 2, 3], [4, 5, 6, 7]]])]


class Poison(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx == 2:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


def test_spike_detection_stops_at_a_non_finite_loss_and_names_its_batches(tmp_path: Path) -> None:
    trainer = one_process_trainer(4, callbacks=[Poison(), SpikeDetection()], default_root_dir=tmp_path)
    with pytest.raises(TrainingSpikeException, match="batch 2"):
        trainer.fit(_model(), DataLoader(DATA, batch_size=4))
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [1, 2]  # Lightning's file of batches to skip


def test_validate_then_fit_where_lightning_would_use_inference_mode() -> None:
    """On GPUs (NCCL) Lightning runs trainer.validate/test/predict under torch.inference_mode (on gloo under no_grad):
    stand in for NCCL. What an inference-mode validate leaves -- the perplexity metric's states, reset in inference
    mode, and the attention's RoPE tables -- would make the next fit fail; the strategy evaluates under no_grad."""
    from lightning.pytorch.loops import utilities

    model, rows = _model(), DATA[:, :24]  # a sequence length of its own: RoPE tables are built per length
    with mock.patch.object(utilities, "_distributed_is_initialized", return_value=False):
        trainer = one_process_trainer(-1, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
        trainer.validate(model, DataLoader(rows[:8], batch_size=4))
        trainer.fit(model, DataLoader(rows, batch_size=4), DataLoader(rows[:8], batch_size=4))
    assert trainer.global_step == 2
    assert "val_loss" in trainer.callback_metrics  # the fit's own validation ran


# ---------------------------------------------------------------------------------------------- Trainer arguments
class Steps(Logger):
    """The steps at which the logger writes train_loss / val_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, list[str]]] = []

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, sorted(name for name in metrics if name in ("train_loss", "val_loss"))))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Trace(L.Callback):
    """Every batch the loops run (stage, epoch, index, global step, first token) and where the fit ended."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def _batch(self, stage: str, trainer: L.Trainer, batch: Tensor, idx: int) -> None:
        self.events.append((stage, trainer.current_epoch, idx, trainer.global_step, int(batch[0, 0])))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._batch("train", trainer, batch, batch_idx)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        self._batch("sanity" if trainer.sanity_checking else "val", trainer, batch, batch_idx)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        self._batch("test", trainer, batch, batch_idx)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        self._batch("predict", trainer, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.events.append(("end", trainer.current_epoch, trainer.global_step))
        self.bar = dict(trainer.progress_bar_metrics)  # what the progress bar showed last
        # What the profiler recorded, before the fit's end clears it: cProfile's actions ("advanced"), torch's events
        # ("pytorch", whose summary() stops it).
        profiler = trainer.profiler
        profiler.summary()
        events = getattr(profiler, "function_events", None) or []
        self.profiled = {*getattr(profiler, "profiled_actions", {}), *(event.name for event in events)}


class Data(L.LightningDataModule):
    """8 training batches, 4 for validation/test/predict; counts when each loader is made."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def _loader(self, stage: str, rows: Tensor) -> DataLoader:
        self.made.append((stage, self.trainer.current_epoch))
        return DataLoader(rows, batch_size=4)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", DATA[:32])

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", DATA[32:])

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", DATA[32:])

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict", DATA[32:])


class Plain(L.LightningModule):
    """A plain LightningModule: the reference for what the Trainer arguments do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(256, 8), nn.Linear(8, 256)

    def _loss(self, ids: Tensor) -> Tensor:
        return F.cross_entropy(self.head(self.embed(ids[:, :-1])).flatten(0, 1), ids[:, 1:].flatten())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.head(self.embed(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


# fmt: off
ARGUMENTS = [
    pytest.param(
        {
            "max_epochs": 2, "limit_train_batches": 4, "val_check_interval": 2, "limit_val_batches": 1,
            "num_sanity_val_steps": 2, "reload_dataloaders_every_n_epochs": 1, "log_every_n_steps": 3,
            "limit_test_batches": 1, "limit_predict_batches": 2, "profiler": "advanced", "benchmark": True,
            "inference_mode": False, "enable_progress_bar": True, "callbacks": [RichProgressBar],
        },
        id="limits, int val_check_interval, sanity, reload, log_every_n_steps, advanced profiler, rich",
    ),
    pytest.param(
        {
            "max_epochs": 2, "limit_train_batches": 2, "val_check_interval": 0.5, "check_val_every_n_epoch": 2,
            "limit_val_batches": 0.5,
        },
        id="float val_check_interval, check_val_every_n_epoch",
    ),
    pytest.param({"fast_dev_run": 2, "profiler": "pytorch"}, id="fast_dev_run, pytorch profiler"),
    pytest.param({"max_epochs": 2, "overfit_batches": 2}, id="overfit_batches"),
    pytest.param(  # the Timer asks to stop after the first step; min_epochs (4 steps) and min_steps (5) keep it going
        {"max_steps": 8, "min_steps": 5, "min_epochs": 2, "limit_train_batches": 2, "max_time": {"microseconds": 1}},
        id="max_time, min_steps, min_epochs",
    ),
    pytest.param({"max_steps": 3, "barebones": True, "logger": False}, id="barebones"),
]
# fmt: on


def _run(module: L.LightningModule, root: Path, arguments: dict[str, Any], **strategy: Any) -> tuple[list, L.Trainer]:
    """What the loops ran, and the Trainer; ``fit``, then ``test`` and ``predict`` where their limits are given."""
    trace, logger, data = Trace(), Steps(), Data()
    settings = {"max_steps": -1, "logger": logger, "default_root_dir": root, **strategy, **arguments}
    callbacks = [trace, *(make() for make in settings.pop("callbacks", []))]
    trainer = one_process_trainer(settings.pop("max_steps"), callbacks=callbacks, **settings)
    trainer.fit(module, datamodule=data)
    trainer.profiled, trainer.bar = getattr(trace, "profiled", set()), getattr(trace, "bar", {})
    if "limit_test_batches" in arguments:
        trainer.test(module, datamodule=data, verbose=False)
        trainer.predict(module, datamodule=data, return_predictions=False)
    return [trace.events, logger.rows, data.made], trainer


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_trainer_arguments_run_the_loop_as_for_a_plain_module(arguments: dict[str, Any], tmp_path: Path) -> None:
    plain, _ = _run(Plain(), tmp_path / "plain", arguments, strategy="auto")
    megatron, trainer = _run(_model(), tmp_path / "megatron", arguments)
    assert megatron == plain
    assert any(event[0] == "train" for event in megatron[0])
    if "profiler" in arguments:
        assert any(name.endswith("[Strategy]MegatronStrategy.training_step") for name in trainer.profiled)
    if arguments.get("enable_progress_bar"):
        assert isinstance(trainer.progress_bar_callback, RichProgressBar)
        assert "train_loss" in trainer.bar


# ---------------------------------------------------------------------------------------------- refused at connect
class Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        pass

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        pass


REFUSED = [
    pytest.param(
        {"callbacks": [ThroughputMonitor(batch_size_fn=len)]},
        ValueError,
        r"ThroughputMonitor is not supported.*counts every rank as a data-parallel replica.*MegatronThroughput",
        id="ThroughputMonitor",
    ),
    pytest.param(
        {"callbacks": [ModelPruning("l1_unstructured", amount=0.5)]},
        ValueError,
        r"ModelPruning is not supported.*weight_orig.*save_hf",
        id="ModelPruning",
    ),
    pytest.param(
        {"callbacks": [BackboneFinetuning()]},
        ValueError,
        r"BackboneFinetuning \(a BaseFinetuning\) is not supported.*requires_grad=False.*load_from_checkpoint",
        id="BackboneFinetuning",
    ),
    pytest.param(
        {"callbacks": [Unfreeze()]},
        ValueError,
        r"Unfreeze \(a BaseFinetuning\) is not supported.*unfrozen later cannot join",
        id="BaseFinetuning",
    ),
    pytest.param(
        {"callbacks": [BatchSizeFinder()]},
        ValueError,
        r"BatchSizeFinder is not supported.*batch_size yourself.*micro_batch_size",
        id="BatchSizeFinder",
    ),
    pytest.param(
        {"callbacks": [LearningRateFinder()]},
        ValueError,
        r"LearningRateFinder inside trainer.fit.*LR schedule keeps the search's step count.*Tuner\(trainer\)\.lr_find",
        id="LearningRateFinder",
    ),
    pytest.param(
        {"callbacks": [LambdaCallback(on_after_backward=print)]},
        TypeError,
        r"LambdaCallback\(on_after_backward=\.\.\.\).*never calls on_after_backward.*on_before_optimizer_step",
        id="LambdaCallback backward hook",
    ),
    pytest.param(
        {"sync_batchnorm": True},
        ValueError,
        r"sync_batchnorm=True.*SyncBatchNorm\(process_group=.*get_data_parallel_group",
        id="sync_batchnorm",
    ),
    pytest.param(
        {"plugins": [AsyncCheckpointIO()]},
        ValueError,
        r"plugins=\[AsyncCheckpointIO\(\.\.\.\)\].*never calls a CheckpointIO plugin.*async_save=True",
        id="CheckpointIO plugin",
    ),
]


@pytest.mark.parametrize(("arguments", "error", "match"), REFUSED)
def test_refused_at_connect(
    arguments: dict[str, Any], error: type[Exception], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was built before the error")

    monkeypatch.setattr(parallel_state, "initialize", built)
    monkeypatch.setattr(MegatronLightningModule, "configure_model", built)
    trainer = one_process_trainer(1, **arguments)
    with pytest.raises(error, match=match):
        trainer.fit(_model(), DataLoader(DATA[:8], batch_size=4))
