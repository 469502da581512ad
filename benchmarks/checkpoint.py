"""What a checkpoint costs through the public API, and the checksums' share of it.

    python benchmarks/checkpoint.py --out /scratch/ckpt --commit $(git rev-parse --short HEAD)   # 1 GPU, 1.0B
    python benchmarks/checkpoint.py --out /tmp/ckpt --cpu --shape tiny

One process, three fits of ``Trainer`` + ``MegatronStrategy`` + ``MegatronLMModule`` (Adam, distributed optimizer):
(1) a synchronous ``trainer.save_checkpoint`` in the middle of training: the time that step is blocked; (2) the same
with ``async_save=True``: the blocked time and the time until the checkpoint is published (renamed into place by the
strategy between steps); (3) ``trainer.fit(ckpt_path=...)`` from (1): the time from ``on_fit_start`` to
``on_train_start``, which holds the load (and its checksum verification). Then, on the checkpoint of (1) alone:
recording its checksums again (what each rank's writer does after writing) and verifying them (what every load does
first), and the disk's own write speed (``--disk-probe-gib`` written and fsynced in the same directory).
Each measurement prints one JSON line; ``normal_step_s`` is the mean step time before the save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

SHAPES = {
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the checkpoints (emptied first)")
    p.add_argument("--shape", default="1b", choices=list(SHAPES))
    p.add_argument("--cpu", action="store_true", help="run on the CPU (fp32), e.g. with --shape tiny")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--save-at", type=int, default=5, help="the step after which the checkpoint is saved")
    p.add_argument("--max-wait-steps", type=int, default=200, help="async: steps to wait for the publish at most")
    p.add_argument("--disk-probe-gib", type=float, default=2.0)
    p.add_argument("--commit", default=None, help="the code's git commit, copied into every row")
    return p.parse_args()


class SaveOnce(L.Callback):
    """Times the steps before the save, the save's blocked time, and (async) when the checkpoint appears."""

    def __init__(self, path: Path, at: int, cuda: bool) -> None:
        super().__init__()
        self.path, self.at, self.cuda = path, at, cuda
        self.step_start = 0.0
        self.step_times: list[float] = []
        self.saved_at: float | None = None
        self.result: dict[str, Any] = {}

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.step_start = self._now()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        now = self._now()
        if self.saved_at is None and trainer.global_step > 1:  # the first steps compile and warm up
            self.step_times.append(now - self.step_start)
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)
            self.saved_at, done = now, self._now()
            self.result = {"save_blocked_s": done - now, "normal_step_s": sum(self.step_times) / len(self.step_times)}
        if self.saved_at is not None and "published_after_s" not in self.result and self.path.exists():
            steps = trainer.global_step - self.at  # published by the strategy at a step's start: seen at its end
            self.result |= {"published_after_s": now - self.saved_at, "published_after_steps": steps}
            trainer.should_stop = True


class LoadTimer(L.Callback):
    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda
        self.result: dict[str, float] = {}

    def on_fit_start(self, trainer: Any, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_start(self, trainer: Any, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.result = {"resume_load_s": time.perf_counter() - self.start}


def fit(
    args: argparse.Namespace, callback: L.Callback, steps: int, async_save: bool, ckpt_path: Path | None = None
) -> None:
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig
    from lightning_megatron.data.corpus import synthetic_tokens

    config = ModelConfig(**SHAPES[args.shape], vocab_size=32000, seq_length=args.seq_length)
    batch = args.micro_batch_size * args.micro_batches
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else "gpu", devices=1, precision="32-true" if args.cpu else "bf16-mixed",
        strategy=MegatronStrategy(micro_batch_size=args.micro_batch_size, async_save=async_save), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback], num_sanity_val_steps=0,
    )  # fmt: skip
    data = synthetic_tokens(batch * steps, args.seq_length, 32000)
    trainer.fit(MegatronLMModule(config, lr=1e-4, decay_steps=1000), DataLoader(data, batch_size=batch),
                ckpt_path=ckpt_path)  # fmt: skip
    del trainer
    if not args.cpu:
        torch.cuda.empty_cache()


def checksum_costs(path: Path) -> dict[str, float]:
    from lightning_megatron.checkpointing import checksums
    from lightning_megatron.checkpointing.checks import read_metadata

    start = time.perf_counter()
    checksums.record(path, rank=0)
    recorded = time.perf_counter()
    checksums.verify(path, read_metadata(path))
    return {"checksum_record_s": recorded - start, "checksum_verify_s": time.perf_counter() - recorded}


def disk_write_speed(directory: Path, gib: float) -> dict[str, float]:
    probe, block = directory / "disk_probe", os.urandom(64 << 20)
    blocks = max(1, int(gib * 1024 / 64))
    start = time.perf_counter()
    with open(probe, "wb", buffering=0) as f:
        for _ in range(blocks):
            f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    probe.unlink()
    return {"disk_write_gb_s": blocks * len(block) / seconds / 1e9, "disk_probe_bytes": blocks * len(block)}


def main() -> None:
    args = parse()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    common = {"shape": args.shape, "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "commit": args.commit}
    sync = SaveOnce(args.out / "sync.ckpt", args.save_at, cuda=not args.cpu)
    fit(args, sync, args.save_at + 1, async_save=False)
    size = sum(f.stat().st_size for f in (args.out / "sync.ckpt").iterdir())
    print(json.dumps({**common, "mode": "sync", "checkpoint_bytes": size, **sync.result}), flush=True)
    saver = SaveOnce(args.out / "async.ckpt", args.save_at, cuda=not args.cpu)
    fit(args, saver, args.save_at + args.max_wait_steps, async_save=True)
    print(json.dumps({**common, "mode": "async", **saver.result}), flush=True)
    load = LoadTimer(cuda=not args.cpu)
    fit(args, load, args.save_at + 1, async_save=False, ckpt_path=args.out / "sync.ckpt")
    print(json.dumps({**common, "mode": "resume", "checkpoint_bytes": size, **load.result}), flush=True)
    costs = checksum_costs(args.out / "sync.ckpt")
    rates = {f"{k.removesuffix('_s')}_gb_s": size / v / 1e9 for k, v in costs.items()}
    print(json.dumps({**common, "mode": "checksums", "checkpoint_bytes": size, **costs, **rates}), flush=True)
    print(json.dumps({**common, "mode": "disk", **disk_write_speed(args.out, args.disk_probe_gib)}), flush=True)


if __name__ == "__main__":
    main()
