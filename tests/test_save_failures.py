"""A save that meets a hostile or failing filesystem: a symlink planted as its lock file is replaced, never written
through; a write the system refuses (EFBIG past a file-size limit, EDQUOT past a quota, EROFS, EIO) is named by its
errno, on the rank that failed and on its peers, sync and async, and leaves no ``.partial`` behind."""

from __future__ import annotations

import errno
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from lightning_megatron import MegatronStrategy
from lightning_megatron.checkpointing.save import saving, write_process
from lightning_megatron.checkpointing.save.saving import WriterLock
from tests.tiny_gpt_runs import tiny_fit

PRECIOUS = b"someone else's file\n"


def _outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("elsewhere") / "precious.txt"  # not under the checkpoint's tmp_path
    target.write_bytes(PRECIOUS)
    os.utime(target, (1_000_000_000, 1_000_000_000))
    return target


def _unchanged(target: Path) -> bool:
    return target.read_bytes() == PRECIOUS and target.stat().st_mtime == 1_000_000_000


def test_a_symlink_planted_as_the_lock_file_is_replaced_not_written_through(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    target = _outside(tmp_path_factory)
    (tmp_path / "step=2.ckpt.lock").symlink_to(target)
    tiny_fit(2, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, filename="{step}"))
    assert _unchanged(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]  # the link is gone with the lock


@pytest.mark.parametrize("planted", ["symlink", "dangling symlink", "hard link", "stale lock"])
def test_the_lock_replaces_what_was_planted_and_takes_over_a_stale_lock(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, planted: str
) -> None:
    target = _outside(tmp_path_factory)
    lock = WriterLock(tmp_path / "last.ckpt.partial")
    nowhere = target.parent / "created-through-the-link"
    if planted == "symlink":
        lock.file.symlink_to(target)
    elif planted == "dangling symlink":  # following it would create the file it names
        lock.file.symlink_to(nowhere)
    elif planted == "hard link":
        try:
            os.link(target, lock.file)
        except OSError as error:
            pytest.skip(f"no hard links here: {error}")
    else:
        lock.file.write_text("host gone pid 1 (since 00:00:00)")  # left by a killed run
    lock.acquire()
    try:
        assert not lock.file.is_symlink()
        assert lock.file.stat().st_nlink == 1
        assert lock.file.read_text().startswith(f"host {os.uname().nodename} pid {os.getpid()} ")
        assert _unchanged(target)
        assert not nowhere.exists()
        with pytest.raises(RuntimeError, match=rf"is being written by host .* pid {os.getpid()} "):
            WriterLock(tmp_path / "last.ckpt.partial").acquire()  # still held, by this process
    finally:
        lock.release()
    assert not lock.file.exists()
    assert _unchanged(target)


# ---------------------------------------------------------------------------------------------- refused writes
@pytest.mark.parametrize(
    ("async_save", "code", "how"),
    [(False, errno.EFBIG, "errno"), (False, errno.EDQUOT, "errno"), (True, errno.EFBIG, "fsize"),
     (True, errno.EDQUOT, "errno")],
    ids=["sync-EFBIG", "sync-EDQUOT", "async-EFBIG-rlimit", "async-EDQUOT"],
)  # fmt: skip
def test_a_refused_write_is_named_by_its_errno(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, async_save: bool,
    code: int, how: str,
) -> None:  # fmt: skip
    """Step 4's shard writes fail partway, inside torch.save (whose zip writer says only "unexpected pos"): here
    (sync) or in the writer process (async); there for real with ``rlimit``, the writer limited to files of 64 KiB."""
    from tests.full_disk_writer import fill_the_disk

    name = errno.errorcode[code]
    if async_save:
        option = "--fsize=65536" if how == "fsize" else f"--errno={name}"
        monkeypatch.setattr(write_process, "COMMAND", [sys.executable, "-m", "tests.full_disk_writer", option])
    else:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        monkeypatch.setattr(filesystem_async, "_write_item", filesystem_async._write_item)  # restored by undo()
        fill_the_disk(error=code)
    target = _outside(tmp_path_factory)
    (tmp_path / "step=4.ckpt.lock").symlink_to(target)  # the failed save's cleanup must not follow it either
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    strategy = MegatronStrategy(micro_batch_size=2, async_save=async_save)
    meaning = {errno.EFBIG: "file too large", errno.EDQUOT: "disk quota exceeded"}[code]
    cause = rf"{meaning} \({name}: \[Errno {code}\] [^)]*step=4\.ckpt\.partial/__0_0\.distcp'\) on rank 0: "
    with pytest.raises(OSError, match=rf"writing checkpoint .*step=4\.ckpt failed: {cause}") as failed:
        tiny_fit(4, saver, strategy=strategy)
    assert failed.value.errno == code
    assert "unexpected pos" not in str(failed.value)
    assert list(tmp_path.iterdir()) == []  # no .partial, no lock (nor its link), no checkpoint
    assert _unchanged(target)


@pytest.mark.parametrize(
    "code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO], ids=errno.errorcode.get
)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_write_refused_on_rank_1_is_named_by_its_errno_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, rank: int
) -> None:
    """What ``_failure`` gets at Megatron's finaliser when rank 1's write was refused: rank 0 the gathered (pickled:
    without ``__cause__``) failure, which it broadcasts; rank 1 a bare ``CheckpointException`` and that broadcast."""
    refused = OSError(code, os.strerror(code), str(tmp_path / "step=4.ckpt.partial" / "__1_0.distcp"))
    try:
        raise RuntimeError(f"Worker failure: {refused}") from refused  # Megatron's retrieve_write_results
    except RuntimeError as error:
        gathered = pickle.loads(pickle.dumps(_wrap_exception(error)))
    on_rank0 = CheckpointException("write", {1: gathered})
    broadcast: list[list[str]] = []
    monkeypatch.setattr(saving, "_distributed", lambda: True)

    def broadcast_object_list(objects: list, src: int) -> None:
        if rank == 0:
            broadcast.append(objects[0])
        else:
            objects[0] = saving._causes(on_rank0)

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast_object_list)
    partial = tmp_path / "step=4.ckpt.partial"
    error = saving._failure(on_rank0 if rank == 0 else CheckpointException("write", {}), partial,
                            tmp_path / "step=4.ckpt", WriterLock(partial))  # fmt: skip
    assert error.errno == code, error
    if code == errno.ENOSPC:  # named as before, with the space left
        assert "step=4.ckpt failed: no space left on the device of " in str(error), error
    else:
        meaning = saving._REFUSALS[code][0]
        expected = f"step=4.ckpt failed: {meaning} ({errno.errorcode[code]}: {refused}) on rank 1: "
        assert expected in str(error), error
    assert str(error).endswith("Older checkpoints are intact; the incomplete step=4.ckpt.partial was removed")
