"""Single-process reliability tests: async checkpoints and top-k cleanup, damaged/tampered/foreign checkpoints,
the non-finite loss/gradient policy."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.checkpointing.integrity import checksums
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import Payload


def _data(n: int = 32) -> Tensor:
    data = synthetic_tokens(n, 32, 256, seed=3)
    data[:, 16:] = data[:, :16]
    return data


def _trainer(max_steps: int, strategy: MegatronStrategy | None = None, **kwargs: object) -> L.Trainer:
    defaults: dict = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy or MegatronStrategy(micro_batch_size=2), max_steps=max_steps,
        enable_model_summary=False, **{**defaults, **kwargs},
    )  # fmt: skip


def _complete(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.iterdir() if p.suffix == ".ckpt" and (p / "metadata.json").is_file())


class WatchCheckpoints(L.Callback):
    """Before each step: which checkpoints are complete and which saves are still being written."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        self.seen: list[tuple[int, list[str], list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if self.dirpath.exists():
            partial = sorted(p.name for p in self.dirpath.iterdir() if p.name.endswith(".partial"))
            self.seen.append((trainer.global_step, _complete(self.dirpath), partial))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """4 steps with async saves every step and save_top_k=1: ModelCheckpoint removes the previous checkpoint
    right after asking for the next one."""
    dirpath = tmp_path_factory.mktemp("async") / "ckpt"
    watch = WatchCheckpoints(dirpath)
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=1)
    strategy = MegatronStrategy(micro_batch_size=2, async_save=True)
    trainer = _trainer(4, strategy, callbacks=[watch, ckpt], enable_checkpointing=True)
    trainer.fit(MegatronLMModule(tiny_gpt(), decay_steps=8), DataLoader(_data(), batch_size=8))
    return {"dirpath": dirpath, "seen": watch.seen, "best": Path(ckpt.best_model_path)}


def test_async_save_keeps_the_last_good_checkpoint(async_run: dict) -> None:
    seen = async_run["seen"]
    # From step 2 on there is always a complete checkpoint, also while the next one is still being written
    # (a pending .partial): the top-k removal of the older one waits until the newer one is published.
    assert all(complete for step, complete, _ in seen if step >= 2), seen
    assert any(partial and complete for _, complete, partial in seen), seen  # saves really were asynchronous
    # Finalised at the end of training: the newest checkpoint is published, the older ones are gone.
    assert sorted(p.name for p in async_run["dirpath"].iterdir()) == ["epoch=0-step=4.ckpt"]
    assert async_run["best"].name == "epoch=0-step=4.ckpt"


def test_async_checkpoint_resumes(async_run: dict) -> None:
    trainer = _trainer(5)
    loader = DataLoader(_data(), batch_size=8)
    trainer.fit(MegatronLMModule(tiny_gpt(), decay_steps=8), loader, ckpt_path=async_run["best"])
    assert trainer.global_step == 5


def _copy(async_run: dict, tmp_path: Path) -> Path:
    target = tmp_path / "copy.ckpt"
    shutil.copytree(async_run["best"], target)
    return target


def _resume(path: Path, **config: object) -> None:
    model = MegatronLMModule(tiny_gpt(**config), decay_steps=8)
    _trainer(5).fit(model, DataLoader(_data(), batch_size=8), ckpt_path=str(path))


def test_resuming_a_model_of_another_shape_names_the_fields(async_run: dict) -> None:
    with pytest.raises(ValueError, match=r"another shape.*hidden_size: saved 64, now 32.*ffn_hidden_size"):
        _resume(async_run["best"], hidden_size=32, ffn_hidden_size=64)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_shard_is_named(async_run: dict, tmp_path: Path, damage: str) -> None:
    path = _copy(async_run, tmp_path)
    shard = path / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        error, match = ValueError, r"__0_0\.distcp is truncated"
    else:
        shard.unlink()
        error, match = FileNotFoundError, r"__0_0\.distcp is missing"
    with pytest.raises(error, match=match):
        _resume(path)


def test_tampered_metadata_is_refused_without_running_it(async_run: dict, tmp_path: Path) -> None:
    path = _copy(async_run, tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    checksums.record_metadata(path)  # as a forger would: checksums detect damage, the unpickler refuses code
    with pytest.raises(ValueError, match=r"\.metadata is damaged or was tampered with"):
        _resume(path)
    assert not marker.exists()


def test_tampered_common_state_is_refused_without_running_it(async_run: dict, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    path = _copy(async_run, tmp_path)
    marker = tmp_path / "pwned"
    metadata = FileSystemReader(str(path)).read_metadata()
    (index, info) = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith("common_state"))
    data = pickle.dumps(Payload(marker))  # torch.load(weights_only=False) would run it while reading the header
    assert len(data) <= info.length, (len(data), info.length)
    blob = bytearray((path / info.relative_path).read_bytes())
    blob[info.offset : info.offset + info.length] = data + b"\0" * (info.length - len(data))
    (path / info.relative_path).write_bytes(bytes(blob))
    checksums.record(path, rank=0)  # forged too: the weights-only unpickler is what refuses the code
    with pytest.raises(ValueError, match=rf"checkpoint {path}.*cannot be read safely"):
        _resume(path)
    assert not marker.exists()


def test_unfinished_save_is_never_loaded(async_run: dict, tmp_path: Path) -> None:
    partial = tmp_path / "last.ckpt.partial"
    shutil.copytree(async_run["best"], partial)  # even a complete-looking one: it was never published
    with pytest.raises(ValueError, match=r"last\.ckpt\.partial is an unfinished save"):
        _resume(partial)


# ---------------------------------------------------------------------------------------------- non-finite
class _NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        return grad * float("nan")


class Poisoned(MegatronLMModule):
    """``poison[step]``: 1 makes that step's loss NaN, 2 keeps the loss finite but makes every gradient NaN."""

    def __init__(self, poison: dict[int, int], **kwargs: object) -> None:
        super().__init__(tiny_gpt(), decay_steps=8, **kwargs)
        self.poison = poison

    def token_loss(self, logits: Tensor, targets: Tensor, batch: dict[str, Tensor]) -> Tensor:
        loss = super().token_loss(logits, targets, batch)
        kind = self.poison.get(self.trainer.global_step, 0)
        if kind == 1:
            return loss * float("nan")
        return _NanGradient.apply(loss) if kind == 2 else loss


class WeightChanges(L.Callback):
    def __init__(self) -> None:
        self.changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        after = list(pl_module.parameters())
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self.before, after, strict=True)))


def test_nonfinite_skip_leaves_weights_and_counts() -> None:
    changes = WeightChanges()
    strategy = MegatronStrategy(micro_batch_size=2, nonfinite="skip")
    trainer = _trainer(4, strategy, callbacks=[changes])
    with pytest.warns(UserWarning, match=r"optimizer step \d was skipped") as warned:
        trainer.fit(Poisoned({1: 1, 3: 2}), DataLoader(_data(), batch_size=8))
    assert changes.changed == [True, False, True, False]  # NaN loss (step 1) and NaN gradients (step 3) skipped
    skips = [str(w.message) for w in warned if "was skipped" in str(w.message)]  # 1, 2, 4, ... skips: rate-limited
    assert len(skips) == 2, skips
    assert "optimizer step 1 was skipped" in skips[0]
    assert "1 step(s) skipped so far" in skips[0]
    assert "optimizer step 3 was skipped" in skips[1]
    assert "2 step(s) skipped so far" in skips[1]
    assert strategy.skipped_steps == 2
    assert trainer.callback_metrics["skipped_steps"] == 2  # logged
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_skipped_steps_warn_at_1_2_4_8_skips() -> None:
    strategy = MegatronStrategy(micro_batch_size=2, nonfinite="skip")
    with pytest.warns(UserWarning, match="was skipped") as warned:
        _trainer(6, strategy).fit(Poisoned(dict.fromkeys(range(5), 1)), DataLoader(_data(), batch_size=8))
    counts = [re.search(r"(\d+) step\(s\) skipped so far", str(w.message)) for w in warned]
    assert [int(c.group(1)) for c in counts if c] == [1, 2, 4]  # 5 skipped steps, 3 warnings
    assert strategy.skipped_steps == 5


@pytest.mark.parametrize(("poison", "clip_grad"), [(2, 1.0), (1, 0.0)], ids=["nan-grads", "nan-loss-no-clipping"])
def test_nonfinite_error_names_the_step(poison: int, clip_grad: float) -> None:
    # Megatron's optimizer reports the gradient norm even without clipping: the default policy needs no extra check.
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm \(nan\) at optimizer step 2"):
        _trainer(4).fit(Poisoned({2: poison}, clip_grad=clip_grad), DataLoader(_data(), batch_size=8))


def test_nonfinite_error_is_raised_before_the_step_is_saved(tmp_path: Path) -> None:
    # The norm is read one step late (no GPU synchronisation), but before any checkpoint of the bad step is written.
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = _trainer(4, callbacks=[saver], enable_checkpointing=True)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm \(nan\) at optimizer step 2"):
        trainer.fit(Poisoned({2: 2}), DataLoader(_data(), batch_size=8))
    assert _complete(tmp_path) == ["step=1.ckpt", "step=2.ckpt"]


def test_nonfinite_error_at_the_last_step_stops_the_fit_before_its_export(tmp_path: Path) -> None:
    # SaveHF's on_train_end runs before the strategy's: the export itself checks the pending norm.
    from lightning_megatron import SaveHF

    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm \(nan\) at optimizer step 3"):
        _trainer(4, callbacks=[SaveHF(str(tmp_path / "hf"))]).fit(Poisoned({3: 2}), DataLoader(_data(), batch_size=8))
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").glob("*.safetensors"))


def test_nonfinite_error_is_not_saved_on_exception_either(tmp_path: Path) -> None:
    # ModelCheckpoint(save_on_exception=True) saves in on_exception, after the guard's own error: it raises again.
    saver = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, every_n_train_steps=100, filename="{step}")
    trainer = _trainer(4, callbacks=[saver], enable_checkpointing=True)
    with pytest.raises(FloatingPointError, match=r"at optimizer step 1"):
        trainer.fit(Poisoned({1: 2}), DataLoader(_data(), batch_size=8))
    assert _complete(tmp_path) == []


def test_a_run_lightning_did_not_tear_down_is_torn_down_by_the_next(tmp_path: Path) -> None:
    """When a callback raises in on_exception, Lightning skips the teardown: the run's patches (gradient clipping)
    and SIGTERM handler stay. The next run's start tears that run down, so nothing of it reaches the next run."""
    import signal

    from lightning_megatron.compat import patches

    clip = patches.ForeachClipGrads()
    saver = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, every_n_train_steps=100, filename="{step}")
    with pytest.raises(FloatingPointError, match=r"at optimizer step 1"):
        _trainer(4, callbacks=[saver], enable_checkpointing=True).fit(
            Poisoned({1: 2}), DataLoader(_data(), batch_size=8)
        )
    stale = clip.module().l2_norm_impl
    assert isinstance(getattr(stale, "__self__", None), patches.ForeachClipGrads)  # Lightning skipped the teardown

    class Seen(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.clipping = clip.module().l2_norm_impl  # this run's patch, installed on the original functions

    seen = Seen()
    _trainer(1, callbacks=[seen]).fit(Poisoned({}), DataLoader(_data(), batch_size=8))
    assert isinstance(seen.clipping.__self__, patches.ForeachClipGrads)
    assert seen.clipping.__self__ is not stale.__self__
    assert clip.wanted()  # Megatron's own functions again, after the second run's teardown
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # neither ours nor Lightning's handler is left


def test_only_runs_that_ended_are_torn_down_at_the_next_start() -> None:
    """training/retained.py: an interrupted run and an earlier run of the same strategy are torn down (on_exception,
    then teardown, with the SIGTERM handler from before the run); a run still going (a Trainer inside another's
    callback) is not."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerStatus

    from lightning_megatron.training import retained

    calls: list[tuple[str, str]] = []

    class Run:
        def __init__(self, name: str, status: TrainerStatus) -> None:
            self.name = name
            self.lightning_module = SimpleNamespace(trainer=SimpleNamespace(state=SimpleNamespace(status=status)))

        def on_exception(self, exception: BaseException) -> None:
            calls.append((self.name, "on_exception"))

        def teardown(self) -> None:
            calls.append((self.name, "teardown"))
            retained.run_finished(self)

    class Sigterm:
        def __init__(self, name: str) -> None:
            self.name = name

        def restore_chained(self) -> None:
            calls.append((self.name, "restore_chained"))

        def before_run(self) -> None:
            calls.append((self.name, "before_run"))

    interrupted, going = Run("interrupted", TrainerStatus.INTERRUPTED), Run("going", TrainerStatus.RUNNING)
    again = Run("again", TrainerStatus.RUNNING)
    for run in (interrupted, going, again):
        retained.run_started(run, Sigterm(run.name))
    retained.run_started(again, Sigterm("again"))  # the same strategy starts another run: its last one has ended
    stale = ["restore_chained", "on_exception", "teardown"]
    assert calls == [("interrupted", "before_run"), *[("interrupted", c) for c in stale], ("going", "before_run"),
                     ("again", "before_run"), *[("again", c) for c in stale], ("again", "before_run")]  # fmt: skip
    for run in (going, again):
        retained.run_finished(run)


def test_nonfinite_policy_is_checked() -> None:
    with pytest.raises(ValueError, match=r"nonfinite='ignore'.*'error'.*'skip'"):
        MegatronStrategy(nonfinite="ignore")  # type: ignore[arg-type]


def test_no_pickle_runs_in_this_process() -> None:
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the forced weights_only load is scoped


# ---------------------------------------------------------------------------------------------- untrusted HF files
def _pickled_hf(tmp_path: Path) -> tuple[Path, Path]:
    from safetensors.torch import load_file

    from tests.hf_dense_models import make_hf_model

    safe = make_hf_model("llama", tmp_path / "safe")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((safe / "config.json").read_text())
    torch.save(load_file(safe / "model.safetensors"), pickled / "pytorch_model.bin")
    return safe, pickled


def test_pickled_hf_weights_need_an_explicit_opt_in(tmp_path: Path) -> None:
    from lightning_megatron.gpt.hf.load import HFCheckpoint

    safe, pickled = _pickled_hf(tmp_path)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*only safetensors.*allow_pickle=True"):
        MegatronLMModule.from_hf(pickled)
    module = MegatronLMModule.from_hf(pickled, allow_pickle=True)  # checks names and shapes like safetensors
    a, b = HFCheckpoint.open(safe), module.hf_checkpoint
    assert b is not None
    assert a.files.keys() == b.files.keys()
    with a.lazy_tensors() as lazy_a, b.lazy_tensors() as lazy_b:
        for name in a.files:  # whole tensors and the row/column blocks a TP rank reads
            assert lazy_a(name).get_shape() == lazy_b(name).get_shape()
            assert torch.equal(lazy_a(name)[:], lazy_b(name)[:])
            assert torch.equal(lazy_a(name)[:1], lazy_b(name)[:1])


def test_opted_in_pickle_still_runs_no_code(tmp_path: Path) -> None:
    _, pickled = _pickled_hf(tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be read with torch\.load\(weights_only=True\)"):
        MegatronLMModule.from_hf(pickled, allow_pickle=True)
    assert not marker.exists()
