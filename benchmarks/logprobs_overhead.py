"""Cost of per-token log-probs (and entropy) vs a plain forward, forward-only through Megatron's schedule.

python benchmarks/logprobs_overhead.py --devices 1          # 1.0B shape, bf16, prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig
from lightning_megatron.data.corpus import synthetic_tokens


class Timer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.start = warmup, [], 0.0

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        torch.cuda.synchronize()
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self.start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batches", type=int, default=8)
    args = p.parse_args()
    config = ModelConfig(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                         vocab_size=32000, seq_length=2048)  # fmt: skip
    model = MegatronLMModule(config)
    data = DataLoader(synthetic_tokens(4 * args.batches, 2048, 32000), batch_size=4)
    result = {"shape": "1b", "devices": args.devices, "tp": args.tp, "batch": "4 x 2048"}
    for mode in ("logits", "logprobs", "logprobs+entropy"):
        model.prediction = mode
        timer = Timer(warmup=2)
        trainer = L.Trainer(
            accelerator="gpu", devices=args.devices, precision="bf16-mixed", logger=False, enable_progress_bar=False,
            strategy=MegatronStrategy(tp=args.tp, micro_batch_size=2), callbacks=[timer],
        )  # fmt: skip
        trainer.predict(model, data, return_predictions=False)
        result[f"{mode}_ms"] = round(1000 * sum(timer.times) / len(timer.times), 1)
    result["logprobs_overhead"] = round(result["logprobs_ms"] / result["logits_ms"] - 1, 4)
    result["logprobs_entropy_overhead"] = round(result["logprobs+entropy_ms"] / result["logits_ms"] - 1, 4)
    if trainer.is_global_zero:
        print(json.dumps({**result, "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
