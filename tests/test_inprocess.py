"""Single-process runs inside the test process: learning, teardown, a second Trainer, CPU mode scoping."""

from __future__ import annotations

import gc
import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.compat import cpu
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import one_process_megatron


def _data(n: int = 64) -> torch.Tensor:
    data = synthetic_tokens(n, 32, 256, seed=3)
    data[:, 16:] = data[:, :16]  # the second half repeats the first: learnable
    return data


def _trainer(max_steps: int, **kwargs: object) -> L.Trainer:
    defaults: dict = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=max_steps,
        enable_model_summary=False, **{**defaults, **kwargs},
    )  # fmt: skip


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.values.append(float(outputs["loss"]))


def test_loss_falls_and_weights_change() -> None:
    model = MegatronLMModule(tiny_gpt(), lr=3e-3, decay_steps=40)
    losses = Losses()
    trainer = _trainer(40, callbacks=[losses])
    batch = _data(8)
    loader = DataLoader(batch.repeat(40, 1), batch_size=8)  # the same batch every step
    trainer.fit(model, loader)
    assert losses.values[-1] < losses.values[0] - 1.0, losses.values  # memorises the repeated batch
    # Everything trainer.fit leaves behind is consistent with what Lightning logged.
    assert trainer.callback_metrics["train_loss"] == torch.tensor(losses.values[-1])
    assert trainer.callback_metrics["lr"] > 0
    assert trainer.callback_metrics["grad_norm"] > 0


def test_second_trainer_and_evaluation_after_fit() -> None:
    model = MegatronLMModule(tiny_gpt(), lr=1e-3)
    data = _data(32)
    _trainer(2).fit(model, DataLoader(data, batch_size=8))
    assert not cpu.is_enabled()  # CPU mode is scoped to the run
    weights = [p.detach().clone() for p in model.parameters()]
    assert weights

    # validate and predict with the same module in fresh Trainers (parallel state rebuilt, no re-init).
    val = L.Trainer(accelerator="cpu", devices=1, strategy="megatron", logger=False, enable_progress_bar=False)
    out = val.validate(model, DataLoader(data[:8], batch_size=4))
    assert 4.0 < out[0]["val_loss"] < 6.0
    preds = _trainer(1).predict(model, DataLoader(data[:8], batch_size=4))
    assert [p.shape for p in preds] == [torch.Size([4, 32, 256])] * 2
    for before_w, after_w in zip(weights, model.parameters(), strict=True):
        torch.testing.assert_close(before_w, after_w.detach(), rtol=0, atol=0)

    # A second fit on a new module in the same process.
    other = MegatronLMModule(tiny_gpt(num_layers=2), lr=1e-3)
    _trainer(2).fit(other, DataLoader(data, batch_size=8))
    assert len(list(other.chunks)) == 1


def test_a_later_run_releases_the_earlier_runs_process_groups() -> None:
    """Each run builds dozens of gloo groups of three threads each; torch keeps them unless destroyed. Kept, a
    process of many runs (a notebook, this test suite) held thousands of polling threads that starved its CPU."""

    def threads() -> int:
        gc.collect()
        return len(os.listdir(f"/proc/{os.getpid()}/task"))  # Linux: every thread, gloo's native ones included

    model, loader = MegatronLMModule(tiny_gpt(), lr=1e-3), DataLoader(_data(8), batch_size=4)
    counts = []
    for _ in range(3):
        _trainer(1, limit_val_batches=1).validate(model, loader, verbose=False)
        counts.append((threads(), torch.distributed.get_pg_count()))  # the count of groups ever created
    (_, created_one), (after_two, created_two), (after_three, _) = counts
    assert created_two - created_one >= 10  # what the check guards: a run builds many groups
    # Megatron's RoPE cache keeps each run's rotary module, and its context-parallel group, alive: 3 threads.
    assert after_three - after_two <= 6, counts


def test_cpu_mode_is_reversible() -> None:
    original = torch.cuda.current_device
    with cpu.cpu_mode():
        assert torch.cuda.current_device() == torch.device("cpu")
        t = torch.empty(2, device="cuda")
        assert t.device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.ones(1).to(torch.cuda.current_device()).device.type == "cpu"
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.rand(3))  # the "CUDA" RNG is the CPU generator
    assert torch.cuda.current_device is original
    assert not cpu.is_enabled()


def test_one_process_megatron_turns_cpu_mode_on_only_for_cpu_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU tests' fixture (``cpu=False``) must leave CUDA real. (Until 2026-12-03 a local import shadowed the
    flag, so the fp8 GPU test ran on the CPU.) Megatron's state is not built here: only CPU mode is checked."""
    from lightning_megatron.parallel import state

    for name in ("initialize", "seed", "destroy"):
        monkeypatch.setattr(state, name, lambda *args: None)
    with one_process_megatron(port=29656, cpu=False):
        assert not cpu.is_enabled()
    with one_process_megatron(port=29656):
        assert cpu.is_enabled()
    assert not cpu.is_enabled()
    in_cpu_mode = pytest.raises(RuntimeError, match="inside CPU mode")  # a GPU test must not run in it
    with cpu.cpu_mode(), in_cpu_mode, one_process_megatron(port=29656, cpu=False):
        pass


class _CudaInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        # What Megatron's backward functions do (buffers, recompute): CUDA placement outside forward.
        return grad * 2 + torch.zeros(grad.shape, device="cuda")


def test_cpu_mode_reaches_custom_backward() -> None:
    original = torch.autograd.function.BackwardCFunction.apply
    with cpu.cpu_mode():
        x = torch.ones(3, requires_grad=True)
        _CudaInBackward.apply(x).sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert torch.autograd.function.BackwardCFunction.apply is original
    assert torch.empty(1).type() == "torch.FloatTensor"


def test_registry_name() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="megatron", logger=False)
    assert isinstance(trainer.strategy, MegatronStrategy)


def test_checkpoint_overwrite_is_atomic_and_resumes_from_last(tmp_path) -> None:  # noqa: ANN001
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = DataLoader(_data(32), batch_size=8)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=1, monitor="train_loss")
    _trainer(3, callbacks=[ckpt], enable_checkpointing=True).fit(MegatronLMModule(tiny_gpt(), decay_steps=8), data)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "last.ckpt" in names  # rewritten every step through a .partial directory and a rename
    assert not [n for n in names if n.endswith((".partial", ".old"))], names
    assert (tmp_path / "last.ckpt" / "metadata.json").is_file()

    resumed = Losses()
    trainer = _trainer(4, callbacks=[resumed])
    trainer.fit(MegatronLMModule(tiny_gpt(), decay_steps=8), data, ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.global_step == 4
    assert len(resumed.values) == 1  # only the step after the checkpoint ran

    # The LR schedule is part of the checkpoint: resuming with another one is an error, not a silent switch.
    with pytest.raises(ValueError, match=r"LR schedule saved in .*last.ckpt differs"):
        _trainer(5).fit(MegatronLMModule(tiny_gpt(), decay_steps=9), data, ckpt_path=str(tmp_path / "last.ckpt"))


def test_progress_metrics_tokens_per_second_and_perplexity() -> None:
    trainer = _trainer(2, limit_val_batches=2, val_check_interval=2, check_val_every_n_epoch=None)
    data = _data(32)
    trainer.fit(MegatronLMModule(tiny_gpt()), DataLoader(data, batch_size=8), DataLoader(data[:16], batch_size=8))
    metrics = trainer.callback_metrics
    assert metrics["tokens_per_s"] > 0
    assert float(metrics["val_ppl"]) == pytest.approx(float(torch.exp(metrics["val_loss"])), rel=1e-5)


def test_resumable_loader_after_an_epoch_end_checkpoint() -> None:
    from lightning_megatron.data.resume import ResumableLoader

    loader = ResumableLoader(list(range(5)), consumed=lambda: 5)
    assert loader.state_dict() == {"batches_consumed": 5, "batches_per_epoch": 5}
    loader.load_state_dict({"batches_consumed": 5})  # saved after the epoch's last batch: next epoch is whole
    assert list(loader) == [0, 1, 2, 3, 4]
    loader.load_state_dict({"batches_consumed": 2})
    assert list(loader) == [2, 3, 4]
    assert list(loader) == [0, 1, 2, 3, 4]  # only the first epoch after a restore is shortened
    # The position is exact for the same global batch size; mid-epoch, another one is refused.
    sized = ResumableLoader(list(range(5)), consumed=lambda: 2, global_batch=8)
    assert sized.state_dict() == {"batches_consumed": 2, "global_batch_size": 8, "batches_per_epoch": 5}
    with pytest.raises(ValueError, match=r"global batches of 4 samples .* this run's global batch is 8"):
        sized.load_state_dict({"batches_consumed": 2, "global_batch_size": 4, "batches_per_epoch": 10})
    # 5 of the saved run's 10 batches: mid-epoch there, though a multiple of this loader's 5 batches per epoch
    with pytest.raises(ValueError, match=r"saved 5 batches into an epoch"):
        sized.load_state_dict({"batches_consumed": 5, "global_batch_size": 4, "batches_per_epoch": 10})
    sized.load_state_dict({"batches_consumed": 10, "global_batch_size": 4, "batches_per_epoch": 10})  # epoch end
    assert list(sized) == [0, 1, 2, 3, 4]


def test_host_scalar_is_a_snapshot_on_the_host() -> None:
    from lightning_megatron.training.host import HostScalar

    value = torch.tensor(2.5)
    host = HostScalar(value)
    value += 1  # later work on the device value does not change what was logged
    assert host.get().device.type == "cpu"
    assert host.get() == torch.tensor(2.5)


@pytest.mark.gpu
def test_host_scalar_copies_a_cuda_value_without_later_work() -> None:
    from lightning_megatron.training.host import HostScalar

    value = torch.tensor(2.5, device="cuda")
    host = HostScalar(value)
    value += 1  # queued after the copy on the same stream
    assert host.get().is_pinned()
    assert host.get() == torch.tensor(2.5)
