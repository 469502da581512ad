"""Packing variable-length documents into fixed-length rows, in Hugging Face's flattening convention.

A packed row holds several documents one after the other: ``input_ids`` [S], ``position_ids`` [S] restarting at 0
where each document starts, ``labels`` [S] with -100 at each document's first token (what
``transformers.DataCollatorWithFlattening`` emits). The space left at a row's end is one padding document
(``pad_id`` tokens, positions from 0, labels -100, ``attention_mask`` 0): it attends only to itself and adds nothing
to the loss.
MegatronLMModule then attends within documents only, so the loss equals that of the documents run alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_megatron.contract import IGNORE_INDEX
from lightning_megatron.data.tokens import open_tokens


def first_fit(lengths: Sequence[int], row_length: int, window: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``row_length`` tokens: each item goes to the first row
    with room for it, in the given order (a new row when none has). With ``window``, only the ``window`` most
    recently opened rows are candidates (linear time for big files; older rows are closed as they are)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if length > row_length:
            raise ValueError(
                f"document {index} has {length} tokens, more than row_length={row_length}; truncate or split it "
                "first, or pack into longer rows"
            )
        if length < 1:
            raise ValueError(f"document {index} is empty; drop empty documents before packing")
        first = 0 if window is None else max(0, len(rows) - window)
        for row in range(first, len(rows)):
            if room[row] >= length:
                rows[row].append(index)
                room[row] -= length
                break
        else:
            rows.append([index])
            room.append(row_length - length)
    return rows


def packed_row(documents: Sequence[Tensor], row_length: int, pad_id: int = 0) -> dict[str, Tensor]:
    """One row ``{"input_ids", "position_ids", "labels", "attention_mask"}`` [row_length] holding ``documents``
    (1-D LongTensors); ``attention_mask`` is 0 on the padding (what value losses and token budgets read)."""
    lengths = [len(d) for d in documents]
    pad = row_length - sum(lengths)
    if pad < 0:
        raise ValueError(f"documents of {sum(lengths)} tokens do not fit a row of {row_length}")
    parts = [torch.as_tensor(d, dtype=torch.long) for d in documents]
    if pad:
        parts.append(torch.full((pad,), pad_id, dtype=torch.long))
        lengths.append(pad)
    input_ids = torch.cat(parts)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX  # no document predicts the first token of the next
    attention_mask = torch.ones(row_length, dtype=torch.long)
    if pad:
        labels[-pad:] = IGNORE_INDEX
        attention_mask[-pad:] = 0
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "attention_mask": attention_mask}


def pack_sequences(
    sequences: Iterable[Sequence[int] | Tensor | np.ndarray], row_length: int, pad_id: int = 0, window: int | None = 256
) -> list[dict[str, Tensor]]:
    """Pack variable-length token sequences into rows of ``row_length`` tokens (first-fit, in order, among the
    ``window`` most recently opened rows -- linear time; ``None``: all rows).

    Returns a list of rows (a map-style dataset: ``DataLoader(pack_sequences(...), batch_size=B)`` gives batches
    of ``input_ids``/``position_ids``/``labels`` [B, row_length]). Every document lands whole in one row; one longer
    than ``row_length`` raises.
    """
    documents = [torch.as_tensor(np.asarray(s), dtype=torch.long).flatten() for s in sequences]
    groups = first_fit([len(d) for d in documents], row_length, window)
    return [packed_row([documents[i] for i in group], row_length, pad_id) for group in groups]


class PackedTokenRows(Dataset[dict[str, Tensor]]):
    """Packed rows of a token file whose documents end with an EOS id; each row is a list of ``(start, stop)`` spans
    of the file, read when asked for. The memmap is opened lazily in each process and never pickled."""

    def __init__(self, path: str, dtype: str, rows: list[list[tuple[int, int]]], row_length: int, pad_id: int) -> None:
        self.path, self.dtype, self.rows, self.row_length, self.pad_id = path, dtype, rows, row_length, pad_id
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if self._tokens is None:
            self._tokens = open_tokens(self.path, self.dtype)
        documents = [torch.from_numpy(self._tokens[a:b].astype(np.int64)) for a, b in self.rows[index]]
        return packed_row(documents, self.row_length, self.pad_id)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def split(self, first: int, count: int) -> PackedTokenRows:
        """The rows ``first .. first + count - 1`` as a dataset of their own."""
        return PackedTokenRows(self.path, self.dtype, self.rows[first : first + count], self.row_length, self.pad_id)


def document_spans(tokens: np.ndarray, eos_id: int, max_length: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of every document of ``tokens`` (each ends with ``eos_id``; a trailing one may not), with
    documents longer than ``max_length`` cut into pieces of at most ``max_length``."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    bounds = np.unique(np.concatenate([[0], ends, [len(tokens)]]).astype(np.int64))
    spans: list[tuple[int, int]] = []
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        spans.extend((s, min(s + max_length, stop)) for s in range(start, stop, max_length))
    return spans


def pack_token_file(path: str, dtype: str, row_length: int, eos_id: int, pad_id: int | None = None) -> PackedTokenRows:
    """Every document of a token file packed into rows of ``row_length`` (first-fit among the 256 most recent
    rows); ``pad_id`` defaults to ``eos_id``."""
    spans = document_spans(open_tokens(path, dtype), eos_id, row_length)
    groups = first_fit([stop - start for start, stop in spans], row_length, window=256)
    rows = [[spans[i] for i in group] for group in groups]
    return PackedTokenRows(path, dtype, rows, row_length, eos_id if pad_id is None else pad_id)
