"""What a checkpoint costs through the public API, where the time goes, and the disk's own speed beside it.

    python benchmarks/checkpoint.py --out /scratch/ckpt --commit $(git rev-parse --short HEAD)   # 1 GPU, 1.0B
    python benchmarks/checkpoint.py --out /tmp/ckpt --cpu --shape tiny

One process, fits of ``Trainer`` + ``MegatronStrategy`` + ``MegatronLMModule`` (Adam, distributed optimizer):
(1) ``--saves`` synchronous ``trainer.save_checkpoint`` calls during training, each once the previous one is
published: the time each blocks the step and its timeline (``timeline``: building the state and copying it to host
buffers, planning, writing); before the second, Megatron's own build of the optimizer state beside ours;
(2) the same with ``async_save=True``: the blocked time and the time until each checkpoint is published (renamed
into place by the strategy between steps); (3) ``trainer.fit(ckpt_path=...)`` from the first checkpoint of (1),
from the disk (its pages dropped from the page cache) and again from the page cache: the time from
``on_fit_start`` to ``on_train_start``, which holds the load (and its checksum verification), with the load's
timeline (``CheckpointWriter.last_load``), for each ``--read-threads`` value (these fits have no checkpoint
callback, so the load allocates the host buffers it reads into; a resume with ``ModelCheckpoint`` allocates them
in ``setup``, before ``on_fit_start``, and its load reuses them). Then, on that
checkpoint: recording its checksums again and verifying them, and the disk's own write (fsynced) and read speed
(on as many bytes as the checkpoint holds, or ``--disk-probe-gib``, in the same directory: a disk may write a
short burst faster than it sustains), measured before the saves too (``probe``: ``before`` and ``after``: a cloud
disk's speed drifts within a run, and the two bracket it). ``--no-model-weights``: checkpoints without the
model's copy of the trained weights (``CheckpointConfig(save_model_weights=False)``). Each measurement prints one
JSON line; ``normal_step_s`` is the mean step time before the first save. The host buffers are staged when each fit
starts (``prestaged`` in its first row); the first save of a structure plans, the second verifies the plan, the
third on reuse it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: benchmarks.*
from benchmarks.table_rows import VOCAB, llama_parameters  # noqa: E402

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
    p.add_argument("--saves", type=int, default=3, help="saves per mode (the plan is reused from the third on)")
    p.add_argument("--max-wait-steps", type=int, default=400, help="steps to wait for the saves at most")
    p.add_argument(
        "--disk-probe-gib", type=float, default=None,
        help="GiB the disk speed is measured on (default: the checkpoint's size; 2 without a save)",
    )  # fmt: skip
    p.add_argument(
        "--read-threads", type=lambda text: [int(n) for n in text.split(",")], default=None,
        help="CheckpointConfig.read_threads of the resumes, e.g. 1,8: each value's cold and warm resume (default: "
        "the strategy's)",
    )  # fmt: skip
    p.add_argument("--commit", default=None, help="the code's git commit, copied into every row")
    p.add_argument(
        "--modes", type=lambda text: text.split(","), default=["sync", "async", "resume", "checksums", "disk"],
        help="what to measure (default: sync,async,resume,checksums,disk; resume and checksums need sync)",
    )  # fmt: skip
    p.add_argument(
        "--no-model-weights", dest="model_weights", action="store_false",
        help="CheckpointConfig(save_model_weights=False): the trained weights stored only as fp32 main weights",
    )  # fmt: skip
    return p.parse_args()


class Saves(Checkpoint):
    """Saves ``count`` checkpoints from step ``at`` on, each once the previous one is published (the older one then
    removed), timing the steps before, each save's blocked time and timeline, and (async) when each appears. A
    ``Checkpoint`` callback, as ``ModelCheckpoint`` is: the strategy stages its saves' host buffers when the fit
    starts (``prestaged`` in the first row)."""

    def __init__(self, directory: Path, name: str, at: int, count: int, cuda: bool, time_megatron: bool) -> None:
        super().__init__()
        self.directory, self.name, self.at, self.count, self.cuda = directory, name, at, count, cuda
        self.time_megatron = time_megatron
        self.step_start = 0.0
        self.step_times: list[float] = []
        self.saves: list[dict[str, Any]] = []
        self.pending: tuple[Path, float, int] | None = None  # the save not yet published: path, start, step

    def path(self, index: int) -> Path:
        return self.directory / f"{self.name}{index}.ckpt"

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.step_start = self._now()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        now = self._now()
        if not self.saves and trainer.global_step > 1:  # the first steps compile and warm up
            self.step_times.append(now - self.step_start)
        if self.pending is not None and self.pending[0].exists():  # published by the strategy at a step's start
            path, started, step = self.pending
            self.saves[-1] |= {"published_after_s": now - started, "published_after_steps": trainer.global_step - step}
            self.pending = None
        if trainer.global_step >= self.at and self.pending is None and len(self.saves) < self.count:
            self._save(trainer)
        if len(self.saves) == self.count and self.pending is None:
            trainer.should_stop = True

    def _save(self, trainer: Any) -> None:
        index = len(self.saves)
        # After the first save (a cold one: its plan is new), beside the strategy's host buffers.
        megatron = self._megatron_optimizer_state(trainer) if self.time_megatron and index == 1 else {}
        if index >= 2:  # keep the first (the resume benchmark loads it) and the last
            shutil.rmtree(self.path(index - 1), ignore_errors=True)
        start = self._now()
        trainer.save_checkpoint(self.path(index))
        blocked = self._now() - start
        writer = trainer.strategy.checkpoint_writer
        self.saves.append({"save": index, "save_blocked_s": blocked, "timeline": writer.last_save,
                           "host_buffer_bytes": writer.buffers.bytes, **megatron})  # fmt: skip
        if index == 0:
            self.saves[0]["prestaged"] = writer.prestaged
        self.pending = (self.path(index), start, trainer.global_step)
        if self.path(index).exists():  # a synchronous save: published before it returned
            self.saves[-1] |= {"published_after_s": blocked, "published_after_steps": 0}
            self.pending = None

    def rows(self) -> list[dict[str, Any]]:
        normal = sum(self.step_times) / max(1, len(self.step_times))
        return [{**save, "normal_step_s": normal} for save in self.saves]

    def _megatron_optimizer_state(self, trainer: Any) -> dict[str, float]:
        """Seconds Megatron's own ``sharded_state_dict`` (fully_reshardable) takes to build the optimizer state a
        save writes, against :mod:`lightning_megatron.checkpointing.format.optimizer_state` building it into host
        buffers."""
        from lightning_megatron.checkpointing import sharded
        from lightning_megatron.checkpointing.format.optimizer_state import optimizer_state
        from lightning_megatron.checkpointing.save.staging import HostBuffers

        chunks, optimizer = list(trainer.strategy.module.chunks), trainer.strategy.megatron_optimizer
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        start = self._now()
        state = optimizer.sharded_state_dict(sharded.sharded_state_dict(chunks), metadata=metadata)
        megatron = self._now() - start
        del state
        buffers = HostBuffers()
        times = []
        for _ in range(2):  # the first allocates and pins the host buffers, the second reuses them
            start = self._now()
            buffers.begin()
            state = optimizer_state(optimizer, sharded.sharded_state_dict(chunks), metadata, buffers)
            times.append(self._now() - start)
            del state
        buffers.release()
        return {"megatron_optimizer_state_s": megatron, "optimizer_state_first_s": times[0],
                "optimizer_state_s": times[1]}  # fmt: skip


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
        writer = trainer.strategy.checkpoint_writer
        timeline = {k: round(v, 3) for k, v in writer.last_load.items()}
        self.result = {"resume_load_s": time.perf_counter() - self.start, "read_threads": writer.config.read_threads,
                       "timeline": timeline}  # fmt: skip


def fit(
    args: argparse.Namespace, callback: L.Callback, steps: int, async_save: bool, ckpt_path: Path | None = None,
    read_threads: int | None = None,
) -> None:  # fmt: skip
    from torch.utils.data import DataLoader

    from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, ModelConfig
    from lightning_megatron.data.corpus import synthetic_tokens

    config = ModelConfig(**SHAPES[args.shape], vocab_size=VOCAB, seq_length=args.seq_length)
    batch = args.micro_batch_size * args.micro_batches
    weights = args.model_weights
    checkpoint = CheckpointConfig(async_save=async_save, save_model_weights=weights, read_threads=read_threads)
    strategy = MegatronStrategy(micro_batch_size=args.micro_batch_size, checkpoint=checkpoint)
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else "gpu", devices=1, precision="32-true" if args.cpu else "bf16-mixed",
        strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=isinstance(callback, Checkpoint), enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback], num_sanity_val_steps=0,
    )  # fmt: skip
    data = synthetic_tokens(batch * steps, args.seq_length, VOCAB)
    trainer.fit(MegatronLMModule(config, lr=1e-4, decay_steps=1000), DataLoader(data, batch_size=batch),
                ckpt_path=ckpt_path)  # fmt: skip
    del trainer
    if not args.cpu:
        torch.cuda.empty_cache()


def checksum_costs(path: Path) -> dict[str, float]:
    from lightning_megatron.checkpointing.integrity import checksums
    from lightning_megatron.checkpointing.integrity.checks import read_metadata

    start = time.perf_counter()
    checksums.record(path, rank=0)
    recorded = time.perf_counter()
    checksums.verify(path, read_metadata(path))
    return {"checksum_record_s": recorded - start, "checksum_verify_s": time.perf_counter() - recorded}


def disk_speed(directory: Path, gib: float) -> dict[str, float]:
    """The disk's write (fsynced) and read speed on ``gib`` of data in ``directory``, the read from the disk (the
    file's pages dropped from the page cache first)."""
    probe, block = directory / "disk_probe", os.urandom(64 << 20)
    blocks = max(1, int(gib * 1024 / 64))
    start = time.perf_counter()
    with open(probe, "wb", buffering=0) as f:
        for _ in range(blocks):
            f.write(block)
        os.fsync(f.fileno())
    written = time.perf_counter() - start
    drop_page_cache([probe])
    start = time.perf_counter()
    buffer = bytearray(64 << 20)
    with open(probe, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    read = time.perf_counter() - start
    probe.unlink()
    size = blocks * len(block)
    return {"disk_write_gb_s": size / written / 1e9, "disk_read_gb_s": size / read / 1e9, "disk_probe_bytes": size}


def drop_page_cache(files: list[Path]) -> None:
    """Evict the (written, synced) files' pages from the page cache, so the next read comes from the disk."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    args = parse()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    device, size = "cpu" if args.cpu else torch.cuda.get_device_name(), 0
    common = {"shape": args.shape, "device": device, "commit": args.commit, "model_weights": args.model_weights}
    saving = [m for m in ("sync", "async") if m in args.modes]
    if "disk" in args.modes and saving:
        gib = args.disk_probe_gib or expected_bytes(args) / 2**30
        print(json.dumps({**common, "mode": "disk", "probe": "before", **disk_speed(args.out, gib)}), flush=True)
    for mode in saving:  # a first save (plans), then later ones
        saves = Saves(args.out, mode, args.save_at, args.saves, cuda=not args.cpu, time_megatron=mode == "sync")
        fit(args, saves, args.save_at + args.max_wait_steps, async_save=mode == "async")
        size = sum(f.stat().st_size for f in saves.path(0).iterdir())
        for row in saves.rows():
            print(json.dumps({**common, "mode": mode, "checkpoint_bytes": size, **row}), flush=True)
        for index in range(1 if mode == "sync" else 0, args.saves):  # sync0.ckpt stays for the loads
            shutil.rmtree(saves.path(index), ignore_errors=True)
    if "sync" in args.modes:
        resumes_and_checksums(args, common, size)
    if "disk" in args.modes:
        gib = args.disk_probe_gib or (size / 2**30 if size else 2.0)
        after = {"probe": "after"} if saving else {}
        print(json.dumps({**common, "mode": "disk", **after, **disk_speed(args.out, gib)}), flush=True)


def expected_bytes(args: argparse.Namespace) -> int:
    """The checkpoint's size to expect before any save: per parameter, the fp32 main weight and two fp32 Adam moments,
    and the bf16 weight unless ``--no-model-weights`` (fp32 on the CPU, which keeps no separate main weight: the
    distributed optimizer's state holds a copy of it all the same)."""
    parameters, _ = llama_parameters(**SHAPES[args.shape], vocab_size=VOCAB)
    weight = 0 if not args.model_weights else 4 if args.cpu else 2
    return parameters * (12 + weight)


def resumes_and_checksums(args: argparse.Namespace, common: dict[str, Any], size: int) -> None:
    """Resumes from the first synchronous checkpoint (cold and warm page cache), then its checksums' cost."""
    checkpoint = args.out / "sync0.ckpt"
    shards = sorted(checkpoint.iterdir())
    for threads in (args.read_threads or [None]) if "resume" in args.modes else []:
        for cache in ("cold", "warm"):  # from the disk (pages dropped), then from the page cache
            if cache == "cold":
                drop_page_cache([f for f in shards if f.is_file()])
            load = LoadTimer(cuda=not args.cpu)
            fit(args, load, args.save_at + 1, async_save=False, ckpt_path=checkpoint, read_threads=threads)
            row = {**common, "mode": "resume", "cache": cache, "checkpoint_bytes": size, **load.result}
            print(json.dumps(row), flush=True)
    if "checksums" in args.modes:
        costs = checksum_costs(checkpoint)
        rates = {f"{k.removesuffix('_s')}_gb_s": size / v / 1e9 for k, v in costs.items()}
        print(json.dumps({**common, "mode": "checksums", "checkpoint_bytes": size, **costs, **rates}), flush=True)


if __name__ == "__main__":
    main()
