"""Train a small byte-level GPT with Megatron parallelism inside Lightning's Trainer.

    python examples/train_lm.py                          # CPU, 2 processes, tensor parallel (tp=2)
    python examples/train_lm.py --devices 4 --tp 2 --pp 2
    python examples/train_lm.py --accelerator gpu --devices 2 --pp 2

The text is the Python source of the installed lightning/megatron-core packages (built at run time, nothing is
downloaded), tokenised as bytes.
"""

from __future__ import annotations

import argparse

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig
from lightning_megatron.data.corpus import VOCAB_SIZE, demo_dataloaders


class PrintLoss(L.Callback):
    """One line every ``every`` steps on rank 0 (the logged values are identical on every rank)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step % self.every == 0 and trainer.is_global_zero:
            m = trainer.callback_metrics
            print(f"step {trainer.global_step:4d}  train_loss {float(m['train_loss']):.3f}  lr {float(m['lr']):.2e}")

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if trainer.is_global_zero and not trainer.sanity_checking:
            print(f"step {trainer.global_step:4d}  val_loss {float(trainer.callback_metrics['val_loss']):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank, per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--ckpt-dir", default=None, help="save sharded checkpoints here every 50 steps")
    p.add_argument("--resume", default=None, help="a checkpoint directory to resume from (any layout)")
    args = p.parse_args()

    config = ModelConfig(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=352,
        vocab_size=VOCAB_SIZE, seq_length=args.seq_length,
    )  # fmt: skip
    model = MegatronLMModule(config, lr=2e-3, min_lr=2e-4, warmup_steps=min(10, args.max_steps // 5))
    strategy = MegatronStrategy(tp=args.tp, pp=args.pp, vpp=args.vpp, micro_batch_size=args.micro_batch_size)
    callbacks: list[L.Callback] = [PrintLoss(every=10)]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=50, save_top_k=-1))
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        val_check_interval=50, limit_val_batches=4, check_val_every_n_epoch=None, callbacks=callbacks,
        enable_progress_bar=False, enable_checkpointing=bool(args.ckpt_dir), logger=False,
    )  # fmt: skip
    train, val = demo_dataloaders(seq_length=args.seq_length, batch_size=args.batch_size, max_bytes=4_000_000)
    trainer.fit(model, train, val, ckpt_path=args.resume)


if __name__ == "__main__":  # required: Lightning's launcher and Megatron's checkpoint writer start processes
    main()
