"""Lightning's precision argument maps onto Megatron's mixed precision (bf16 weights, fp32 main weights)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, OptimizerSpec, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import run_here, run_worker


class _LowLossScale(MegatronLMModule):
    def configure_optimizers(self) -> OptimizerSpec:  # type: ignore[override]
        spec = super().configure_optimizers()
        # fp16 only: Megatron's default initial loss scale (2**32) overflows, and skips, a tiny model's first steps.
        spec.config = replace(spec.config, initial_loss_scale=2.0**10)
        return spec


def _fit(
    precision: str, steps: int = 6, accelerator: str = "cpu"
) -> tuple[list[float], MegatronLMModule, set[torch.dtype]]:
    losses: list[float] = []
    main_dtypes: set[torch.dtype] = set()

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))
            optimizer = trainer.strategy.megatron_optimizer
            main_dtypes.update(p.dtype for g in optimizer.param_groups for p in g["params"])

    model = _LowLossScale(tiny_gpt(), lr=3e-3, decay_steps=steps)
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=MegatronStrategy(micro_batch_size=4, seed=1), precision=precision,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    data = synthetic_tokens(8, 32, 256, seed=2)
    trainer.fit(model, DataLoader(data.repeat(steps, 1), batch_size=8))
    return losses, model, main_dtypes


def test_bf16_mixed_trains_close_to_fp32() -> None:
    fp32, _, _ = _fit("32-true")
    bf16, model, main_dtypes = _fit("bf16-mixed")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # weights live in bf16
    assert main_dtypes == {torch.float32}  # the optimizer updates fp32 main weights
    assert bf16[-1] < bf16[0] - 0.3
    for a, b in zip(fp32, bf16, strict=True):
        assert b == pytest.approx(a, rel=2e-2)


@pytest.mark.gpu
def test_fp16_mixed_trains_close_to_fp32_on_gpu() -> None:
    # Lightning keeps "16-mixed" only on GPU (on CPU it becomes bf16-mixed).
    fp32, _, _ = _fit("32-true", accelerator="gpu")
    fp16, model, main_dtypes = _fit("16-mixed", accelerator="gpu")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert main_dtypes == {torch.float32}
    assert fp16[-1] < fp16[0] - 0.3
    assert model.trainer.strategy.skipped_steps == 0
    for a, b in zip(fp32, fp16, strict=True):
        assert b == pytest.approx(a, rel=2e-2)


@pytest.mark.parametrize(
    "precision", ["16-true", "bf16-true", "64-true"]
)  # (Lightning turns 16-mixed into bf16-mixed on CPU)
def test_unsupported_precision(precision: str) -> None:
    model = MegatronLMModule(tiny_gpt())
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), precision=precision, max_steps=1)
    with pytest.raises(ValueError, match=rf"precision='{precision}'\) is not supported"):
        trainer.fit(model, DataLoader(synthetic_tokens(4, 32, 256), batch_size=4))


@pytest.mark.multiprocess
def test_bf16_tensor_parallel_matches_one_process(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    bf16 = {"precision": "bf16-mixed"}
    # One process, 4 steps, checkpointing at step 2 on the way (checkpointing does not change the run).
    full = run_here({**bf16, "devices": 1, "max_steps": 4, "ckpt_dir": str(ckpt), "ckpt_every": 2}, tmp_path)
    tp2 = run_worker(
        {**bf16, "devices": 2, "tp": 2, "max_steps": 4, "resume": str(ckpt / "epoch=0-step=2.ckpt")}, tmp_path
    )
    for step in ("3", "4"):
        assert tp2["train"][step] == pytest.approx(full["train"][step], rel=5e-3)  # bf16 reductions differ by layout
