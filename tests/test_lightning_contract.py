"""Lightning's contract under MegatronStrategy (one process, CPU): what a Lightning user writes works as with a plain
LightningModule, or fails loudly naming what to use instead. The stage-dependent items run at PP=2 in
``tests/test_lightning_contract_pp.py``."""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_megatron import (
    ChunkSpec,
    MegatronLightningModule,
    MegatronLMModule,
    MegatronValueModule,
    SaveHF,
    schedule,
    tiny_gpt,
)
from lightning_megatron import strategy as strategy_module
from lightning_megatron.callbacks import peak_flops
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.modules.base import UNSUPPORTED_HOOKS
from lightning_megatron.parallel import ddp
from tests.conftest import one_process_trainer
from tests.logged_module import Logged

STEPS = 3
# Virtual seconds (Clock): what the step's own work takes, and what each callback hook around it takes.
STEP_SECONDS = 0.25
CALLBACK_SECONDS = 1000.0


def _data(n: int = 24) -> Tensor:
    data = synthetic_tokens(n, 32, 256, seed=5)
    data[:, 16:] = data[:, :16]
    return data


def _same_batch() -> DataLoader:
    # Every step trains on the same batch (no sampler shuffles the rows: use_distributed_sampler=False): a resumed
    # run's losses then depend on the restored model, optimizer and LR schedule only, not on where in the data it
    # resumes (Lightning's loop state after fit and validate is not that of the last step's checkpoint).
    return DataLoader(_data(4).repeat(6, 1), batch_size=4)


def _trainer(max_steps: int = STEPS, **kwargs: object) -> L.Trainer:
    return one_process_trainer(max_steps, **kwargs)


class Clock:
    """A stand-in for the ``time`` module that the strategy and ``lightning_megatron.schedule`` time a step with:
    ``perf_counter`` reads virtual seconds that only :class:`Seen` advances, so the throughput test states exactly
    what the step's interval holds, whatever the machine's speed or load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)  # the rest of the time module as it is


class Seen(L.Callback):
    """What a callback sees of each step: callback_metrics at its on_train_batch_end, grad norms before the step.

    On its ``clock``: each hook around the step is slow (``CALLBACK_SECONDS``, e.g. a checkpoint save), and the step's
    own work takes ``STEP_SECONDS`` (advanced in on_before_optimizer_step, which runs inside the step, between the
    backward pass and the optimizer step)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.norms: list[dict[str, Tensor]] = []
        self.clock = Clock()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.clock.now += CALLBACK_SECONDS

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.norms.append(trainer.strategy.grad_norms())
        self.clock.now += STEP_SECONDS

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        metrics = trainer.callback_metrics
        names = ("train_loss", "lr", "grad_norm", "skipped_steps", "tokens_per_s", "mean_loss", "ones")
        self.rows.append({"loss": float(outputs["loss"]), **{name: float(metrics[name]) for name in names}})
        self.clock.now += CALLBACK_SECONDS


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One fit with a slow callback (on a virtual clock), a ModelCheckpoint and loss_fn logs; then saves after fit."""
    tmp = tmp_path_factory.mktemp("contract")
    seen = Seen()
    model = Logged(tiny_gpt(), lr=3e-3, decay_steps=16)
    every_step = ModelCheckpoint(dirpath=tmp, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = _trainer(callbacks=[seen, every_step], enable_checkpointing=True)
    # Lightning's own DDP setup re-seeds from seed_everything's seed when one was set (PL_GLOBAL_SEED, left by
    # earlier tests): that is Lightning's behaviour, not the strategy's seeding, so none is set here.
    # The step is timed where the strategy begins it and where the schedule logs it: both read the virtual clock.
    clocks = [mock.patch.object(module, "time", seen.clock) for module in (strategy_module, schedule)]
    with mock.patch.dict(os.environ), clocks[0], clocks[1]:
        os.environ.pop("PL_GLOBAL_SEED", None)
        rng_before = torch.random.get_rng_state()
        trainer.fit(model, _same_batch())
        rng_after = torch.random.get_rng_state()
    val = trainer.validate(model, DataLoader(_data(8), batch_size=4))[0]
    trainer.save_checkpoint(tmp / "final.ckpt")  # after fit (and validate), as Lightning users write it
    trainer.save_checkpoint(tmp / "weights.ckpt", weights_only=True)
    return {"tmp": tmp, "seen": seen, "model": model, "trainer": trainer, "val": val, "rng": (rng_before, rng_after)}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_callbacks_see_the_metrics_of_their_own_step(fitted: dict) -> None:
    rows = fitted["seen"].rows
    assert len(rows) == STEPS
    for row in rows:  # the first step included: nothing is one step late
        assert row["train_loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert row["lr"] > 0
        assert row["grad_norm"] > 0
        assert row["skipped_steps"] == 0
    assert len({row["train_loss"] for row in rows}) == STEPS


def test_throughput_times_the_step_not_the_callbacks(fitted: dict) -> None:
    # On the virtual clock the step's interval holds its own work only: STEP_SECONDS, not the callbacks' seconds
    # before and after it (an interval from the previous step's end, or to this step's callbacks' end, would).
    tokens_per_step = 4 * 32
    for row in fitted["seen"].rows:
        assert tokens_per_step / row["tokens_per_s"] == pytest.approx(STEP_SECONDS, rel=1e-6)


def test_loss_fn_logs_are_reduced_and_logged_each_step(fitted: dict) -> None:
    for row in fitted["seen"].rows:
        assert row["mean_loss"] == pytest.approx(row["train_loss"], rel=1e-6)  # a (sum, count) pair
        assert row["ones"] == 1.0  # a scalar, averaged over the micro-batches
    assert float(fitted["trainer"].callback_metrics["val_mean_loss"]) == pytest.approx(fitted["val"]["val_loss"])


def test_grad_norms_in_on_before_optimizer_step(fitted: dict) -> None:
    norms, rows = fitted["seen"].norms, fitted["seen"].rows
    assert len(norms) == STEPS
    params = [name for name, _ in fitted["model"].named_parameters()]
    for norm, row in zip(norms, rows, strict=True):
        assert set(norm) == {f"grad_2.0_norm/{name}" for name in params} | {"grad_2.0_norm_total"}
        assert float(norm["grad_2.0_norm_total"]) == pytest.approx(row["grad_norm"], rel=1e-5)  # Megatron's norm
        per_param = torch.stack([v for k, v in norm.items() if k != "grad_2.0_norm_total"])
        assert float(per_param.square().sum().sqrt()) == pytest.approx(row["grad_norm"], rel=1e-5)
    with pytest.raises(RuntimeError, match=r"on_before_optimizer_step"):
        fitted["trainer"].strategy.grad_norms()  # outside a step


def test_global_rng_is_put_back(fitted: dict) -> None:
    before, after = fitted["rng"]
    assert torch.equal(before, after)


def test_test_loss_equals_val_loss(fitted: dict) -> None:
    out = fitted["trainer"].test(fitted["model"], DataLoader(_data(8), batch_size=4))[0]
    assert out["test_loss"] == pytest.approx(fitted["val"]["val_loss"], rel=1e-6)
    assert out["test_ppl"] == pytest.approx(math.exp(out["test_loss"]), rel=1e-5)


def test_save_after_fit_resumes_like_the_checkpoint_of_the_last_step(fitted: dict) -> None:
    tmp = fitted["tmp"]
    resumed = {}
    for name in ("final.ckpt", f"step={STEPS}.ckpt"):
        seen = Seen()
        trainer = _trainer(STEPS + 2, callbacks=[seen])
        trainer.fit(Logged(tiny_gpt(), lr=3e-3, decay_steps=16), _same_batch(), ckpt_path=tmp / name)
        assert trainer.global_step == STEPS + 2
        resumed[name] = [row["loss"] for row in seen.rows]  # the second one depends on the restored Adam state
    assert resumed["final.ckpt"] == pytest.approx(resumed[f"step={STEPS}.ckpt"], rel=1e-6)


def test_weights_only_checkpoint(fitted: dict) -> None:
    tmp = fitted["tmp"]
    assert _size(tmp / "weights.ckpt") < 0.45 * _size(tmp / "final.ckpt")  # no optimizer state (Adam: 2x params)
    for name in ("final.ckpt", "weights.ckpt"):  # both validate the same
        out = _trainer().validate(
            MegatronLMModule(tiny_gpt()), DataLoader(_data(8), batch_size=4), ckpt_path=tmp / name
        )
        assert out[0]["val_loss"] == pytest.approx(fitted["val"]["val_loss"], rel=1e-6)
    with pytest.raises(KeyError, match=r"contains only the model.*load_from_checkpoint"):
        _trainer(STEPS + 1).fit(
            MegatronLMModule(tiny_gpt()), DataLoader(_data(), batch_size=4), ckpt_path=tmp / "weights.ckpt"
        )
    # The start of a fine-tuning run: a module built from the checkpoint, with its weights.
    start = MegatronLMModule.load_from_checkpoint(tmp / "weights.ckpt", lr=1e-4)
    assert start.optimizer_settings.lr == 1e-4
    assert start.config == fitted["model"].config
    out = _trainer().validate(start, DataLoader(_data(8), batch_size=4))
    assert out[0]["val_loss"] == pytest.approx(fitted["val"]["val_loss"], rel=1e-6)


def test_save_after_validate_holds_the_model_only(tmp_path: Path, fitted: dict) -> None:
    trainer = _trainer()
    trainer.validate(
        MegatronLMModule(tiny_gpt()), DataLoader(_data(8), batch_size=4), ckpt_path=fitted["tmp"] / "final.ckpt"
    )
    trainer.save_checkpoint(tmp_path / "after_validate.ckpt")
    with pytest.raises(KeyError, match=r"contains only the model"):
        _trainer(1).fit(
            MegatronLMModule(tiny_gpt()), DataLoader(_data(), batch_size=4), ckpt_path=tmp_path / "after_validate.ckpt"
        )


def test_a_module_cannot_change_layout_in_place(fitted: dict) -> None:
    with pytest.raises(ValueError, match=r"built for .*params_dtype=torch.float32.*runs .*params_dtype=torch.bfloat16"):
        _trainer(precision="bf16-mixed").validate(fitted["model"], DataLoader(_data(8), batch_size=4))


def test_self_log_inside_loss_fn_raises() -> None:
    class LogsInside(MegatronLMModule):
        def forward_step(self, batch, model):  # noqa: ANN001, ANN201
            output, loss_fn = super().forward_step(batch, model)

            def logging_loss(logits: Tensor):  # noqa: ANN202
                result = loss_fn(logits)
                self.log("inside", result[0])
                return result

            return output, logging_loss

    with pytest.raises(RuntimeError, match=r"self.log\('inside'.*return it in loss_fn's logs"):
        _trainer(1).fit(LogsInside(tiny_gpt()), DataLoader(_data(8), batch_size=4))


@pytest.mark.parametrize("hook", list(UNSUPPORTED_HOOKS))
def test_hooks_the_schedule_makes_impossible_fail_at_connect(hook: str) -> None:
    from megatron.core import parallel_state

    module = type("Overrides", (MegatronLMModule,), {hook: lambda self, *args, **kwargs: None})(tiny_gpt())
    with pytest.raises(TypeError, match=rf"overrides {hook}\b.*instead of {hook} use"):
        _trainer(1).fit(module, DataLoader(_data(8), batch_size=4))
    assert not parallel_state.model_parallel_is_initialized()
    assert not hasattr(module, "chunks")  # raised before anything was built


def test_abstract_methods_and_manual_optimization() -> None:
    class NoForward(MegatronLightningModule):
        def build_chunk(self, spec: ChunkSpec) -> nn.Module:
            raise AssertionError

        def configure_optimizers(self):  # noqa: ANN201
            raise AssertionError

    with pytest.raises(TypeError, match=r"Can't instantiate NoForward .*\['forward_step'\]"):
        NoForward()

    class Manual(MegatronLMModule):
        def __init__(self) -> None:
            super().__init__(tiny_gpt())
            self.automatic_optimization = False

    with pytest.raises(TypeError, match=r"manual optimization is not supported"):
        _trainer(1).fit(Manual(), DataLoader(_data(8), batch_size=4))


def test_a_critic_has_no_hf_export(tmp_path: Path) -> None:
    critic = MegatronValueModule(tiny_gpt())
    assert not hasattr(critic, "save_hf")
    assert not hasattr(critic, "export_hf_weights")
    data = [{"input_ids": ids, "returns": torch.zeros(32)} for ids in _data(8)]
    with pytest.raises(TypeError, match=r"value model .* no Hugging Face"):
        _trainer(1, callbacks=[SaveHF(str(tmp_path / "hf"))]).fit(critic, DataLoader(data, batch_size=4))


def test_a_callback_s_backward_hook_fails_at_connect() -> None:
    class GradLogger(L.Callback):
        def on_after_backward(self, trainer, pl_module) -> None:  # noqa: ANN001
            pass

    with pytest.raises(TypeError, match=r"GradLogger.on_after_backward.*on_before_optimizer_step"):
        _trainer(1, callbacks=[GradLogger()]).fit(MegatronLMModule(tiny_gpt()), DataLoader(_data(8), batch_size=4))


def _broken(*args: object) -> None:
    raise RuntimeError("teardown step failed")


def _unpatched() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from lightning_megatron.compat import cpu

    assert not cpu.is_enabled()
    assert torch.cuda.current_device is CURRENT_DEVICE
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm


CURRENT_DEVICE = torch.cuda.current_device


def test_teardown_undoes_every_patch_even_when_a_step_of_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ddp, "clear_hooks", _broken)  # the third of teardown's steps
    with pytest.raises(RuntimeError, match="teardown step failed"):
        _trainer(1).fit(MegatronLMModule(tiny_gpt()), DataLoader(_data(8), batch_size=4))
    _unpatched()


def test_a_failed_run_raises_its_own_error_even_when_teardown_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing(MegatronLMModule):
        def forward_step(self, batch, model):  # noqa: ANN001, ANN201
            raise ValueError("the user's error")

    monkeypatch.setattr(ddp, "clear_hooks", _broken)
    with pytest.raises(ValueError, match="the user's error"):
        _trainer(1).fit(Failing(tiny_gpt()), DataLoader(_data(8), batch_size=4))
    _unpatched()
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()  # after a failure nothing is kept


def test_a_checkpoint_that_could_not_be_resumed_is_refused_at_save(tmp_path: Path) -> None:
    class WithTimeout(MegatronLMModule):
        def __init__(self, timeout: timedelta) -> None:  # a hyper-parameter that weights-only loading refuses
            super().__init__(tiny_gpt())

    trainer = _trainer(1)
    trainer.fit(WithTimeout(timedelta(minutes=5)), DataLoader(_data(8), batch_size=4))
    with pytest.raises(ValueError, match=r"\['hyper_parameters'\]\['timeout'\] is a datetime.timedelta, which loading"):
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()


def test_per_token_loss_is_not_switched_on_behind_the_module_s_back() -> None:
    class Averaging(MegatronLMModule):
        def build_chunk(self, spec: ChunkSpec) -> nn.Module:
            chunk = super().build_chunk(spec)
            chunk.config.calculate_per_token_loss = False
            return chunk

    with pytest.raises(ValueError, match=r"calculate_per_token_loss=False.*\*\*spec.parallel"):
        _trainer(1).fit(Averaging(tiny_gpt()), DataLoader(_data(8), batch_size=4))


def test_warmup_longer_than_the_decay_raises() -> None:
    with pytest.raises(ValueError, match=r"lr_warmup_steps=8 is not shorter than lr_decay_steps=4"):
        _trainer(1).fit(MegatronLMModule(tiny_gpt(), warmup_steps=8, decay_steps=4), DataLoader(_data(8), batch_size=4))


def test_mfu_peak_table() -> None:
    assert peak_flops("NVIDIA H200", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float16) == pytest.approx(312e12)
    assert peak_flops("NVIDIA H100 PCIe", torch.bfloat16) is None  # Lightning's table has the PCIe part
    assert peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None


class Memory(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.during = torch.cuda.memory_allocated()


@pytest.mark.gpu
def test_save_after_fit_on_gpu(tmp_path: Path) -> None:
    """On GPU teardown moves the kept optimizer state to the host; a save after fit brings it back and resumes
    exactly like the last step's checkpoint. MegatronThroughput knows the H200's peak (MFU logged)."""
    from lightning_megatron import MegatronThroughput

    memory, throughput = Memory(), MegatronThroughput(window=2, log_every_n_steps=1)
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    gpu = {"accelerator": "gpu", "precision": "bf16-mixed", "enable_checkpointing": True}
    trainer = _trainer(callbacks=[memory, throughput, every_step], **gpu)
    trainer.fit(Logged(tiny_gpt(), lr=3e-3, decay_steps=16), _same_batch())
    assert torch.cuda.memory_allocated() < memory.during / 2  # optimizer state and the module left the GPU
    assert "train/device/mfu" in throughput.last
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    resumed = {}
    for name in ("final.ckpt", f"step={STEPS}.ckpt"):
        seen = Seen()
        again = _trainer(STEPS + 2, callbacks=[seen], accelerator="gpu", precision="bf16-mixed")
        again.fit(Logged(tiny_gpt(), lr=3e-3, decay_steps=16), _same_batch(), ckpt_path=tmp_path / name)
        resumed[name] = [row["loss"] for row in seen.rows]
    assert resumed["final.ckpt"] == pytest.approx(resumed[f"step={STEPS}.ckpt"], rel=1e-6)
