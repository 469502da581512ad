"""Checkpoint reads in several threads per rank (lightning_megatron/checkpointing/load/reading.py), below the
strategy: the read plan's split, and a torch DCP checkpoint read by threads equal to torch's own read."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_megatron.checkpointing.load.reading import ThreadedReader, split


def _saved(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(n, 8) for i, n in enumerate([300, 5, 40, 1000, 64, 1, 700, 120])}
    state["ints"] = torch.arange(17)
    dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return state


def _read_plan(path: Path) -> tuple[FileSystemReader, list]:
    """torch's reader of the checkpoint at ``path`` (set up) and the read items of all its entries."""
    reader = FileSystemReader(str(path))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    plan = [
        item
        for fqn, meta in metadata.state_dict_metadata.items()
        for item in create_read_items_for_chunk_list(fqn, meta, meta.chunks)
    ]
    return reader, plan


def test_the_plan_splits_into_runs_of_about_equal_bytes(tmp_path: Path) -> None:
    _saved(tmp_path)
    reader, plan = _read_plan(tmp_path)
    sizes = {id(i): reader.storage_data[i.storage_index].length for i in plan}
    for parts in (1, 2, 3, 4, 50):
        runs = split(plan, reader.storage_data, parts)
        assert 1 <= len(runs) <= min(parts, len(plan))
        assert all(runs)
        flat = [item for run in runs for item in run]
        assert sorted(map(id, flat)) == sorted(map(id, plan))  # every entry once
        offsets = [(reader.storage_data[i.storage_index].relative_path, reader.storage_data[i.storage_index].offset)
                   for i in flat]  # fmt: skip
        assert offsets == sorted(offsets)  # runs of neighbouring entries
        if parts in (2, 3):
            total, biggest = sum(sizes.values()), max(sizes.values())
            for run in runs:  # each run within one entry of its share
                assert abs(sum(sizes[id(i)] for i in run) - total / parts) <= biggest
    assert split([], reader.storage_data, 4) == []


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_read_what_torch_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    state = _saved(tmp_path)
    seen: list[str] = []
    read_data = FileSystemReader.read_data

    def recording(self: FileSystemReader, plan: object, planner: object) -> object:
        seen.append(threading.current_thread().name)
        return read_data(self, plan, planner)  # type: ignore[arg-type]

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = ThreadedReader(str(tmp_path), threads)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        torch.testing.assert_close(target[key], value, rtol=0, atol=0)
    assert reader.parts_read == threads
    assert len(seen) == threads  # one read per part: in the pool's threads (one part: in the caller's)
    assert all(name.startswith("checkpoint-read") for name in seen) == (threads > 1)


def test_an_error_in_one_part_is_raised_once_every_part_stopped(tmp_path: Path) -> None:
    state = _saved(tmp_path)
    reader, plan = _read_plan(tmp_path)
    runs = split(plan, reader.storage_data, 3)
    assert len(runs) == 3
    broken = reader.storage_data[runs[0][0].storage_index]  # the first run's first entry: its container's header
    shard = tmp_path / broken.relative_path
    blob = bytearray(shard.read_bytes())
    blob[broken.offset : broken.offset + 4] = b"XXXX"
    shard.write_bytes(bytes(blob))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CheckpointException):  # torch's error for the entry (which depends on the damage), gathered
        dcp.load(target, storage_reader=ThreadedReader(str(tmp_path), 3), no_dist=True)
    for item in runs[-1]:  # the other parts were read to their end
        name = item.dest_index.fqn
        torch.testing.assert_close(target[name], state[name], rtol=0, atol=0)
