"""The process-wide patches (lightning_megatron/compat/patches.py): which a run installs, that every one is undone after
its teardown -- also a teardown that raises -- and that each says which upstream version it was written against."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, tiny_gpt
from lightning_megatron.compat import patches, quiet
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.kernels import permute
from lightning_megatron.parallel import ddp
from tests.conftest import one_process_trainer

ALL = [
    cls
    for cls in vars(patches).values()
    if inspect.isclass(cls) and issubclass(cls, patches.Patch) and cls not in (patches.Patch, patches.ModuleFunctions)
]  # the patches themselves, not their base classes


def _snapshot(patch: patches.Patch) -> dict[tuple[int, str], Any]:
    return {(id(owner), name): vars(owner).get(name, _MISSING) for owner, name in patch.targets()}


_MISSING = object()


def _logger_filters() -> dict[str, list[logging.Filter]]:
    """The filters of the loggers that QuietRun and CpuMode filter."""
    names = [*quiet._LOGGED, "megatron.core.tensor_parallel.random"]
    return {name: list(logging.getLogger(name).filters) for name in names}


class Seen(L.Callback):
    """The strategy's patches while it trains, and what their targets held then."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.installed = trainer.strategy._run.patches.installed
        self.during = {type(p): _snapshot(p) for p in self.installed}


def _fit(seen: Seen, **model: Any) -> None:
    data = DataLoader(synthetic_tokens(8, 32, 256, seed=0), batch_size=4)
    one_process_trainer(1, callbacks=[seen]).fit(MegatronLMModule(tiny_gpt(**model)), data)


def _broken(*args: object) -> None:
    raise RuntimeError("teardown step failed")


@pytest.mark.parametrize(
    ("teardown_fails", "experts"), [(False, None), (True, 4)], ids=["dense-teardown", "moe-failed_teardown"]
)
def test_a_cpu_run_installs_its_patches_and_teardown_removes_every_one(
    monkeypatch: pytest.MonkeyPatch, teardown_fails: bool, experts: int | None
) -> None:
    from lightning_megatron.compat import cpu

    before_warnings, before_loggers = warnings.filters, _logger_filters()
    before = {cls: _snapshot(cls()) for cls in (patches.CpuMode, patches.ForeachClipGrads)}
    before[patches.UniformTokenPermutation] = _snapshot(patches.UniformTokenPermutation(permute))
    before[patches.QuietRun] = _snapshot(patches.QuietRun("cpu"))
    if teardown_fails:
        monkeypatch.setattr(ddp, "clear_hooks", _broken)  # a step of teardown before the patches' removal raises
    seen = Seen()
    with pytest.raises(RuntimeError, match="teardown step failed") if teardown_fails else contextlib.nullcontext():
        _fit(seen, num_moe_experts=experts)
    # The MoE permutation only for a model with experts (the GPT family's hooks ask for it, gpt/hooks.py).
    moe = [patches.UniformTokenPermutation] if experts else []
    expected = [patches.QuietRun, patches.CpuMode, *moe, patches.ForeachClipGrads]
    assert [type(p) for p in seen.installed] == expected
    assert [cls for cls in patches.RUN_PATCHES if cls in expected] == expected  # in the declared order
    for patch in seen.installed:
        assert not patch.installed
        assert seen.during[type(patch)] != before[type(patch)]  # really replaced while training
        assert _snapshot(patch) == before[type(patch)]  # the originals again
    assert warnings.filters is before_warnings
    assert _logger_filters() == before_loggers
    assert not cpu.is_enabled()


class _Recorder(patches.Patch):
    """Test double: records its calls; megatron-core 0.19.2. Droppable when: never (a test double)."""

    def __init__(self, log: list[str], name: str, fail_remove: bool = False) -> None:
        self.log, self.name, self.fail_remove = log, name, fail_remove

    def install(self) -> None:
        self.installed = True
        self.log.append(f"install {self.name}")

    def remove(self) -> None:
        was, self.installed = self.installed, False
        if was:
            self.log.append(f"remove {self.name}")
        if was and self.fail_remove:
            raise RuntimeError(f"{self.name} failed")

    def targets(self) -> list[tuple[Any, str]]:
        return []


def test_the_stack_removes_in_reverse_even_when_a_removal_raises() -> None:
    log: list[str] = []
    stack = patches.PatchStack()
    a, b, c = (_Recorder(log, "a"), _Recorder(log, "b", fail_remove=True), _Recorder(log, "c", fail_remove=True))
    for patch in (a, b, c):
        assert stack.install(patch) is patch
    assert stack.installed == [a, b, c]
    assert stack.get(_Recorder) is a
    with pytest.raises(RuntimeError, match="c failed"):  # the first error, after every removal ran
        stack.remove()
    assert log == ["install a", "install b", "install c", "remove c", "remove b", "remove a"]
    assert stack.installed == []
    stack.remove()  # idempotent
    assert len(log) == 6


def test_every_patch_names_why_and_the_upstream_version_it_can_go_with() -> None:
    expected = {patches.CpuMode, patches.QuietRun, patches.ForeachClipGrads, patches.KeepAdamStepOnLoad}
    expected |= {patches.ThreadedShardReads}
    assert set(ALL) == expected | {patches.UniformTokenPermutation}
    for cls in ALL:
        doc = inspect.getdoc(cls) or ""
        droppable = re.search(r"Droppable when: (.+)", doc, re.S)
        assert droppable, cls
        assert re.search(r"megatron-core\s+\d+\.\d+\.\d+", droppable.group(1)), cls
        assert len(doc.split("Droppable when:")[0].split()) > 20, cls  # and why it exists


def test_keep_adam_step_on_load_patches_only_the_optimizer_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(
        DistributedOptimizer, "_set_main_param_and_optimizer_states", lambda self, param, tensors: calls.append(tensors)
    )
    class_method = DistributedOptimizer._set_main_param_and_optimizer_states
    part = DistributedOptimizer.__new__(DistributedOptimizer)  # Megatron's method needs no state for this check
    chained = type("Chained", (), {"chained_optimizers": [part, object()]})()  # a part of another kind is left alone
    with patches.KeepAdamStepOnLoad(chained) as patch:
        assert patch.targets() == [(part, "_set_main_param_and_optimizer_states")]
        part._set_main_param_and_optimizer_states("param", {"exp_avg": 1})
        other = DistributedOptimizer.__new__(DistributedOptimizer)
        other._set_main_param_and_optimizer_states("param", {"exp_avg": 2})  # another instance: Megatron's own
        assert DistributedOptimizer._set_main_param_and_optimizer_states is class_method
    assert calls == [{"step": None, "exp_avg": 1}, {"exp_avg": 2}]
    assert "_set_main_param_and_optimizer_states" not in vars(part)
    part._set_main_param_and_optimizer_states("param", {"exp_avg": 3})
    assert calls[-1] == {"exp_avg": 3}


def test_threaded_shard_reads_replace_only_megatrons_plain_reader(tmp_path: Path) -> None:
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from torch.distributed.checkpoint import FileSystemReader

    original = torch_strategy._get_filesystem_reader
    made: list[str] = []
    with patches.ThreadedShardReads(lambda path: made.append(str(path)) or "threaded") as patch:
        assert patch.targets() == [(torch_strategy, "_get_filesystem_reader")]
        assert torch_strategy._get_filesystem_reader(tmp_path) == "threaded"
        # Megatron's metadata-caching reader (assume_constant_structure) is not replaced.
        cached = torch_strategy._get_filesystem_reader(tmp_path, cache_metadata=True)
        assert type(cached) is not FileSystemReader
        assert isinstance(cached, FileSystemReader)
    assert made == [str(tmp_path)]
    assert patch.readers == ["threaded"]
    assert torch_strategy._get_filesystem_reader is original
