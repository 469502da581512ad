"""fp8 vs bf16 on real text: the same model, seed and data, trained for ``--steps`` steps on one GPU.

    python benchmarks/fp8_convergence.py --fp8 none      # bf16 GEMMs
    python benchmarks/fp8_convergence.py --fp8 hybrid    # ModelConfig(fp8="hybrid"): e5m2 output gradients
    python benchmarks/fp8_convergence.py --fp8 e4m3      # ModelConfig(fp8="e4m3"): e4m3 output gradients

Byte-level text (the Python sources of the installed packages, ``ByteCorpusDataModule``), bf16 with fp32 master
weights, Adam. Prints one JSON line: the training loss every 50 steps, the mean of the last 10, the validation loss
at the end and tokens/s over the run.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning as L
import torch

from benchmarks.throughput import SHAPES
from lightning_megatron import ByteCorpusDataModule, MegatronLMModule, MegatronStrategy, ModelConfig


class Losses(L.Callback):
    def __init__(self, bf16_linears: list[str]) -> None:
        self.values: list[float] = []
        self.start = 0.0
        self.bf16_linears = bf16_linears
        self.unquantized: list[str] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_megatron.kernels import linear

        fp8_classes = (linear.Fp8ColumnParallelLinear, linear.Fp8RowParallelLinear)
        for name, layer in pl_module.named_modules():  # before the first step (and CUDA graphs' capture)
            if isinstance(layer, fp8_classes) and any(part in name for part in self.bf16_linears):
                layer.fp8 = False  # the instance's flag: this linear takes the bf16 path
                self.unquantized.append(name)
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.values.append(float(outputs["loss"]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", choices=["none", "hybrid", "e4m3"], default="none")
    p.add_argument("--shape", default="1b", choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234, help="MegatronStrategy(seed=): the initial weights")
    p.add_argument("--cuda-graphs", action="store_true", help="ModelConfig(cuda_graphs=True)")
    # A probe of where fp8's loss gap comes from (not an option of the package):
    p.add_argument("--bf16-linears", default="", help="comma-separated name parts (e.g. fc2,proj): those in bf16")
    args = p.parse_args()

    torch.manual_seed(0)
    fp8 = None if args.fp8 == "none" else args.fp8
    config = ModelConfig(
        **SHAPES[args.shape],
        vocab_size=256,
        seq_length=args.seq_length,
        fp8=fp8,
        cuda_graphs=args.cuda_graphs,
    )
    module = MegatronLMModule(config, lr=3e-4, warmup_steps=20, decay_steps=args.steps)
    batch = args.micro_batch_size * args.micro_batches
    data = ByteCorpusDataModule(seq_length=args.seq_length, batch_size=batch, max_bytes=40_000_000, num_val_batches=8)
    losses = Losses(args.bf16_linears.split(",") if args.bf16_linears else [])
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=args.steps, logger=False,
        strategy=MegatronStrategy(micro_batch_size=args.micro_batch_size, seed=args.seed), callbacks=[losses],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        val_check_interval=args.steps, check_val_every_n_epoch=None, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, data)
    elapsed = time.perf_counter() - losses.start
    values = losses.values
    print(
        "RESULT " + json.dumps({
            "fp8": args.fp8, "cuda_graphs": args.cuda_graphs, "seed": args.seed, "shape": args.shape,
            "steps": len(values),
            "micro_batch": f"{args.micro_batch_size}x"
            f"{args.micro_batches}", "seq": args.seq_length, "fp8_layers": module.fp8,
            "grad_dtype": {"none": None, "hybrid": "e5m2", "e4m3": "e4m3"}[args.fp8],
            "bf16_linears": len(losses.unquantized),
            "loss_every_50": {i + 1: round(values[i], 4) for i in range(49, len(values), 50)},
            "last10_mean": round(sum(values[-10:]) / 10, 4),
            "val_loss": round(float(trainer.callback_metrics["val_loss"]), 4),
            "tokens_per_s_incl_warmup": round(len(values) * batch * args.seq_length / elapsed),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "gpu": torch.cuda.get_device_name(),
        }),
        flush=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
