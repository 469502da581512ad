"""Faults an operator meets, in one process: SIGTERM, code in a checkpoint on every load path, damaged bytes and
metadata, a full disk, a second writer, another batch size on resume, a truncated HF download.

(The two-process SIGTERM and kill tests are in ``test_failures.py``; async saves, damaged shards, tampered
``.metadata``/common state at ``fit`` and the non-finite policy in ``test_reliability.py``.)
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, Preempted
from lightning_megatron.checkpointing.integrity import checksums
from lightning_megatron.checkpointing.save.saving import WriterLock
from tests.conftest import Payload, flip_bit
from tests.tiny_gpt_runs import DATA, tiny_fit, tiny_model, tiny_trainer


# ---------------------------------------------------------------------------------------------- SIGTERM
class SendSigterm(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_ends_the_fit_with_status_143_and_its_final_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    received: list[int] = []

    def users_handler(signum: int, frame: object) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        with pytest.raises(Preempted) as stop:
            tiny_fit(4, SendSigterm(), OnExceptionCheckpoint(tmp_path))
        assert signal.getsignal(signal.SIGTERM) is users_handler  # back after the fit
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 143  # a SystemExit: uncaught, the process exits with 143
    assert stop.value.step == 2
    assert "every rank stopped at global step 2" in str(stop.value)
    assert received == [signal.SIGTERM]  # still called
    # The final checkpoint holds step 2 and the position after its batch: the rest of the curve is unchanged.
    full = tiny_fit(4)
    resumed = tiny_fit(4, ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert resumed == {step: full[step] for step in (3, 4)}


class WindowLosses(L.Callback):
    """``train_loss`` of each optimizer step (over its accumulated batches), and SIGTERM at the ``term_at``-th batch."""

    def __init__(self, term_at: int | None = None) -> None:
        self.losses: dict[int, float] = {}
        self.term_at, self.batches = term_at, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches += 1
        if self.batches == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])


def test_sigterm_inside_an_accumulation_window_finishes_it_and_resumes_exactly(tmp_path: Path) -> None:
    """GradientAccumulationScheduler: one batch a step in epoch 0 (6 steps), two in epoch 1. SIGTERM at epoch 1's
    second batch, inside step 7's window: the window's step completes, then the run stops, and its final checkpoint
    resumes the uninterrupted curve. (Stopped at the window's first batch, the resumed run would start at its second
    with the first one's gradients lost; resumed mid-epoch in epoch 1, the loader must skip batches of that epoch's
    shuffle, not epoch 0's.)"""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def fit(losses: WindowLosses, *callbacks: L.Callback, ckpt_path: str | None = None) -> dict[int, float]:
        schedule = GradientAccumulationScheduler({0: 1, 1: 2})
        trainer = tiny_trainer(9, callbacks=[losses, schedule, *callbacks], enable_checkpointing=bool(callbacks))
        trainer.fit(tiny_model(), DataLoader(DATA, batch_size=8), ckpt_path=ckpt_path)
        return losses.losses

    with pytest.raises(Preempted, match="stopped at global step 7"):
        fit(WindowLosses(term_at=8), OnExceptionCheckpoint(tmp_path))
    full = fit(WindowLosses())
    assert sorted(full) == list(range(1, 10))
    assert fit(WindowLosses(), ckpt_path=str(tmp_path / "on_exception.ckpt")) == {8: full[8], 9: full[9]}


class SigtermWhileSaving(L.Callback):
    """Sends SIGTERM while Lightning builds the step-2 checkpoint (its callbacks' state), before the shards are
    written: the save completes, the run stops at the next boundary."""

    def state_dict(self) -> dict:
        if self._trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        self._trainer = trainer


def test_sigterm_during_a_save_lets_it_finish_then_stops(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(Preempted, match="stopped at global step 2"):
        tiny_fit(4, SigtermWhileSaving(), saver)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]
    full = tiny_fit(4)
    assert tiny_fit(4, ckpt_path=str(tmp_path / "step=2.ckpt")) == {step: full[step] for step in (3, 4)}


def test_sigterm_in_the_last_step_still_stops_the_run() -> None:
    class LastStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted, match="stopped at global step 2"):  # at the end of the fit, not silently lost
        tiny_fit(2, LastStep())


def _signal_after_the_last_check(redeliver: bool, ran_on: str) -> None:
    """In a process of its own (the default action of SIGTERM in place), with a ``SigtermStop`` and no Trainer."""
    from lightning_megatron.training.preemption import SigtermStop

    stop = SigtermStop()
    stop.before_run()  # the default action before the run
    signal.signal(signal.SIGTERM, lambda *args: None)  # what Lightning registers
    stop.at_barrier(takeover=True)  # Lightning's 'run-stage' barrier
    os.kill(os.getpid(), signal.SIGTERM)  # after the last check
    stop.uninstall(redeliver=redeliver)
    Path(ran_on).write_text("ran on")


@pytest.mark.parametrize("redeliver", [True, False])
def test_a_signal_after_the_last_check_is_delivered_again(redeliver: bool, tmp_path: Path) -> None:
    from tests.conftest import fork_server

    # Forked from the session's fork server (the stack imported once), not a fresh interpreter importing it.
    process = fork_server().Process(target=_signal_after_the_last_check, args=(redeliver, str(tmp_path / "ran_on")))
    process.start()
    process.join(120)
    if process.is_alive():
        process.kill()
        process.join()
    if redeliver:  # the process ends as the signal's default action would have ended it
        assert process.exitcode == -signal.SIGTERM
        assert not (tmp_path / "ran_on").exists()
    else:  # a failed run's teardown: its own exception is the one to see
        assert process.exitcode == 0
        assert (tmp_path / "ran_on").read_text() == "ran on"


class RegistersAHandler(L.Callback):
    """Registers its own SIGTERM handler in ``setup``, after the strategy's setup began (as a logger might)."""

    def __init__(self) -> None:
        self.calls = 0

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum: int, frame: object) -> None:
        self.calls += 1


def test_a_handler_registered_during_setup_is_chained_and_left_in_place() -> None:
    registers = RegistersAHandler()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(Preempted, match="stopped at global step 2"):
            tiny_fit(4, registers, SendSigterm())
        assert registers.calls == 1  # called while ours noted the signal
        assert signal.getsignal(signal.SIGTERM) == registers.handle  # Lightning restored it; ours is gone
    finally:
        signal.signal(signal.SIGTERM, previous)


class SigtermInValidation(L.Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validate_stops_it() -> None:
    trainer = tiny_trainer(callbacks=[SigtermInValidation()])
    with pytest.raises(Preempted, match="stopped at global step 0"):
        trainer.validate(tiny_model(), DataLoader(DATA[:24], batch_size=8), verbose=False)  # stops before batch 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ---------------------------------------------------------------------------------------------- code in a checkpoint
def _tamper_metadata(path: Path, marker: Path) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    checksums.record_metadata(path)  # forged too: checksums catch damage, not forgery


def _tamper_common_state(path: Path, marker: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    info = next(s for i, s in metadata.storage_data.items() if i.fqn.startswith("common_state"))
    data = pickle.dumps(Payload(marker))
    blob = bytearray((path / info.relative_path).read_bytes())
    blob[info.offset : info.offset + len(data)] = data
    (path / info.relative_path).write_bytes(bytes(blob))
    checksums.record(path, rank=0)


def _validate(path: Path) -> None:
    tiny_trainer().validate(tiny_model(), DataLoader(DATA[:8], batch_size=8), ckpt_path=str(path), verbose=False)


LOADS: dict[str, tuple[str, Callable[[Path], object]]] = {
    "fit": (
        "full",
        lambda path: tiny_trainer(3).fit(tiny_model(), DataLoader(DATA, batch_size=8), ckpt_path=str(path)),
    ),
    "validate": ("full", _validate),
    "load_from_checkpoint": ("full", MegatronLMModule.load_from_checkpoint),
    "weights-only": ("weights", MegatronLMModule.load_from_checkpoint),
    "adapter-only": ("adapters", MegatronLMModule.load_from_checkpoint),
}


@pytest.mark.parametrize("tamper", [_tamper_metadata, _tamper_common_state], ids=["metadata", "common-state"])
@pytest.mark.parametrize("load", sorted(LOADS))
def test_code_in_a_checkpoint_never_runs(saved: dict, tmp_path: Path, load: str, tamper: Callable) -> None:
    which, run = LOADS[load]
    path, marker = tmp_path / f"{which}.ckpt", tmp_path / "pwned"
    shutil.copytree(saved[which], path)
    tamper(path, marker)
    with pytest.raises(ValueError, match=r"damaged or was tampered with|cannot be read safely"):
        run(path)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- damage
@pytest.mark.parametrize("prefix", ["decoder.layers.mlp.linear_fc1.weight", "optimizer.state.exp_avg_sq"])
def test_a_flipped_bit_is_found_and_named(saved: dict, tmp_path: Path, prefix: str) -> None:
    path = tmp_path / "full.ckpt"
    shutil.copytree(saved["full"], path)
    fqn = flip_bit(path, prefix)
    with pytest.raises(ValueError, match=rf"checkpoint {path} is damaged: __0_0\.distcp differs .* hold .*{fqn}"):
        tiny_trainer(3).fit(tiny_model(), DataLoader(DATA, batch_size=8), ckpt_path=str(path))

    # The weights path (load_from_checkpoint loads them as the chunks are built) verifies what it reads: a damaged
    # weight stops it, a damaged optimizer moment does not concern it.
    def predict() -> list:
        return tiny_trainer().predict(MegatronLMModule.load_from_checkpoint(path), DataLoader(DATA[:4], batch_size=4))

    if prefix.startswith("decoder"):
        with pytest.raises(ValueError, match=rf"__0_0\.distcp differs .* hold .*{fqn}"):
            predict()
    else:
        assert len(predict()) == 1


@pytest.mark.parametrize("threads", [1, 3])
def test_the_optimizer_state_is_verified_while_it_is_read(
    saved: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """A resume verifies what it reads into the model before the read, and the optimizer state (read into host
    buffers) in a thread of its own during the read, so that the disk is read once; a damaged moment, read without
    any error, raises before anything read reaches the model or the optimizer. The tensors are read by
    ``read_threads`` threads."""
    from lightning_megatron.checkpointing.load import loading

    verified: list[tuple[str, set[str]]] = []
    verify = checksums.verify

    def recording(path: Path, metadata: object, items: object = None, **kwargs: object) -> None:
        verified.append((threading.current_thread().name, {i.fqn.split(".")[0] for i in items}))  # type: ignore[attr-defined]
        verify(path, metadata, items, **kwargs)  # type: ignore[arg-type]

    applied: list[str] = []
    fill, load_state_dict = loading.main_weights.fill_from_optimizer, torch.nn.Module.load_state_dict
    monkeypatch.setattr(checksums, "verify", recording)
    monkeypatch.setattr(loading.main_weights, "fill_from_optimizer", lambda *a: applied.append("fill") or fill(*a))
    monkeypatch.setattr(
        torch.nn.Module, "load_state_dict", lambda m, *a, **k: applied.append("model") or load_state_dict(m, *a, **k)
    )

    def resume(path: Path) -> MegatronStrategy:
        checkpoint = CheckpointConfig(read_threads=threads)  # 1: Megatron's reader
        strategy = MegatronStrategy(micro_batch_size=2, checkpoint=checkpoint)
        verified.clear()
        applied.clear()
        tiny_trainer(3, strategy=strategy).fit(tiny_model(), DataLoader(DATA, batch_size=8), ckpt_path=str(path))
        return strategy

    path = tmp_path / "full.ckpt"
    shutil.copytree(saved["full"], path)
    assert resume(path).checkpoint_writer.last_load["read_parts"] == (threads if threads > 1 else 0)
    main = set().union(*[names for thread, names in verified if thread == threading.main_thread().name])
    assert {"decoder", "embedding", "output_layer"} <= main
    assert "optimizer" not in main
    assert [names for thread, names in verified if thread == "checksums-verify"] == [{"optimizer"}]
    assert applied[:2] == ["fill", "model"]

    fqn = flip_bit(path, "optimizer.state.exp_avg_sq")
    with pytest.raises(ValueError, match=rf"checkpoint {path} is damaged: __0_0\.distcp differs .* hold .*{fqn}"):
        resume(path)
    assert [thread for thread, _ in verified].count("checksums-verify") == 1
    assert applied == []


def test_damaged_metadata_and_foreign_files_are_named(saved: dict, tmp_path: Path) -> None:
    path = tmp_path / "full.ckpt"
    shutil.copytree(saved["full"], path)
    blob = bytearray((path / ".metadata").read_bytes())
    blob[len(blob) // 2] ^= 0x01
    (path / ".metadata").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"\.metadata differs from what was written.*metadata of checkpoint"):
        MegatronLMModule.load_from_checkpoint(path)
    shutil.rmtree(path)
    shutil.copytree(saved["full"], path)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_')  # cut short
    with pytest.raises(ValueError, match=r"metadata\.json differs from what was written"):
        MegatronLMModule.load_from_checkpoint(path)
    for table in [path / "metadata_checksums.json", *path.glob("checksums_*.json")]:
        table.unlink()  # as in a checkpoint written without checksums
    with pytest.raises(ValueError, match=r"metadata\.json is damaged \(not valid JSON"):
        MegatronLMModule.load_from_checkpoint(path)
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain)
    for load in (MegatronLMModule.load_from_checkpoint, _validate):
        with pytest.raises(ValueError, match=r"plain\.ckpt is a file \(a plain Lightning/torch\.save checkpoint\)"):
            load(plain)


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    from tests.hf_dense_models import make_hf_model

    hf = make_hf_model("llama", tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is incomplete or damaged \(\d+ bytes; safetensors:"):
        MegatronLMModule.from_hf(hf)


# ---------------------------------------------------------------------------------------------- saving
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_no_space_left_is_named_and_the_last_checkpoint_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    from lightning_megatron.checkpointing.save import write_process
    from tests.full_disk_writer import fill_the_disk

    # Every write of the checkpoint step=4 fails as on a full disk: here (sync) or in the writer process (async).
    if async_save:
        monkeypatch.setattr(write_process, "COMMAND", [sys.executable, "-m", "tests.full_disk_writer"])
    else:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        monkeypatch.setattr(filesystem_async, "_write_item", filesystem_async._write_item)  # restored by undo()
        fill_the_disk()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    strategy = MegatronStrategy(micro_batch_size=2, async_save=async_save)
    with pytest.raises(OSError, match=r"writing checkpoint .*step=4\.ckpt failed: no space left on the device"):
        tiny_fit(6, saver, strategy=strategy)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]  # no .partial left, no lock
    full = tiny_fit(4)
    assert tiny_fit(4, ckpt_path=str(tmp_path / "step=2.ckpt")) == {step: full[step] for step in (3, 4)}


def test_a_writer_process_that_dies_between_saves_is_replaced_by_the_next_save(tmp_path: Path) -> None:
    class KillTheIdleWriter(L.Callback):  # after step 2's save was published, its writer process is killed
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            background = trainer.strategy.checkpoint_writer.background
            if trainer.global_step == 3:
                trainer.strategy.checkpoint_writer.finalize()  # step 2's save published: the writer is idle
                os.kill(background.writer.process.pid, signal.SIGKILL)
                background.writer.process.wait()

    saver = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    strategy = MegatronStrategy(micro_batch_size=2, async_save=True)
    tiny_fit(4, saver, KillTheIdleWriter(), strategy=strategy)
    assert strategy.checkpoint_writer.background.writers_started == 2  # step 4's save started a new one
    assert strategy.checkpoint_writer.background.writer is None  # and it ended with the run
    full = tiny_fit(5)
    assert tiny_fit(5, ckpt_path=str(tmp_path / "a" / "step=4.ckpt")) == {5: full[5]}
    # (A writer process killed while it writes: that save fails naming it, on every rank, and the previous
    # checkpoint stays: tests/test_failures.py::test_a_save_failing_on_one_rank_fails_on_both_naming_it.)


def test_a_second_writer_of_the_same_checkpoint_is_named(tmp_path: Path) -> None:
    other = WriterLock(tmp_path / "last.ckpt.partial")  # another run, saving last.ckpt right now
    other.acquire()
    try:
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
        with pytest.raises(RuntimeError, match=rf"checkpoint {tmp_path}/last\.ckpt is being written by host .* pid "):
            tiny_fit(2, saver)
    finally:
        other.release()


# ---------------------------------------------------------------------------------------------- resume position
def test_resuming_mid_epoch_with_another_global_batch_size_is_refused(tmp_path: Path) -> None:
    tiny_fit(3, ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=3))  # 3 of 6 batches of 8
    with pytest.raises(ValueError, match=r"saved 3 batches into an epoch of global batches of 8 samples.*is 4"):
        tiny_fit(4, ckpt_path=str(tmp_path / "mid.ckpt"), batch_size=4)
    # 3 batches are a whole epoch of batches of 16, but not of the saved run's: still mid-epoch
    with pytest.raises(ValueError, match=r"saved 3 batches into an epoch of global batches of 8 samples.*is 16"):
        tiny_fit(4, ckpt_path=str(tmp_path / "mid.ckpt"), batch_size=16)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename"])
def test_a_checkpoint_saved_again_under_its_name_is_swapped_in_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """Publishing over a checkpoint of the same name (``last.ckpt``, or a link to one): the new one takes the name and
    the old one (or the link) goes.
    Where the kernel swaps the two names at once, a crash right after the swap still leaves a complete checkpoint
    under the name (the old one waits under the ``.partial`` name, which is never loaded)."""
    from lightning_megatron.checkpointing.save import saving

    def directory(name: str, content: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard").write_text(content)
        return tmp_path / name

    if not exchange:  # a kernel or filesystem without renameat2's exchange: renamed to last.ckpt.old first
        monkeypatch.setattr(saving, "_exchange", lambda a, b: False)
    elif not saving._exchange(directory("a", "a"), directory("b", "b")):
        pytest.skip(f"the filesystem of {tmp_path} cannot exchange names (renameat2)")
    else:
        shutil.rmtree(tmp_path / "a")
        shutil.rmtree(tmp_path / "b")
    last = tmp_path / "last.ckpt"
    last.symlink_to(directory("step=1.ckpt", "linked"))  # left by ModelCheckpoint(save_last="link")
    saving.replace_directory(directory("last.ckpt.partial", "old"), last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=1.ckpt"]  # the link went, not its target
    assert not last.is_symlink()
    shutil.rmtree(tmp_path / "step=1.ckpt")
    saving.replace_directory(directory("last.ckpt.partial", "new"), last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (last / "shard").read_text() == "new"
    if not exchange:
        return

    def crash(path: object, ignore_errors: bool = False) -> None:
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(saving.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        saving.replace_directory(directory("last.ckpt.partial", "newer"), last)
    assert (last / "shard").read_text() == "newer"
    assert (tmp_path / "last.ckpt.partial" / "shard").read_text() == "new"
