"""Training throughput of Trainer + MegatronStrategy + MegatronLMModule; prints one JSON line.

    python benchmarks/throughput.py --devices 1 --shape 1b            # one GPU, bf16, 1.0B Llama shape
    python benchmarks/throughput.py --devices 2 --tp 2 --shape 1b

MFU = tokens/s x (6 N + 6 layers hidden seq) / (989e12 x GPUs), N the parameter count (H100/H200 dense bf16 peak).
Only variant (a) of the performance issue so far; the raw Megatron-Core and transformers variants come later.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig
from lightning_megatron.data import synthetic_tokens

SHAPES = {
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=2048),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
    "3b": dict(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192),
}
PEAK_FLOPS = 989e12


class StepTimer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        torch.cuda.synchronize()
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
            torch.cuda.reset_peak_memory_stats()
        elif trainer.global_step > self.warmup:
            self.steps += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b", choices=list(SHAPES))
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="per optimizer step and data-parallel rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    config = ModelConfig(**SHAPES[args.shape], vocab_size=32000, seq_length=args.seq_length)
    model = MegatronLMModule(config, lr=1e-4, decay_steps=1000)
    timer = StepTimer(args.warmup)
    batch = args.micro_batch_size * args.micro_batches
    dp = args.devices // (args.tp * args.pp)
    total = args.warmup + args.steps
    trainer = L.Trainer(
        accelerator="gpu", devices=args.devices, precision="bf16-mixed", max_steps=total, logger=False,
        strategy=MegatronStrategy(tp=args.tp, pp=args.pp, micro_batch_size=args.micro_batch_size),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    data = synthetic_tokens(batch * dp * total, args.seq_length, config.vocab_size)
    trainer.fit(model, DataLoader(data, batch_size=batch))
    if trainer.global_rank != 0:
        return
    elapsed = time.perf_counter() - timer.start
    params = sum(p.numel() for p in model.parameters()) * args.tp * args.pp  # this rank holds 1/(tp*pp)
    tokens_per_s = timer.steps * batch * dp * args.seq_length / elapsed
    flops_per_token = 6 * params + 6 * config.num_layers * config.hidden_size * args.seq_length
    print(json.dumps({
        "variant": "lightning_megatron", "shape": args.shape, "devices": args.devices, "tp": args.tp, "pp": args.pp,
        "params_approx": params, "tokens_per_s": round(tokens_per_s), "step_time_s": round(elapsed / timer.steps, 4),
        "mfu": round(tokens_per_s * flops_per_token / (PEAK_FLOPS * args.devices), 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "gpu": torch.cuda.get_device_name(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
