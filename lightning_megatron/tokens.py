"""Pre-tokenized corpora: a flat file of token ids read through a numpy memmap, packed into fixed windows.

A token file is a 1-D array of token ids: raw ``.bin`` (``uint16`` for vocabularies up to 65,536, ``uint32``
above) or a ``.npy``. Nothing is loaded into memory: each sample is a slice of the memmap, so a corpus of any
size costs only the pages the current batches touch.

Write one with ``python -m lightning_megatron.tokens INPUT... --out tokens.bin`` (byte-level ids by default, or
a local Hugging Face tokenizer with ``--tokenizer DIR``).

Sharding: :class:`TokenFileDataModule` gives each split a ``DistributedSampler`` over Megatron's *data-parallel*
rank and size (not the global ones): tensor-, pipeline- and context-parallel peers read the same windows,
data-parallel ranks disjoint ones. Lightning leaves a loader that already has a ``DistributedSampler`` alone
(its own injected sampler, built from ``MegatronStrategy.distributed_sampler_kwargs``, would shard the same way
but always shuffles training data and pads splits with repeated samples).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron import parallel

__all__ = ["TokenFileDataModule", "TokenWindows", "open_tokens", "write_token_file"]

_DTYPES = ("uint16", "uint32", "int32", "int64")


def _check_dtype(dtype: str) -> np.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a token dtype; use one of {_DTYPES} (uint16 for vocab <= 65536)")
    return np.dtype(dtype)


def open_tokens(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """The token ids of ``path`` as a read-only memmap: ``.npy`` files carry their dtype, raw files use ``dtype``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r} is not a file; write one with python -m lightning_megatron.tokens")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.name not in _DTYPES:
            raise ValueError(f"path={str(path)!r} holds {tokens.dtype}{list(tokens.shape)}; need a 1-D {_DTYPES} array")
        return tokens
    item = _check_dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0:  # mmap cannot map an empty file
        raise ValueError(f"path={str(path)!r} is empty; it holds no tokens")
    if size % item:
        raise ValueError(f"path={str(path)!r}: {size} bytes is not a multiple of {item} (dtype={dtype!r}); wrong dtype")
    return np.memmap(path, dtype=dtype, mode="r")


class TokenWindows(Dataset[torch.Tensor]):
    """Windows ``[start + i*S, start + (i+1)*S)`` of a token file for ``i`` in ``range(len(self))``, as int64.

    The memmap is opened lazily in each process (DataLoader workers included) and never pickled: pickling a memmap
    would copy the whole file.
    """

    def __init__(self, path: str | Path, dtype: str, seq_length: int, first: int, count: int) -> None:
        self.path, self.dtype, self.seq_length = str(path), dtype, seq_length
        self.first, self.count = first, count
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self.count <= index < self.count:
            raise IndexError(f"window {index} out of range for {self.count} windows")
        if self._tokens is None:
            self._tokens = open_tokens(self.path, self.dtype)
        start = (self.first + index % self.count) * self.seq_length
        return torch.from_numpy(self._tokens[start : start + self.seq_length].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def data_parallel_rank_and_size() -> tuple[int, int]:
    """Megatron's data-parallel rank and size while a ``MegatronStrategy`` runs; ``(0, 1)`` outside a run."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel.data_parallel_rank_and_size()


class TokenFileDataModule(L.LightningDataModule):
    """Fixed-length windows of a pre-tokenized file (numpy memmap), the last ``val_fraction`` held out.

    Samples are bare LongTensors ``[seq_length]`` (``input_ids``; the module derives next-token labels). Windows
    do not overlap and the file's trailing ``len % seq_length`` tokens are dropped. Both splits are sharded by
    Megatron's data-parallel rank (see the module docstring); each rank drops the ``len % dp_size`` windows that
    would not split evenly rather than repeating some.

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
    ) -> None:
        super().__init__()
        for name, value in (("seq_length", seq_length), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1) (the held-out tail of the windows)")
        if num_val_batches is not None and num_val_batches < 1:
            raise ValueError(f"num_val_batches={num_val_batches} must be positive or None (the whole split)")
        _check_dtype(dtype)
        self.path, self.seq_length, self.batch_size, self.dtype = path, seq_length, batch_size, dtype
        self.val_fraction, self.num_val_batches = val_fraction, num_val_batches
        self.shuffle, self.seed, self.num_workers, self.pin_memory = shuffle, seed, num_workers, pin_memory
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def setup(self, stage: str) -> None:
        windows = len(open_tokens(self.path, self.dtype)) // self.seq_length
        num_val = round(windows * self.val_fraction)
        num_train = windows - num_val
        _, dp_size = data_parallel_rank_and_size()
        if min(num_val, num_train) < self.batch_size * dp_size:
            raise ValueError(
                f"path={self.path!r} holds {windows} windows of seq_length={self.seq_length}: {num_train} train and "
                f"{num_val} val at val_fraction={self.val_fraction}; each split needs batch_size={self.batch_size} x "
                f"{dp_size} data-parallel ranks (use a larger file, a smaller batch_size or another val_fraction)"
            )
        if self.num_val_batches is not None:
            num_val = min(num_val, self.num_val_batches * self.batch_size * dp_size)
        self.train_set = TokenWindows(self.path, self.dtype, self.seq_length, 0, num_train)
        self.val_set = TokenWindows(self.path, self.dtype, self.seq_length, num_train, num_val)

    def _loader(self, dataset: TokenWindows | None, shuffle: bool) -> DataLoader:
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


def write_token_file(documents: Iterable[np.ndarray | Sequence[int]], path: str | Path, dtype: str = "uint16") -> int:
    """Write the documents' token ids, one after the other, as a raw token file; return the token count.

    Documents are streamed (one in memory at a time) into ``<path>.partial``, renamed when complete, so a
    crashed run never leaves a truncated corpus under the real name.
    """
    np_dtype = _check_dtype(dtype)
    path = Path(path)
    if path.suffix == ".npy":
        raise ValueError(f"path={str(path)!r}: write raw ids (e.g. tokens.bin); .npy files are read, not written")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    total = 0
    with partial.open("wb") as out:
        for doc in documents:
            ids = np.asarray(doc, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np_dtype).max):
                raise ValueError(f"token id {int(ids.max())} does not fit dtype={dtype!r}; use uint32")
            out.write(ids.astype(np_dtype).tobytes())
            total += ids.size
    partial.replace(path)
    return total


def _documents(inputs: Sequence[str], tokenizer: str | None) -> Iterable[np.ndarray]:
    """Byte ids (separated by ``\\n\\n``) or a local HF tokenizer's ids (each document ends with its EOS)."""
    if tokenizer is None:
        for i, name in enumerate(inputs):
            yield np.frombuffer((b"\n\n" if i else b"") + Path(name).read_bytes(), dtype=np.uint8)
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    for name in inputs:
        ids = tok(Path(name).read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        yield np.asarray([*ids, *([tok.eos_token_id] if tok.eos_token_id is not None else [])])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.tokens", description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help="text files, one document each")
    parser.add_argument("--out", required=True, help="the token file to write (raw ids, e.g. tokens.bin)")
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer directory (default: byte-level ids)")
    parser.add_argument("--dtype", default="uint16", choices=_DTYPES)
    args = parser.parse_args(argv)
    count = write_token_file(_documents(args.inputs, args.tokenizer), args.out, args.dtype)
    print(f"wrote {count} tokens ({args.dtype}) to {args.out}")


if __name__ == "__main__":
    main()
