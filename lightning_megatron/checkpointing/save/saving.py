"""Writing a sharded checkpoint: crash-safe publish, checksums, one writer per checkpoint, failures that name a cause.

Every rank writes its shards into ``<name>.partial`` through Megatron's ``dist_checkpointing`` (synchronously, or in
the rank's background writer process, :mod:`.write_process`); ``<name>.partial`` is renamed to ``<name>`` only once
every rank has finished, every shard file has its checksums (:mod:`.checksums`, recorded by the writer that wrote
it), and the small metadata files have theirs. A run killed mid-save leaves the previous checkpoint intact.

While rank 0 writes a checkpoint it holds an exclusive lock on ``<name>.lock`` beside it, so a second run saving the
same checkpoint at the same time fails at once, naming the first, instead of both deleting each other's files.

A failed save raises ``OSError`` naming the checkpoint and the cause on every rank (a write the system refused, by
its errno: no space left, a quota, a file-size limit, a read-only filesystem, an I/O error), keeps every older
checkpoint, and removes the incomplete ``.partial`` directory (freeing its space).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import queue
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron.checkpointing.integrity import checksums

if TYPE_CHECKING:
    from lightning_megatron.checkpointing.save.background import BackgroundSaves

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
    type alone), so the log records are kept: in ``writer_errors_<rank>.txt``, which :func:`_failure` reads. A write
    the operating system refused (a full disk, a quota, a file-size limit, ...) is reported with its ``OSError``
    instead: inside ``torch.save`` it surfaces as torch's "unexpected pos ..." alone, its errno lost."""
    errors = _Records()
    refused: list[OSError] = []
    logger = logging.getLogger(_WRITER_LOGGER)
    logger.addHandler(errors)
    try:
        with checksums.Recorder(directory, rank) as recorder:  # checksums computed while the files are written
            try:
                _keeping_refusals(write, refused)(*args, **kwargs)
            except Exception:  # (Megatron's own error, e.g. an assertion on a failed worker: the refusal says more)
                if not refused:
                    raise
            if errors.messages or refused:
                recorder.discard()
        if refused:  # a refused write lost data, whatever Megatron made of it
            raise refused[0]
        if errors.messages:
            (directory / _WRITER_ERRORS.format(rank=rank)).write_text("\n".join(errors.messages))
    except OSError as error:  # e.g. a refused write, or this rank's checksums file on a full disk
        # This rank's write failed: report it as Megatron's writer reports one, in the results queue (the last
        # argument), so that every rank raises it at Megatron's finaliser -- raised here, on this rank alone, the
        # others would wait in the finaliser's gather until the timeout. Its message, "[Errno N] ...", travels to
        # rank 0 with the other ranks' failures (exceptions pickle without their __cause__).
        results = args[-1]
        with contextlib.suppress(queue.Empty):
            results.get_nowait()
        results.put(error)
    finally:
        logger.removeHandler(errors)


def _keeping_refusals(write: Any, refused: list[OSError]) -> Any:
    """Megatron's write function (``partial(write_preloaded_data_multithread, transform_list, ...)``), each shard
    stream it writes through appending the ``OSError`` of a write that fails to ``refused``; unchanged if it does not
    have that form (the cause is then named as Megatron logs it)."""
    if not (isinstance(write, functools.partial) and write.args and isinstance(write.args[0], list)):
        return write
    transforms = [_RefusalTransforms(transform, refused) for transform in write.args[0]]
    return functools.partial(write.func, transforms, *write.args[1:], **write.keywords)


class _RefusalTransforms:
    """torch DCP's stream transforms (the stream each item is written through), the stream watched for refusals.
    (A save calls ``transform_save_stream`` alone; the stream it returns is written, flushed and closed.)"""

    def __init__(self, transforms: Any, refused: list[OSError]) -> None:
        self._transforms, self._refused = transforms, refused

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> tuple[Any, list[str]]:
        stream, descriptors = self._transforms.transform_save_stream(write_item, raw_stream)
        return _RefusalStream(stream, getattr(raw_stream, "name", None), self._refused), descriptors


class _RefusalStream:
    def __init__(self, stream: Any, file: str | None, refused: list[OSError]) -> None:
        self._stream, self._file, self._refused = stream, file, refused

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as error:
            del data  # (see _note)
            raise self._note(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise self._note(error) from None

    def close(self) -> None:
        try:
            self._stream.close()
        except OSError as error:
            raise self._note(error) from None

    def _note(self, error: OSError) -> OSError:
        """Record ``error`` (naming the shard file); return it without its traceback. Its frames hold the item
        written (Megatron writes a byte item as ``BytesIO.getbuffer()``), and Megatron keeps the exception in a
        reference cycle: Python 3.12.1's garbage collector crashes (SIGSEGV) on a memoryview of a BytesIO in a
        cycle (CPython gh-111211, fixed in 3.12.2)."""
        named = error if error.errno is None or error.filename else OSError(error.errno, error.strerror, self._file)
        self._refused.append(named)
        return error.with_traceback(None)


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
    """``OSError`` naming the failed save's cause (its ``errno`` that of the refused write, if one was: a full disk,
    a quota, a file-size limit, a read-only filesystem, an I/O error); rank 0 removes its ``.partial`` directory and
    lock."""
    written = _writer_errors(partial)
    causes = [*_causes(error), *written]
    if isinstance(error, CheckpointException) and _distributed():
        # Raised on every rank at once (torch DCP and Megatron agree on failures collectively), but Megatron's
        # finaliser gives every rank's cause to rank 0 alone: the others would name none.
        shared = [causes]
        torch.distributed.broadcast_object_list(shared, src=0)
        causes = list(dict.fromkeys([*shared[0], *written]))
    code = _refused_errno(causes)
    free = "unknown"
    with contextlib.suppress(OSError):
        free_bytes = shutil.disk_usage(partial.parent).free
        code, free = code or (errno.ENOSPC if free_bytes < (1 << 20) else None), f"{free_bytes / 2**30:.2f} GiB"
    if code == errno.ENOSPC:
        reason = f"no space left on the device of {partial.parent} ({free} free after the attempt)"
    elif code is not None:
        reason = _refusal(code, causes)
    else:
        reason = "; ".join(dict.fromkeys(causes)) or f"{type(error).__name__}: {error}"
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        lock.release()
    return OSError(
        code or errno.EIO,
        f"writing checkpoint {path} failed: {reason}. Older checkpoints are intact; the incomplete {partial.name} "
        "was removed",
    )


_REFUSALS = {  # errno: what it means, what to do (ENOSPC has a message of its own, with the space left)
    errno.ENOSPC: ("no space left on the device", "free space or save elsewhere"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota, have it raised, or save elsewhere "
                   "(ModelCheckpoint(dirpath=...))"),
    errno.EFBIG: ("file too large", "a shard file outgrew the largest file this filesystem or the process's "
                  "file-size limit (ulimit -f) allows: raise the limit or save to another filesystem"),
    errno.EROFS: ("read-only file system", "save to a writable directory (ModelCheckpoint(dirpath=...))"),
    errno.EIO: ("input/output error", "the storage failed: check its device or server (the kernel log) before "
                "saving there again"),
}  # fmt: skip


def _refused_errno(causes: list[str]) -> int | None:
    """The errno of :data:`_REFUSALS` that ``causes`` (lines of messages, e.g. ``"rank 1: OSError: [Errno 122] Disk
    quota exceeded: ..."``) name, the first in that order; None if none does."""
    for code in _REFUSALS:
        if any(f"[Errno {code}]" in cause or os.strerror(code) in cause for cause in causes):
            return code
    return None


def _refusal(code: int, causes: list[str]) -> str:
    """E.g. "file too large (EFBIG: [Errno 27] File too large: '.../__0_0.distcp') on rank 0: <what to do>"."""
    named = [cause for cause in causes if f"[Errno {code}]" in cause or os.strerror(code) in cause]
    ranks = sorted({int(m.group(1)) for m in map(_RANK.match, named) if m is not None})
    details = [cause[cause.find("[Errno") :] if "[Errno" in cause else _RANK.sub("", cause, count=1) for cause in named]
    where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    meaning, advice = _REFUSALS[code]
    return f"{meaning} ({errno.errorcode[code]}: {'; '.join(dict.fromkeys(details))}){where}: {advice}"


_RANK = re.compile(r"rank (\d+): ")


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
    A symlink or hard link found in its place is replaced, never written through.
    """

    def __init__(self, partial: Path) -> None:
        self.file = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX) + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        replaced = False  # a planted hard link, once (a filesystem may count links oddly: no endless replacing)
        while True:
            fd = self._open()
            if fd is None:
                continue
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
                if os.fstat(fd).st_ino == os.stat(self.file, follow_symlinks=False).st_ino:
                    if os.fstat(fd).st_nlink <= 1 or replaced:
                        break
                    # A hard link planted as the lock: the holder written below would overwrite another file.
                    self.file.unlink()
                    replaced = True
            os.close(fd)  # the holder removed the file after we opened it (or we did): lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} (since {time.strftime('%H:%M:%S')})".encode())
        self._fd = fd

    def _open(self) -> int | None:
        """The lock file, opened without following a symlink: one planted there (the holder written into it would
        overwrite its target, anywhere) is removed -- the link, never its target -- and a new file created. None
        if another process created one first (open it again)."""
        try:
            return os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.EMLINK):  # a symlink (EMLINK: FreeBSD's word for it)
                raise
        with contextlib.suppress(FileNotFoundError):
            self.file.unlink()
        try:
            return os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.file.unlink()
        os.close(self._fd)
        self._fd = None
