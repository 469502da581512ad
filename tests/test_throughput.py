"""MegatronThroughput logs Lightning's ThroughputMonitor metric names with the standard model-FLOPs count."""

from __future__ import annotations

import pytest

from lightning_megatron import tiny_gpt


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_throughput_callback_logs_lightning_metric_names(lora: bool) -> None:
    import lightning as L
    from lightning.pytorch.loggers.logger import DummyLogger
    from torch.utils.data import DataLoader

    from lightning_megatron import LoRAConfig, MegatronLMModule, MegatronStrategy, MegatronThroughput
    from lightning_megatron.data.corpus import synthetic_tokens

    class Capture(DummyLogger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict]] = []

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.rows.append((step, dict(metrics)))

    logger = Capture()
    monitor = MegatronThroughput(window=3, peak_flops=1e12, log_every_n_steps=2)
    model = MegatronLMModule(tiny_gpt(), decay_steps=6, lora=LoRAConfig(rank=2) if lora else None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=6, logger=logger,
        callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(synthetic_tokens(24, 32, 256), batch_size=4))
    rows = [m for _, m in logger.rows if "train/items_per_sec" in m]
    assert [s for s, m in logger.rows if "train/items_per_sec" in m] == [2, 4, 6]
    last = rows[-1]
    table = model.chunks[0].embedding.word_embeddings.weight  # the input embedding: a lookup, not counted
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad and p is not table)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not table)  # LoRA's base
    assert (frozen > 0) == lora
    assert table.numel() == 256 * 64
    flops_per_token = 6 * trainable + 4 * frozen + 6 * 4 * 64 * 32  # tiny_gpt: 4 layers, hidden 64, seq 32
    assert last["train/items_per_sec"] == pytest.approx(32 * last["train/samples_per_sec"])
    assert last["train/samples_per_sec"] == pytest.approx(4 * last["train/batches_per_sec"])
    assert last["train/device/flops_per_sec"] == pytest.approx(last["train/device/items_per_sec"] * flops_per_token)
    assert last["train/device/mfu"] == pytest.approx(last["train/device/flops_per_sec"] / 1e12)
