"""Iterable and streaming data sharded by the data-parallel rank, so that a model replica's ranks read alike.

Map-style datasets need nothing: Lightning builds their ``DistributedSampler`` from the strategy's
``distributed_sampler_kwargs`` (data-parallel rank and size). Iterable datasets shard themselves, usually by the
global rank -- right under DDP, wrong under model parallelism, where tensor-, pipeline- and context-parallel peers
must read the same samples. :class:`DataParallelShard` shards any iterable dataset by the data-parallel rank, and
:func:`bind_data_parallel` (the strategy's ``process_dataloader``) points it, and LitData's ``StreamingDataset``, at
the run's data-parallel rank and size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_megatron.parallel.state import data_parallel_rank_and_size


class DataParallelShard(IterableDataset):
    """Every ``size``-th sample of ``dataset``, starting at data-parallel rank ``rank``; each DataLoader worker of
    the rank takes every ``num_workers``-th of those. Only whole rounds (``size x num_workers`` samples) are dealt, so
    every rank gets as many samples, hence as many batches: a rank with one batch more would wait alone in its
    step's collectives. ``dataset`` must yield the same samples in the same order on every rank and in every worker
    (a dataset that splits itself over DataLoader workers, as Hugging Face's and LitData's do, would be split twice:
    wrap it only with ``num_workers=0``, or let it shard itself by the data-parallel rank).

    Args:
        dataset: any iterable of samples.
        rank: data-parallel rank; ``None``: the strategy's (``MegatronStrategy.data_parallel_rank``), set when the
            DataLoader is handed to a Trainer.
        size: data-parallel size; ``None`` likewise.
    """

    def __init__(self, dataset: Any, rank: int | None = None, size: int | None = None) -> None:
        if (rank is None) != (size is None) or (size is not None and not 0 <= rank < size):  # type: ignore[operator]
            raise ValueError(f"DataParallelShard(rank={rank}, size={size}) needs both or neither, 0 <= rank < size")
        self.dataset = dataset
        self.rank = rank
        self.size = size
        self.bound: tuple[int, int] | None = None
        """The strategy's (rank, size), set by :func:`bind_data_parallel` for each run (``rank``/``size`` win)."""

    def _rank_and_size(self) -> tuple[int, int]:
        if self.size is not None:
            return self.rank, self.size  # type: ignore[return-value]
        if self.bound is not None:
            return self.bound
        rank, size = data_parallel_rank_and_size()
        if size == 1 and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "DataParallelShard has no data-parallel rank: its DataLoader was not handed to a MegatronStrategy "
                "Trainer; pass DataParallelShard(dataset, rank=..., size=...) to use it elsewhere"
            )
        return rank, size

    def __iter__(self) -> Iterator[Any]:
        rank, size = self._rank_and_size()
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        stride, offset = size * workers, worker_id * size + rank  # rank r: samples r, r + size, ...; split by worker
        mine = None
        for index, sample in enumerate(self.dataset):
            if index % stride == offset:
                mine = sample
            if index % stride == stride - 1:  # a whole round: every rank and worker has its sample
                yield mine


def bind_data_parallel(dataloader: Any, rank: int, size: int, num_nodes: int = 1) -> None:
    """Point the loader's :class:`DataParallelShard` and LitData ``StreamingDataset`` (s) at data-parallel
    rank ``rank`` of ``size``, before any iteration (DataLoader workers get the dataset as set here).

    LitData detects the global rank and world size when a ``StreamingDataset`` is built; its public attribute
    ``distributed_env`` is replaced by the data-parallel view (same class), so its chunks are dealt to data-parallel
    ranks instead.
    """
    for dataset in _datasets(getattr(dataloader, "dataset", None)):
        if isinstance(dataset, DataParallelShard):
            dataset.bound = (rank, size)
        env = getattr(dataset, "distributed_env", None)
        if env is not None and type(env).__module__.startswith("litdata"):
            nodes = num_nodes if size % num_nodes == 0 else 1
            dataset.distributed_env = type(env)(world_size=size, global_rank=rank, num_nodes=nodes)


def _datasets(dataset: Any) -> list[Any]:
    """``dataset`` and what it combines (LitData's CombinedStreamingDataset keeps its parts in ``_datasets``)."""
    if dataset is None:
        return []
    parts = getattr(dataset, "datasets", None) or getattr(dataset, "_datasets", None) or []
    return [dataset, *(d for part in parts for d in _datasets(part))] if isinstance(parts, list | tuple) else [dataset]
