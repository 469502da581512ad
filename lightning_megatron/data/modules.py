"""LightningDataModules: the embedded default corpus (:class:`ByteCorpusDataModule`, byte-level, built from the
installed packages' sources) and pre-tokenized token files (:class:`TokenFileDataModule`)."""

from __future__ import annotations

import os

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler

from lightning_megatron.data.corpus import demo_dataloaders
from lightning_megatron.data.packing import PackedTokenRows, pack_token_file
from lightning_megatron.data.tokens import TokenWindows, check_dtype, open_tokens
from lightning_megatron.parallel.state import data_parallel_rank_and_size
from lightning_megatron.validation import check_positive_int


class ByteCorpusDataModule(L.LightningDataModule):
    """Packed byte-level sequences of the Python sources of lightning and megatron-core (nothing downloaded).

    Lightning shards the training set by Megatron's data-parallel rank (the strategy supplies the sampler's rank
    and size), so tensor- and pipeline-parallel peers read the same samples.

    Args:
        seq_length: tokens (bytes) per sample; must equal the model's ``seq_length``.
        batch_size: samples per optimizer step on each data-parallel rank (split into micro-batches).
        max_bytes: size of the corpus built from the installed packages.
        val_fraction: tail fraction of the corpus held out for validation.
        num_val_batches: cap on validation batches (``None``: the whole held-out part).
    """

    def __init__(
        self,
        seq_length: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        num_val_batches: int | None = 4,
    ) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_val_batches = num_val_batches
        self._loaders: tuple[DataLoader, DataLoader] | None = None

    def setup(self, stage: str) -> None:
        if self._loaders is None:
            self._loaders = demo_dataloaders(
                seq_length=self.seq_length, batch_size=self.batch_size, max_bytes=self.max_bytes,
                val_fraction=self.val_fraction, num_val_batches=self.num_val_batches,
            )  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        assert self._loaders is not None, "setup() builds the loaders"
        return self._loaders[0]

    def val_dataloader(self) -> DataLoader:
        assert self._loaders is not None, "setup() builds the loaders"
        return self._loaders[1]


class TokenFileDataModule(L.LightningDataModule):
    """Fixed-length windows of a pre-tokenized file (numpy memmap), the last ``val_fraction`` held out.

    Samples are bare LongTensors ``[seq_length]`` (``input_ids``; the module derives next-token labels). Windows
    do not overlap and the file's trailing ``len % seq_length`` tokens are dropped. Each split gets a
    ``DistributedSampler`` over Megatron's *data-parallel* rank and size (not the global ones): tensor-, pipeline-
    and context-parallel peers read the same windows, data-parallel ranks disjoint ones; each rank drops the
    ``len % dp_size`` windows that would not split evenly rather than repeating some. Lightning leaves a loader
    that already has a ``DistributedSampler`` alone (its own injected sampler, built from
    ``MegatronStrategy.distributed_sampler_kwargs``, would shard the same way but always shuffles training data
    and pads splits with repeated samples).

    Args:
        path: the token file (``.bin`` raw ids or ``.npy``).
        seq_length: tokens per sample; must equal the model's ``seq_length``.
        batch_size: samples per optimizer step on each data-parallel rank (split into micro-batches).
        dtype: element type of a raw ``.bin`` file (``.npy`` files carry theirs).
        val_fraction: tail fraction of the windows held out for validation.
        num_val_batches: cap on validation batches per data-parallel rank (``None``: the whole held-out part).
        shuffle: shuffle the training windows each epoch (the same permutation on every rank, then sharded).
        seed: shuffling seed; ``None`` takes ``seed_everything``'s (``PL_GLOBAL_SEED``) or 0, as Lightning does.
        num_workers: DataLoader worker processes.
        pin_memory: page-locked batches, whose copy to the GPU does not wait for the GPU's queued work (a
            pageable copy does, and then exposes the host's per-step work); ``None``: when training on CUDA.
        packed: pack whole documents instead of cutting fixed windows: the file is split after every ``eos_id``
            (documents longer than ``seq_length`` into pieces), documents are packed first-fit into rows of
            ``seq_length`` and samples are dicts of ``input_ids``/``position_ids``/``labels`` (Hugging Face's
            flattening convention: attention and loss stay inside each document). Needs ``kernels='torch'``.
        eos_id: the token id that ends each document (with ``packed=True``); also pads the rows' ends.
    """

    def __init__(
        self,
        path: str,
        seq_length: int,
        batch_size: int = 8,
        dtype: str = "uint16",
        val_fraction: float = 0.01,
        num_val_batches: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        packed: bool = False,
        eos_id: int | None = None,
    ) -> None:
        super().__init__()
        if packed and eos_id is None:
            raise ValueError("packed=True needs eos_id: the token id that ends each document of the file")
        if eos_id is not None and not packed:
            raise ValueError(f"eos_id={eos_id} only applies with packed=True (fixed windows ignore documents)")
        check_positive_int("seq_length", seq_length)
        check_positive_int("batch_size", batch_size)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1) (the held-out tail of the windows)")
        if num_val_batches is not None and num_val_batches < 1:
            raise ValueError(f"num_val_batches={num_val_batches} must be positive or None (the whole split)")
        check_dtype(dtype)
        self.path, self.seq_length, self.batch_size, self.dtype = path, seq_length, batch_size, dtype
        self.val_fraction, self.num_val_batches = val_fraction, num_val_batches
        self.shuffle, self.seed, self.num_workers, self.pin_memory = shuffle, seed, num_workers, pin_memory
        self.packed, self.eos_id = packed, eos_id
        self.train_set: TokenWindows | PackedTokenRows | None = None
        self.val_set: TokenWindows | PackedTokenRows | None = None

    def setup(self, stage: str) -> None:
        rows = pack_token_file(self.path, self.dtype, self.seq_length, self.eos_id) if self.packed else None
        windows = len(rows) if rows is not None else len(open_tokens(self.path, self.dtype)) // self.seq_length
        num_val = round(windows * self.val_fraction)
        num_train = windows - num_val
        _, dp_size = data_parallel_rank_and_size()
        if min(num_val, num_train) < self.batch_size * dp_size:
            raise ValueError(
                f"path={self.path!r} holds {windows} {'packed rows' if self.packed else 'windows'} of seq_length="
                f"{self.seq_length}: {num_train} train and "
                f"{num_val} val at val_fraction={self.val_fraction}; each split needs batch_size={self.batch_size} x "
                f"{dp_size} data-parallel ranks (use a larger file, a smaller batch_size or another val_fraction)"
            )
        if self.num_val_batches is not None:
            num_val = min(num_val, self.num_val_batches * self.batch_size * dp_size)
        if rows is not None:
            self.train_set, self.val_set = rows.split(0, num_train), rows.split(num_train, num_val)
            return
        self.train_set = TokenWindows(self.path, self.dtype, self.seq_length, 0, num_train)
        self.val_set = TokenWindows(self.path, self.dtype, self.seq_length, num_train, num_val)

    def _loader(self, dataset: TokenWindows | PackedTokenRows | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() builds the datasets"
        rank, size = data_parallel_rank_and_size()
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        # drop_last: every batch must split into micro-batches of the strategy's micro_batch_size.
        return DataLoader(
            dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers,
            pin_memory=self._pin_memory(),
        )  # fmt: skip

    def _pin_memory(self) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)
