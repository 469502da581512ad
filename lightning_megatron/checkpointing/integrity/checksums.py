"""Checksums of a checkpoint's shard files: recorded when a rank has written its files, verified before loading.

A flipped bit in a weight or an optimizer moment loads without any other sign (a finite value, the right size), so
every rank records a CRC-32 of each 64 KiB block of the shard files it wrote (``__<rank>_<n>.distcp``, named by
Megatron's writer) in ``checksums_<rank>.json``, right after writing them: in the background writer process for
an async save, so training does not wait for it. Before a checkpoint is published, every shard file must have its
checksums. Loading recomputes those of the entries each rank reads and names the file, the byte range and the
tensors stored there for any block that differs.

They detect damage (disk or transfer errors, a truncated copy, a stray write), not forgery: whoever can rewrite
the shards can rewrite the checksums. Nothing in a checkpoint can run code either way (:mod:`.checks`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SCHEME = "crc32 of 64 KiB blocks"
"""What the checksums are (a checkpoint's common state names it: :mod:`.opening`)."""
BLOCK_BYTES = 1 << 16  # 64 KiB: a damaged block names few tensors; 13 GB of shards make ~2 MB of checksums
_READ_BLOCKS = 256  # blocks read at once (16 MiB)
_FOLLOW_SECONDS = 0.05  # how often the files being written are looked at
_PATTERN = "checksums_{rank}.json"
_SHARD_SUFFIX = ".distcp"
METADATA_TABLE = "metadata_checksums.json"
_METADATA_FILES = (".metadata", "metadata.json")  # torch DCP's index of the shards, Megatron's format marker


def record(directory: Path, rank: int) -> None:
    """Write ``checksums_<rank>.json`` for the shard files ``rank`` wrote into ``directory``."""
    with Recorder(directory, rank, follow=False):
        pass


class Recorder:
    """``with Recorder(directory, rank): <write rank's shard files>`` records their checksums, as :func:`record`
    does after the writes, but mostly while they are written: a thread follows the files as they grow and
    checksums each 64 KiB block once it is complete (read back from the page cache; the writer only appends, so a
    complete block does not change), and the exit checksums what is left and writes ``checksums_<rank>.json`` --
    unless the block raised or called :meth:`discard`, when no table is written."""

    def __init__(self, directory: Path, rank: int, follow: bool = True) -> None:
        self.directory, self.rank = directory, rank
        self._crcs: dict[str, list[int]] = {}
        self._written = threading.Event()
        self._discarded = False
        self._pool = _pool()  # one pool for the whole follow (it starts its threads when first given work)
        self._thread = threading.Thread(target=self._follow, name="checksums", daemon=True) if follow else None

    def __enter__(self) -> Recorder:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._written.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if kind is not None or self._discarded:
                return
            sizes = self._catch_up(final=True)
        finally:
            self._pool.shutdown()
        table = {
            "algorithm": "crc32",
            "block_bytes": BLOCK_BYTES,
            "files": {name: {"size": size, "blocks": self._crcs[name]} for name, size in sizes.items()},
        }
        (self.directory / _PATTERN.format(rank=self.rank)).write_text(json.dumps(table))

    @property
    def blocks(self) -> int:
        """How many blocks have their checksum so far."""
        return sum(len(crcs) for crcs in list(self._crcs.values()))

    def discard(self) -> None:
        """Write no table at the exit (the files are incomplete: the writer reported a failure)."""
        self._discarded = True

    def _follow(self) -> None:
        while not self._written.wait(_FOLLOW_SECONDS):
            try:
                self._catch_up(final=False)
            except OSError:  # e.g. the directory removed by a failed save: the exit finds out
                return

    def _catch_up(self, final: bool) -> dict[str, int]:
        """Checksum the blocks written since the last call (with ``final``: also each file's last, partial block);
        returns each file's size."""
        files = sorted(self.directory.glob(f"*__{self.rank}_*{_SHARD_SUFFIX}"))
        sizes = {file.name: file.stat().st_size for file in files}
        tasks = []
        for file in files:
            done = len(self._crcs.setdefault(file.name, []))
            size = sizes[file.name]
            tasks.append((file, range(done, _ceil(size) if final else size // BLOCK_BYTES)))
        for (file, _), crcs in zip(tasks, _crcs(tasks, self._pool), strict=True):
            self._crcs[file.name].extend(crcs)
        return sizes


def tables(directory: Path) -> list[Path]:
    """The ``checksums_<rank>.json`` files of ``directory``."""
    return sorted(directory.glob(_PATTERN.format(rank="*")))


def read(directory: Path) -> dict[str, dict[str, Any]] | None:
    """Every shard file's recorded ``{"size", "blocks"}`` from all ``checksums_*.json`` of ``directory``; ``None``
    when the checkpoint has no checksums at all (neither those tables nor ``metadata_checksums.json``: written before
    checksums existed, or by another tool). Raises ``ValueError`` for a damaged table."""
    tables_found = tables(directory)
    if not tables_found:
        # Proof of checksums without the shard tables: each shard is then "without recorded checksums" (verify).
        return {} if (directory / METADATA_TABLE).is_file() else None
    files: dict[str, dict[str, Any]] = {}
    for table in tables_found:
        try:
            content = json.loads(table.read_text())
            if content["algorithm"] != "crc32" or content["block_bytes"] != BLOCK_BYTES:
                raise ValueError(f"algorithm {content['algorithm']!r}, blocks of {content['block_bytes']} bytes")
            files.update(content["files"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{table} is damaged or unreadable ({type(error).__name__}: {error})") from error
    return files


def record_metadata(directory: Path) -> None:
    """Record the CRC-32 of the small metadata files (rank 0, once they are written, before publishing)."""
    table = {
        name: zlib.crc32((directory / name).read_bytes()) for name in _METADATA_FILES if (directory / name).is_file()
    }
    (directory / METADATA_TABLE).write_text(json.dumps(table))


def verify_metadata(directory: Path) -> None:
    """Raise ``ValueError`` naming a metadata file that differs from what was written (read before it is parsed)."""
    table_file = directory / METADATA_TABLE
    if not table_file.is_file():
        if tables(directory):  # the shards have checksums: the metadata's were removed
            raise ValueError(
                f"{table_file} is missing while the shards of checkpoint {directory} have checksums: the checkpoint is "
                "damaged (its metadata cannot be verified); restore it from a copy, or resume from another one"
            )
        return  # no checksums at all (read() says so; the load warns)
    try:
        table = json.loads(table_file.read_text())
    except ValueError as error:
        raise ValueError(f"{table_file} is damaged or unreadable ({error})") from error
    for name, crc in table.items():
        file = directory / name
        if file.is_file() and zlib.crc32(file.read_bytes()) != crc:
            raise ValueError(
                f"{file} differs from what was written (checksum): the metadata of checkpoint {directory} is damaged; "
                "resume from another checkpoint (or restore this one from a copy)"
            )


def check_complete(directory: Path) -> None:
    """Raise ``ValueError`` unless every shard file in ``directory`` has checksums (before publishing a save)."""
    recorded = read(directory) or {}
    shards = sorted(p.name for p in directory.glob(f"*{_SHARD_SUFFIX}"))
    if missing := [name for name in shards if name not in recorded]:
        raise ValueError(
            f"no checksums were recorded for {len(missing)} shard file(s) of {directory}, e.g. {missing[:3]} (a "
            "writer failed, or Megatron named its files in a way this version does not know)"
        )


_UNREAD = object()  # verify's default: the checksums table is read by the call


def verify(
    path: Path, metadata: Any, items: Iterable[Any] | None = None, recorded: Any = _UNREAD,
    pool: ThreadPoolExecutor | None = None,
) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the file, byte range and tensors of every block whose checksum differs.

    ``items``: only the blocks holding these entries of ``metadata.storage_data`` (what a load reads; default: all).
    ``recorded``: what :func:`read` returned for ``path`` (default: read here); ``pool``: the threads that compute
    the checksums (default: a pool for this call). A damaged checksum table raises ``ValueError`` too; a checkpoint
    written without checksums passes (there is nothing to compare).
    """
    recorded = read(path) if recorded is _UNREAD else recorded
    if recorded is None:
        return
    wanted = _ranges(metadata, items)
    names = sorted(wanted)
    for name in names:
        if name not in recorded:
            raise ValueError(f"{path / name} has no recorded checksums: checkpoint {path} is damaged (its table lost)")
    problems = _differing(path, {name: recorded[name] for name in names}, wanted, pool)
    if problems:
        raise ValueError(
            f"checkpoint {path} is damaged: " + "; ".join(problems) + ". Resume from another checkpoint (or restore "
            "this one from a copy)"
        )


class Verification:
    """:func:`verify` in a thread of its own, started right away (e.g. while the entries are being read):
    :meth:`wait` joins it and raises what :func:`verify` raised."""

    def __init__(self, path: Path, metadata: Any, items: Iterable[Any]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(path, metadata, list(items)), name="checksums-verify", daemon=True
        )
        self._thread.start()

    def _run(self, path: Path, metadata: Any, items: list[Any]) -> None:
        try:
            if items:
                verify(path, metadata, items)
        except BaseException as error:  # handed to the thread that waits
            self._error = error

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _ranges(metadata: Any, items: Iterable[Any] | None) -> dict[str, list[tuple[int, int, str]]]:
    """``{file: [(offset, end, what)]}`` of the storage entries (all, or ``items``), ``what`` naming the tensor."""
    selected = set(items) if items is not None else None
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        if selected is not None and index not in selected:
            continue
        offset = tuple(index.offset) if index.offset is not None else ()
        what = f"{index.fqn}" + (f" (shard at {offset})" if any(offset) else "")
        start = int(info.offset)
        ranges.setdefault(info.relative_path, []).append((start, start + int(info.length), what))
    return ranges


def _differing(
    path: Path, recorded: dict[str, Any], ranges: dict[str, list[tuple[int, int, str]]], pool: ThreadPoolExecutor | None
) -> list[str]:  # fmt: skip
    """What differs in each file of ``recorded`` (within its ``ranges``) from what was recorded."""
    problems, tasks = [], []
    for name, table in recorded.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif (size := file.stat().st_size) != table["size"]:
            problems.append(f"{name} has {size} bytes, {table['size']} when it was written")
        else:
            blocks = sorted({b for start, end, _ in ranges[name] for b in range(start // BLOCK_BYTES, _ceil(end))})
            tasks.append((file, blocks))
    for (file, blocks), crcs in zip(tasks, _crcs(tasks, pool), strict=True):
        bad = [block for block, crc in zip(blocks, crcs, strict=True) if crc != recorded[file.name]["blocks"][block]]
        if bad:
            problems.append(_describe(file, bad, ranges[file.name]))
    return problems


def _describe(file: Path, bad: list[int], ranges: list[tuple[int, int, str]]) -> str:
    size = file.stat().st_size
    spans = [(b * BLOCK_BYTES, min(size, (b + 1) * BLOCK_BYTES)) for b in bad]
    hit = sorted((start, what) for start, end, what in ranges for lo, hi in spans if start < hi and lo < end)
    tensors = list(dict.fromkeys(what for _, what in hit))  # in file order
    first = spans[0]
    return (
        f"{file.name} differs from what was written in {len(bad)} block(s) of {BLOCK_BYTES >> 10} KiB (first: bytes "
        f"{first[0]}-{first[1]}), which hold {', '.join(tensors[:8])}" + (" and more" if len(tensors) > 8 else "")
    )


def _ceil(end: int) -> int:
    return -(-end // BLOCK_BYTES)


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="checksums")


def _crcs(tasks: Sequence[tuple[Path, Sequence[int]]], pool: ThreadPoolExecutor | None = None) -> list[list[int]]:
    """For each ``(file, ascending block numbers)``: the blocks' CRC-32s. Runs of consecutive blocks are read 16 MiB
    at a time by a pool of threads (``pool``, else one for this call; zlib and file reads release the GIL)."""
    jobs = []  # (task, first block, number of blocks)
    for index, (_, blocks) in enumerate(tasks):
        start = 0
        while start < len(blocks):
            end = start + 1
            while end < len(blocks) and blocks[end] == blocks[end - 1] + 1 and end - start < _READ_BLOCKS:
                end += 1
            jobs.append((index, blocks[start], end - start))
            start = end

    def crc(job: tuple[int, int, int]) -> tuple[int, int, list[int]]:
        index, first, count = job
        buffer = bytearray(count * BLOCK_BYTES)
        with open(tasks[index][0], "rb", buffering=0) as f:
            f.seek(first * BLOCK_BYTES)
            view = memoryview(buffer)[: f.readinto(buffer)]
        return index, first, [zlib.crc32(view[i : i + BLOCK_BYTES]) for i in range(0, len(view), BLOCK_BYTES)]

    found: list[dict[int, int]] = [{} for _ in tasks]
    if not jobs:
        return [[] for _ in tasks]
    with contextlib.nullcontext(pool) if pool is not None else _pool() as threads:
        for index, first, crcs in threads.map(crc, jobs):
            found[index].update(enumerate(crcs, start=first))
    return [[found[index][block] for block in blocks] for index, (_, blocks) in enumerate(tasks)]
