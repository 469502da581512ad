"""The torch Adam inside Megatron's optimizer uses the implementation that fits the device, also after a resume; a
resume follows another LR schedule only when asked to."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.compat.patches import ForeachClipGrads
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import one_process_megatron


def _torch_groups(trainer: L.Trainer) -> list[dict]:
    optimizer = trainer.strategy.megatron_optimizer
    return [g for inner in optimizer.chained_optimizers for g in inner.optimizer.param_groups]


class MarkFused(L.Callback):
    """Make the saved param groups look like a GPU run's (fused AdamW) without stepping with them here."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        for group in _torch_groups(trainer):
            group["fused"], group["foreach"] = True, None


def _fit(tmp_path: Path, max_steps: int, callbacks: list, resume: str | None = None, **module: object) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=max_steps,
        default_root_dir=tmp_path,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    data = DataLoader(synthetic_tokens(16, 32, 256), batch_size=4)
    trainer.fit(MegatronLMModule(tiny_gpt(), **{"decay_steps": 4, **module}), data, ckpt_path=resume)
    return trainer


class Inspect(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        optimizer = trainer.strategy.megatron_optimizer
        self.fused = [g["fused"] for g in _torch_groups(trainer)]
        self.steps = [s["step"] for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values()]
        from megatron.core.optimizer import clip_grads

        self.l2_norm_impl = clip_grads.l2_norm_impl
        self.clip = trainer.strategy._run.patches.get(ForeachClipGrads)


def test_resume_of_a_gpu_checkpoint_on_cpu_uses_the_cpu_adam(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path, 2, [saver, MarkFused()])
    inspect = Inspect()
    resumed = _fit(tmp_path, 3, [inspect], resume=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed.global_step == 3
    assert inspect.fused
    assert not any(inspect.fused)  # the saved flags were GPU ones; on CPU the strategy turns fused off again
    assert inspect.steps
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in inspect.steps)
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    assert inspect.clip.installed is False  # removed at teardown
    assert inspect.l2_norm_impl == inspect.clip._l2_norm  # while fitting (no TE/apex here)
    assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm  # Megatron's own again after teardown


class Schedule(L.Callback):
    """The LR each optimizer step uses (read before it), and the weights and Adam state as the fit starts and ends."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}
        self.states: dict[str, list[torch.Tensor]] = {}

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.states["start"] = self._state(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.lrs[trainer.global_step + 1] = _torch_groups(trainer)[0]["lr"]

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.states["end"] = self._state(trainer)

    @staticmethod
    def _state(trainer: L.Trainer) -> list[torch.Tensor]:
        optimizer = trainer.strategy.megatron_optimizer
        tensors = [p.detach().clone() for p in trainer.lightning_module.parameters()]
        for inner in optimizer.chained_optimizers:
            for group in inner.optimizer.param_groups:
                for param in group["params"]:  # the optimizer's (main) parameters and their Adam state (none yet
                    state = inner.optimizer.state[param]  # before a fresh run's first step)
                    tensors += [param.detach().clone(), *(torch.as_tensor(state[k]).clone() for k in sorted(state))]
        return tensors


def test_resume_with_another_lr_schedule_only_when_asked(tmp_path: Path) -> None:
    """Training longer (max_steps 3 -> 6, the decay over the run: decay_steps=None) with a longer warm-up: strict
    resume raises naming the switch; with it the LR is a fresh 6-step run's from the saved step on, and the weights
    and Adam state resume as saved."""
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    first = Schedule()
    _fit(tmp_path, 3, [saver, first], decay_steps=None, warmup_steps=1)
    ckpt = str(tmp_path / "epoch=0-step=3.ckpt")
    longer = {"decay_steps": None, "warmup_steps": 2}
    with pytest.raises(ValueError, match=r"LR schedule saved in .* differs.*override_lr_schedule=True"):
        _fit(tmp_path, 6, [], resume=ckpt, **longer)
    resumed, fresh = Schedule(), Schedule()
    trainer = _fit(tmp_path, 6, [resumed], resume=ckpt, override_lr_schedule=True, **longer)
    _fit(tmp_path, 6, [fresh], **longer)
    assert trainer.global_step == 6
    assert sorted(resumed.lrs) == [4, 5, 6]  # the step count went on from 3
    assert resumed.lrs == {step: fresh.lrs[step] for step in (4, 5, 6)}
    assert min(resumed.lrs.values()) > 0  # the saved 3-step schedule would have given min_lr=0 from step 4 on
    for saved, loaded in zip(first.states["end"], resumed.states["start"], strict=True):
        assert torch.equal(saved, loaded)
    assert "override_lr_schedule" not in trainer.lightning_module.hparams  # the next resume is strict again


def _params_with_grads() -> list[torch.nn.Parameter]:
    params = []
    for seed, shape in enumerate([(7, 3), (0,), (5,), (4, 4, 2)]):
        param = torch.nn.Parameter(torch.zeros(shape))
        param.grad = 10 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        params.append(param)
    return params


def _norm_and_clip(max_norm: float) -> tuple[float, list[torch.Tensor]]:
    from megatron.core.optimizer import clip_grads

    params = _params_with_grads()
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
    return norm, [p.grad for p in params]


def test_foreach_clip_grads_match_megatron_local_fallback() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    with one_process_megatron(port=29595):
        assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm  # no TE/apex here: Megatron's fallback
        local_norm, local_grads = _norm_and_clip(max_norm=1.0)
        with ForeachClipGrads() as patch:
            assert patch.installed
            assert clip_grads.l2_norm_impl == patch._l2_norm
            with ForeachClipGrads() as second:  # one is in place: a second declines and leaves it
                assert not second.installed
            assert clip_grads.l2_norm_impl == patch._l2_norm
            norm, grads = _norm_and_clip(max_norm=1.0)
            unclipped_norm, unclipped = _norm_and_clip(max_norm=1e6)  # the factor clamps to exactly 1.0
            clip_grads.clip_grad_by_total_norm_fp32([], 1.0, norm)  # a rank with nothing to clip
        patch.remove()  # idempotent
    assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_tensor_impl is None  # Megatron's host-read branch again
    assert isinstance(norm, torch.Tensor)  # Megatron's no-synchronisation branch: the norm is never read on the host
    assert local_norm > 10  # so that the clip really rescales
    assert float(norm) == pytest.approx(local_norm, rel=1e-6)
    for ours, megatron in zip(grads, local_grads, strict=True):
        torch.testing.assert_close(ours, megatron)
    assert float(unclipped_norm) == pytest.approx(local_norm, rel=1e-6)
    for ours, raw in zip(unclipped, [p.grad for p in _params_with_grads()], strict=True):
        assert torch.equal(ours, raw)
    assert sum(g.square().sum() for g in grads).sqrt() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("max_norm", [1.0, 1e6], ids=["clipping", "not_clipping"])
def test_a_deferred_token_scale_is_applied_by_the_clipping(max_norm: float) -> None:
    """The DDP's division by the token count, left to the clipping (parallel/ddp.py): the norm Megatron sees and
    the gradients it leaves are those of dividing first, then clipping."""
    from megatron.core.optimizer import clip_grads

    factor = torch.tensor(1 / 37)
    with one_process_megatron(port=29596), ForeachClipGrads() as patch:
        params = _params_with_grads()
        for p in params:
            p.grad *= factor
        want_norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, want_norm)
        deferred = _params_with_grads()
        with patch.token_scale(factor):
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in deferred])
            clip_grads.clip_grad_by_total_norm_fp32(deferred, max_norm, norm)
        after = clip_grads.get_grad_norm_fp32([p.grad for p in deferred])  # outside: no factor any more
    assert float(norm) == pytest.approx(float(want_norm), rel=1e-6)
    assert float(after) == pytest.approx(min(max_norm, float(want_norm)), rel=1e-5)
    for ours, want in zip(deferred, params, strict=True):
        torch.testing.assert_close(ours.grad, want.grad)
    with pytest.raises(RuntimeError, match="token_scale needs the patch installed"), patch.token_scale(factor):
        pass  # removed: nothing would apply the factor


class Record(L.Callback):
    """Per step: the loss, grad_norms() before the update, the logged grad_norm, whether the division waited."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms_before: list[float] = []
        self.logged_norms: list[float] = []
        self.deferred: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.norms_before.append(float(trainer.strategy.grad_norms()["grad_2.0_norm_total"]))
        self.deferred.append(trainer.strategy._run.ddp_chunks[0].deferred_token_scale is not None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))
        self.logged_norms.append(float(trainer.callback_metrics["grad_norm"]))


def _fit_losses(clip_grad: float) -> Record:
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    labels = synthetic_tokens(16, 32, 256, seed=3)
    labels[::3, :7] = -100  # micro-batches with different token counts: the division matters
    data = [{"input_ids": ids, "labels": lab} for ids, lab in zip(synthetic_tokens(16, 32, 256, seed=3), labels)]
    trainer.fit(MegatronLMModule(tiny_gpt(), lr=3e-3, clip_grad=clip_grad, decay_steps=4), DataLoader(data, 4))
    return record


@pytest.mark.parametrize("clip_grad", [0.05, 0.0], ids=["clipped", "no_clipping"])
def test_training_with_the_token_scale_in_the_clipping_equals_megatrons_order(
    monkeypatch: pytest.MonkeyPatch, clip_grad: float
) -> None:
    got = _fit_losses(clip_grad)
    assert got.deferred == [clip_grad > 0] * 4  # deferred exactly when Megatron clips
    from lightning_megatron.training import optim

    monkeypatch.setattr(optim, "clips", lambda optimizer: False)  # Megatron divides in finalize_model_grads
    want = _fit_losses(clip_grad)
    assert not any(want.deferred)
    assert got.losses == pytest.approx(want.losses, rel=1e-5)
    assert got.norms_before == pytest.approx(want.norms_before, rel=1e-5)
    assert got.logged_norms == pytest.approx(want.logged_norms, rel=1e-5)
    assert got.norms_before == pytest.approx(got.logged_norms, rel=1e-5)
    assert len(set(got.losses)) == len(got.losses)
    if clip_grad:
        assert min(got.logged_norms) > clip_grad  # it really clipped
