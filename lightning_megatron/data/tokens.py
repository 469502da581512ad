"""Pre-tokenized corpora: a flat file of token ids read through a numpy memmap, packed into fixed windows.

A token file is a 1-D array of token ids: raw ``.bin`` (``uint16`` for vocabularies up to 65,536, ``uint32``
above) or a ``.npy``. Nothing is loaded into memory: each sample is a slice of the memmap, so a corpus of any
size costs only the pages the current batches touch.

Write one with ``lightning-megatron-tokens INPUT... --out tokens.bin`` (byte-level ids by default,
or a local Hugging Face tokenizer with ``--tokenizer DIR``); train on one with
:class:`~lightning_megatron.data.modules.TokenFileDataModule`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["TokenWindows", "check_dtype", "open_tokens", "write_token_file"]

_DTYPES = ("uint16", "uint32", "int32", "int64")


def check_dtype(dtype: str) -> np.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a token dtype; use one of {_DTYPES} (uint16 for vocab <= 65536)")
    return np.dtype(dtype)


def open_tokens(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """The token ids of ``path`` as a read-only memmap: ``.npy`` files carry their dtype, raw files use ``dtype``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path={str(path)!r} is not a file; write one with lightning-megatron-tokens")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.name not in _DTYPES:
            raise ValueError(f"path={str(path)!r} holds {tokens.dtype}{list(tokens.shape)}; need a 1-D {_DTYPES} array")
        return tokens
    item = check_dtype(dtype).itemsize
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


def write_token_file(documents: Iterable[np.ndarray | Sequence[int]], path: str | Path, dtype: str = "uint16") -> int:
    """Write the documents' token ids, one after the other, as a raw token file; return the token count.

    Documents are streamed (one in memory at a time) into ``<path>.partial``, renamed when complete, so a
    crashed run never leaves a truncated corpus under the real name.
    """
    np_dtype = check_dtype(dtype)
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
    parser = argparse.ArgumentParser(
        prog="lightning-megatron-tokens",
        description="Write text files as one token file for TokenFileDataModule (byte ids, or a local HF tokenizer).",
    )
    parser.add_argument("inputs", nargs="+", help="text files, one document each")
    parser.add_argument("--out", required=True, help="the token file to write (raw ids, e.g. tokens.bin)")
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer directory (default: byte-level ids)")
    parser.add_argument("--dtype", default="uint16", choices=_DTYPES)
    args = parser.parse_args(argv)
    count = write_token_file(_documents(args.inputs, args.tokenizer), args.out, args.dtype)
    print(f"wrote {count} tokens ({args.dtype}) to {args.out}")


if __name__ == "__main__":
    main()
