"""Data paths and gradient accumulation under model parallelism: several short fits in one launch of the ranks.

``main(args)`` runs ``args["runs"]`` one after another in the same processes (one launch: the ranks' start-up, ~15 s
of CPU each, is paid once), each ``{"name", "strategy": {...}, "data": <path>, "batch_size", "accumulate", ...}``,
and rank 0 writes ``{name: {"train": [losses], "lr": [...], "steps": global_step, "weights": checksum} or
{"error": "ValueError: ..."}}`` to ``args["out"]``.

Data paths (``data``): ``map_ordered`` (a tensor dataset sharded by a ``DistributedSampler`` of the data-parallel
rank, without shuffling), ``global_rank`` (an iterable
sharded by the global rank, the DDP habit), ``dp_shard`` (``DataParallelShard``), ``hf`` (Hugging Face ``datasets``
streaming, ``split_dataset_by_node`` by the data-parallel rank), ``litdata`` (LitData's ``StreamingDataset`` of an
optimized copy of the samples in ``args["litdata_dir"]``).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.data.sharding import DataParallelShard

SAMPLES = 32


def samples() -> torch.Tensor:
    data = synthetic_tokens(SAMPLES, 32, 256, seed=1)
    data[:, 16:] = data[:, :16]  # learnable: the second half repeats the first
    return data


class GlobalRankShard(IterableDataset):
    """The usual DDP habit: every ``world_size``-th sample from ``trainer.global_rank``."""

    def __init__(self, data: torch.Tensor, rank: int, world: int) -> None:
        self.data, self.rank, self.world = data, rank, world

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from self.data[self.rank :: self.world]


class Rows(IterableDataset):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from self.data


def _loader(kind: str, batch_size: int, trainer: L.Trainer, strategy: MegatronStrategy, args: dict) -> Any:
    data = samples()
    if kind == "map_ordered":  # the data-parallel rank's samples in order: what the iterable kinds read
        sampler = DistributedSampler(
            data, num_replicas=strategy.data_parallel_size, rank=strategy.data_parallel_rank, shuffle=False
        )
        return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    if kind == "global_rank":
        return DataLoader(GlobalRankShard(data, trainer.global_rank, trainer.world_size), batch_size=batch_size)
    if kind == "dp_shard":
        return DataLoader(DataParallelShard(Rows(data)), batch_size=batch_size)
    if kind == "hf":
        from datasets import Dataset
        from datasets.distributed import split_dataset_by_node

        stream = Dataset.from_dict({"input_ids": data.tolist()}).to_iterable_dataset(num_shards=1)
        rank, size = strategy.data_parallel_rank, strategy.data_parallel_size
        stream = split_dataset_by_node(stream, rank=rank, world_size=size).with_format("torch")
        return DataLoader(stream, batch_size=batch_size)
    if kind == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        dataset = StreamingDataset(args["litdata_dir"], shuffle=False, drop_last=True)
        return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0)
    raise ValueError(kind)


class Record(L.Callback):
    def __init__(self) -> None:
        self.train: list[float] = []
        self.lr: list[float] = []
        self.norm: list[float] = []
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches += 1
        if "train_loss" in trainer.callback_metrics and len(self.train) < trainer.global_step:
            self.train.append(float(trainer.callback_metrics["train_loss"]))
            self.lr.append(float(trainer.callback_metrics["lr"]))
            self.norm.append(float(trainer.callback_metrics["grad_norm"]))


def _weights(model: MegatronLMModule) -> list[float]:
    """Each rank's sum of squared weights (its shards), for comparing two runs of the same layout."""
    local = float(sum(param.detach().double().square().sum() for param in model.parameters()))
    every = [0.0] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, local)
    return every


def run(spec: dict, args: dict) -> dict:
    strategy = MegatronStrategy(micro_batch_size=spec.get("micro_batch_size", 1), **spec.get("strategy", {}))
    record = Record()
    callbacks: list = [record]
    if spec.get("ckpt_dir"):  # a checkpoint every 2 steps, to resume from
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(spec["ckpt_dir"], "{step}", every_n_train_steps=2, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=args["devices"], strategy=strategy, max_steps=spec.get("max_steps", 2),
        accumulate_grad_batches=spec.get("accumulate", 1), callbacks=callbacks, logger=False,
        enable_checkpointing=bool(spec.get("ckpt_dir")), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    model = MegatronLMModule(tiny_gpt(), lr=3e-3, warmup_steps=1, decay_steps=8)

    class Data(L.LightningDataModule):
        def train_dataloader(self) -> Any:
            return _loader(spec["data"], spec["batch_size"], trainer, strategy, args)

    try:
        trainer.fit(model, datamodule=Data(), ckpt_path=spec.get("resume"))
    except Exception as error:  # noqa: BLE001  (the error is the result)
        return {"error": f"{type(error).__name__}: {error}", "batches": record.batches}
    return {
        "train": record.train, "lr": record.lr, "grad_norm": record.norm, "steps": trainer.global_step,
        "batches": record.batches, "weights": _weights(model),
    }  # fmt: skip


def write_litdata(directory: str) -> None:
    """An optimized LitData dataset of :func:`samples` (one process, no workers)."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(directory, chunk_size=8)
    for index, row in enumerate(samples()):
        writer.add_item(index, row)
    writer.done()
    writer.merge()


def main(args: dict) -> None:
    results, rank = {}, 0
    for spec in args["runs"]:
        try:
            results[spec["name"]] = run(spec, args)
        except Exception:  # noqa: BLE001
            results[spec["name"]] = {"crash": traceback.format_exc()[-3000:]}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        with open(args["out"], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
