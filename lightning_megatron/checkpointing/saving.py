"""Writing a sharded checkpoint: crash-safe publish, checksums, one writer per checkpoint, failures that name a cause.

Every rank writes its shards into ``<name>.partial`` through Megatron's ``dist_checkpointing`` (synchronously, or in
the rank's background writer process, :mod:`.write_process`); ``<name>.partial`` is renamed to ``<name>`` only once
every rank has finished, every shard file has its checksums (:mod:`.checksums`, recorded by the writer that wrote
it), and the small metadata files have theirs. A run killed mid-save leaves the previous checkpoint intact.

While rank 0 writes a checkpoint it holds an exclusive lock on ``<name>.lock`` beside it, so a second run saving the
same checkpoint at the same time fails at once, naming the first, instead of both deleting each other's files.

A failed save raises ``OSError`` naming the checkpoint and the cause (e.g. no space left on the device), keeps
every older checkpoint, and removes the incomplete ``.partial`` directory (freeing its space).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import queue
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron.checkpointing import checksums

if TYPE_CHECKING:
    from lightning_megatron.checkpointing.background import BackgroundSaves

PARTIAL_SUFFIX = ".partial"
_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER_ERRORS = "writer_errors_{rank}.txt"


class PendingSave:
    """A save handed to Megatron's background writers, until it is published (or failed)."""

    def __init__(self, partial: Path, path: Path, lock: WriterLock) -> None:
        self.partial, self.path, self.lock = partial, path, lock

    def failed(self, error: BaseException) -> OSError:
        """The error to raise for this save's failure; removes the ``.partial`` directory (rank 0)."""
        return _failure(error, self.partial, self.path, self.lock)


def save(
    state: dict[str, Any], path: str | Path, background: BackgroundSaves | None = None, strategy: Any | None = None,
    validate: bool = True, timings: dict[str, float] | None = None,
) -> PendingSave | None:  # fmt: skip
    """Collective: every rank writes its shards of ``state`` (sharded tensors + common objects) to ``path``.

    ``strategy``: Megatron's save strategy (default: a fresh one; :class:`.plans.SavePlans` keeps one per structure,
    with its cached plan); ``validate``: check that the shards cover every tensor exactly once (a new structure);
    ``timings`` receives the seconds spent planning (``plan_s``) and, for a synchronous save, writing (``write_s``:
    shards, checksums, publish).

    With ``background`` (:class:`.background.BackgroundSaves`) the shards are written by this rank's writer process
    and the publish (checksum check, rename) is the last finalisation step, run on every rank by
    ``background.finalize`` once every rank's writer is done; the returned :class:`PendingSave` names the save if
    that raises.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    rank = torch.distributed.get_rank()
    lock = _prepare(partial, rank)
    timings = {} if timings is None else timings
    start = time.perf_counter()
    try:
        request = dist_checkpointing.save(
            state, str(partial), sharded_strategy=strategy, validate_access_integrity=validate,
            async_sharded_save=True, async_strategy="mcore",
        )  # fmt: skip
        assert isinstance(request, AsyncRequest), type(request)
        if request.async_fn is not None:  # None: this rank writes no file. Checksums recorded while writing:
            request = request._replace(async_fn=functools.partial(_write, request.async_fn, partial, rank))
        request.add_finalize_fn(lambda: _publish(partial, path, lock))  # after Megatron's metadata.json finaliser
        timings["plan_s"] = time.perf_counter() - start
        if background is None:
            with _without_zip_crc32():
                request.execute_sync()
            timings["write_s"] = time.perf_counter() - start - timings["plan_s"]
            return None
        background.schedule(request)  # the writer process writes without the zip CRC-32 too
    except (Exception, CheckpointException) as error:
        raise _failure(error, partial, path, lock) from error
    except BaseException:  # e.g. KeyboardInterrupt: the lock must not outlive the save in this process
        lock.release()
        raise
    return PendingSave(partial, path, lock)


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each zip record, while Megatron's writer writes the shards.

    Computing it caps ``torch.save`` at a fraction of a disk's write speed (one core, well under 1 GB/s), and it
    is redundant here: every shard file gets our own CRC-32 per 64 KiB block (:mod:`.checksums`), verified before
    every load. ``torch.load`` reads records without it (torch does not check it when reading). The async writer
    process (:mod:`.write_process`) turns it off for itself."""
    import torch.serialization

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _prepare(partial: Path, rank: int) -> WriterLock:
    """Rank 0 takes the checkpoint's lock and makes an empty ``.partial`` directory; a failure raises everywhere."""
    lock = WriterLock(partial)
    status: list[BaseException | None] = [None]
    if rank == 0:
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            _remove(partial)  # left by a run killed while saving, or an older checkpoint swapped out
            partial.mkdir()
        except RuntimeError as error:  # another writer
            status = [error]
        except OSError as error:
            lock.release()
            status = [OSError(error.errno, f"cannot create checkpoint directory {partial}: {error}")]
    # Tell the other ranks instead of leaving them in the next collective.
    torch.distributed.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise status[0]
    return lock


def _write(write: Any, directory: Path, rank: int, *args: Any, **kwargs: Any) -> None:
    """Megatron's writer function, with the checksums of what it writes (in the writer process for async saves).

    Megatron's writer threads report a failure only by logging it (the exception it passes on names the exception
    type alone), so the log records are kept: in ``writer_errors_<rank>.txt``, which :func:`_failure` reads."""
    errors = _Records()
    logger = logging.getLogger(_WRITER_LOGGER)
    logger.addHandler(errors)
    try:
        with checksums.Recorder(directory, rank) as recorder:  # checksums computed while the files are written
            write(*args, **kwargs)
            if errors.messages:
                recorder.discard()
        if errors.messages:
            (directory / _WRITER_ERRORS.format(rank=rank)).write_text("\n".join(errors.messages))
    except OSError as error:  # e.g. this rank's checksums file on a full disk
        # This rank's write failed: report it as Megatron's writer reports one, in the results queue (the last
        # argument), so that every rank raises it at Megatron's finaliser -- raised here, on this rank alone, the
        # others would wait in the finaliser's gather until the timeout.
        results = args[-1]
        with contextlib.suppress(queue.Empty):
            results.get_nowait()
        results.put(error)
    finally:
        logger.removeHandler(errors)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _publish(partial: Path, path: Path, lock: WriterLock) -> None:
    torch.distributed.barrier()  # every rank's shards are on disk
    status: list[str | None] = [None]
    if torch.distributed.get_rank() == 0:
        try:
            checksums.check_complete(partial)
            checksums.record_metadata(partial)
            replace_directory(partial, path)
        except (OSError, ValueError) as error:
            status = [f"{type(error).__name__}: {error}"]
        finally:
            lock.release()
    torch.distributed.broadcast_object_list(status, src=0)  # also the second barrier: published on every rank
    if status[0] is not None:
        raise OSError(f"checkpoint {path} was written but not published ({status[0]}); older checkpoints are intact")


def replace_directory(new: Path, path: Path) -> None:
    """``new`` takes the name ``path``. A checkpoint already there (``last.ckpt``) is swapped out in one step where
    the kernel can (``renameat2(RENAME_EXCHANGE)``: Linux, most local filesystems), so that a crash at any moment
    leaves a complete checkpoint under the name, then removed from ``new``'s name (a ``.partial`` left by a crash
    there is never loaded, and the next save of it clears it); elsewhere it is renamed to ``<name>.old`` first."""
    if not new.is_dir():
        raise FileNotFoundError(f"{new} is not a directory: nothing to publish as {path}")
    if (path.exists() or path.is_symlink()) and _exchange(new, path):
        _remove(new)
        return
    old = path.with_name(path.name + ".old")
    _remove(old)
    if path.exists() or path.is_symlink():
        path.rename(old)
    new.rename(path)
    _remove(old)


def _remove(path: Path) -> None:
    """Remove ``path`` if it is there: a directory with its contents, or a file or link (``save_last="link"``)."""
    if path.is_symlink() or path.is_file():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False where the kernel or filesystem cannot (nothing changed)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return renameat2(at_cwd, os.fsencode(a.absolute()), at_cwd, os.fsencode(b.absolute()), exchange) == 0


@functools.cache
def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _failure(error: BaseException, partial: Path, path: Path, lock: WriterLock) -> OSError:
    """``OSError`` naming the failed save's cause; rank 0 removes its ``.partial`` directory and lock."""
    written = _writer_errors(partial)
    causes = [*_causes(error), *written]
    if isinstance(error, CheckpointException) and _distributed():
        # Raised on every rank at once (torch DCP and Megatron agree on failures collectively), but Megatron's
        # finaliser gives every rank's cause to rank 0 alone: the others would name none.
        shared = [causes]
        torch.distributed.broadcast_object_list(shared, src=0)
        causes = list(dict.fromkeys([*shared[0], *written]))
    no_space = any("No space left" in cause or f"Errno {errno.ENOSPC}]" in cause for cause in causes)
    free = "unknown"
    with contextlib.suppress(OSError):
        free_bytes = shutil.disk_usage(partial.parent).free
        no_space, free = no_space or free_bytes < (1 << 20), f"{free_bytes / 2**30:.2f} GiB"
    if no_space:
        reason = f"no space left on the device of {partial.parent} ({free} free after the attempt)"
    else:
        reason = "; ".join(dict.fromkeys(causes)) or f"{type(error).__name__}: {error}"
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        lock.release()
    return OSError(
        errno.ENOSPC if no_space else errno.EIO,
        f"writing checkpoint {path} failed: {reason}. Older checkpoints are intact; the incomplete {partial.name} "
        "was removed",
    )


def _distributed() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _causes(error: BaseException) -> list[str]:
    """One line per root cause of ``error``: through torch DCP's per-rank failures and explicit causes (``raise ...
    from``), not the exception being handled when it happened (a save in ``on_exception`` fails during that)."""
    found: list[str] = []
    pending: list[tuple[str, BaseException]] = [("", error)]
    while pending:
        where, current = pending.pop()
        if isinstance(current, CheckpointException):
            pending += [(f"rank {rank}: ", failure[0]) for rank, failure in current.failures.items()]
        elif current.__cause__ is not None:
            pending.append((where, current.__cause__))
        else:
            found.append(f"{where}{type(current).__name__}: {current}")
    return found


def _writer_errors(partial: Path) -> list[str]:
    lines = []
    for file in sorted(partial.glob(_WRITER_ERRORS.format(rank="*"))):
        rank = file.stem.rsplit("_", 1)[-1]
        with contextlib.suppress(OSError):
            lines += [f"rank {rank}: {line}" for line in file.read_text().splitlines() if line]
    return lines


class WriterLock:
    """An exclusive lock (``flock``) on ``<name>.lock`` beside a checkpoint while rank 0 writes it.

    Held from the start of a save until it is published (or fails): a second process saving the same checkpoint
    raises ``RuntimeError`` naming the holder (host, pid, since when). The operating system releases it when the
    process dies, so a crashed run never blocks the next one. On a filesystem without ``flock`` there is no lock.
    """

    def __init__(self, partial: Path) -> None:
        self.file = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 1000).decode(errors="replace") or "another process"
                os.close(fd)
                raise RuntimeError(
                    f"checkpoint {self.file.with_suffix('')} is being written by {holder} right now: two runs are "
                    "saving the same checkpoint. Give each run its own ModelCheckpoint(dirpath=...) (or "
                    "default_root_dir)"
                ) from None
            except OSError:  # no flock on this filesystem: go on without a lock
                os.close(fd)
                return
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(self.file).st_ino:
                    break
            os.close(fd)  # the holder removed the file after we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} (since {time.strftime('%H:%M:%S')})".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.file.unlink()
        os.close(self._fd)
        self._fd = None
