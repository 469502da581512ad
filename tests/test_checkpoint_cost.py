"""What makes saves cheap keeps checkpoints exact: optimizer state built on the device, host buffers and save plans
reused across saves, replicated tensors written once across data-parallel ranks, async saves equal to sync ones.

Two DP=2 runs (gloo, several gradient buckets, parameters split between the ranks' optimizer shards) save after
every step, one asynchronously and one synchronously; their checkpoints are compared tensor by tensor and resumed at
DP=2 and DP=1.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import checkpoint_metadata, flip_bit, run_here, run_worker, run_workers

STEPS = 4
RUN = {"devices": 2, "overlap": True, "max_steps": STEPS, "ckpt_every": 1, "save_probe": True}


def _ckpt(directory: Path, step: int) -> Path:
    return directory / f"epoch=0-step={step}.ckpt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("saves")
    runs = [{**RUN, "async_save": True, "ckpt_dir": str(tmp / "async")}, {**RUN, "ckpt_dir": str(tmp / "sync")}]
    async_run, sync_run = run_workers(runs, tmp)
    return {"async": async_run, "sync": sync_run, "tmp": tmp}


def _tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor stored in the checkpoint at ``path``, by its global key (shards joined)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.multiprocess
def test_optimizer_state_is_megatrons_format_with_the_right_values(saved: dict) -> None:
    # The entries Megatron's own fully_reshardable state has (keys, replica ids, shapes), which its loader reads.
    found = saved["sync"]["optimizer_state_differs"]
    assert found["structure"] == []
    assert found["ours_wrong"] == []  # every fp32 main weight is the model's weight (fp32 training)
    assert found["values"] == []  # and the moments equal Megatron's wherever its slicing is aligned
    # With several gradient buckets Megatron's own method misplaces most parameters' state (here it does):
    assert found["megatron_misaligned"], "the run no longer has padded buckets: the test lost its hard case"


@pytest.mark.multiprocess
def test_async_saves_equal_sync_saves(saved: dict) -> None:
    # Training went on while each async save was written: what it holds is still the state of its step.
    tmp = saved["tmp"]
    for step in range(1, STEPS + 1):
        written = _tensors(_ckpt(tmp / "async", step), tmp)
        expected = _tensors(_ckpt(tmp / "sync", step), tmp)
        assert sorted(written) == sorted(expected)
        assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in written)
        for key, tensor in expected.items():
            assert torch.equal(written[key], tensor), f"step {step}: {key} differs"
    first, last = _tensors(_ckpt(tmp / "sync", 1), tmp), _tensors(_ckpt(tmp / "sync", STEPS), tmp)
    assert any(not torch.equal(first[key], last[key]) for key in first)  # the saves are of different steps


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_later_saves_allocate_nothing_and_reuse_the_plan(saved: dict, mode: str) -> None:
    saves = saved[mode]["saves"]
    assert len(saves) == STEPS
    assert saves[0]["allocations"] > 0
    assert all(s["allocations"] == saves[0]["allocations"] and s["plans"] == 1 for s in saves)
    assert saves[-1]["plan_reused"] == [True]  # Megatron verified the cached plan; later saves skip planning
    assert 0 < saves[0]["host_bytes"] <= saves[0]["host_bytes_bound"]  # one host copy of what the rank holds
    assert all(s["shared"] == (mode == "async") for s in saves)  # async: shared with the writer process
    # The buffers were staged once when the fit started (with async saves the writer mapped them before the first
    # save), timed, so that no save allocates.
    assert saves[0]["prestaged"]["allocate_s"] > 0
    assert all(s["timeline"]["allocate_s"] == 0 for s in saves)


@pytest.mark.multiprocess
def test_one_writer_process_serves_every_async_save(saved: dict) -> None:
    # Started at the first save and kept; each shared buffer segment handed over once, at the first save.
    saves = saved["async"]["saves"]
    assert [s["writers_started"] for s in saves] == [1] * STEPS
    assert len({s["pid"] for s in saves}) == 1
    assert saves[0]["segments_sent"] > 0
    assert all(s["segments_sent"] == saves[0]["segments_sent"] for s in saves)
    # Each save's timeline gained its write in the writer process and its publish; a sync save's has neither.
    for save in saves:
        timeline = save["timeline"]
        assert timeline["writer_wait_s"] >= 0
        assert timeline["write_s"] > 0
        assert timeline["published_s"] >= timeline["blocked_s"] > 0
    assert all("published_s" not in s["timeline"] and s["timeline"]["write_s"] > 0 for s in saved["sync"]["saves"])


@pytest.mark.multiprocess
def test_expert_parallel_saves_resume_exactly(tmp_path: Path) -> None:
    # EP=2: Megatron chains a dense and an expert optimizer (their entries prefixed chained_0/1), each staged once.
    moe = {"devices": 2, "ep": 2, "model": {"num_moe_experts": 4, "moe_router_topk": 2}, "max_steps": STEPS}
    ckpt_dir = tmp_path / "ckpt"
    run = run_worker({**moe, "async_save": True, "ckpt_dir": str(ckpt_dir), "ckpt_every": 1, "save_probe": True},
                     tmp_path)  # fmt: skip
    assert run["optimizer_state_differs"]["structure"] == []
    assert run["optimizer_state_differs"]["ours_wrong"] == []
    assert all(s["allocations"] == run["saves"][0]["allocations"] for s in run["saves"])
    assert run["saves"][0]["host_bytes"] <= run["saves"][0]["host_bytes_bound"]
    resumed = run_worker({**moe, "resume": str(_ckpt(ckpt_dir, 2))}, tmp_path)
    assert resumed["train"] == {k: v for k, v in run["train"].items() if int(k) > 2}


@pytest.mark.multiprocess
def test_each_data_parallel_rank_writes_half(saved: dict) -> None:
    # Every tensor is replicated on both ranks at DP=2 (TP=PP=1); each is written once, the work split evenly.
    path = _ckpt(saved["tmp"] / "sync", STEPS)
    written = [sum(f.stat().st_size for f in path.glob(f"__{rank}_*.distcp")) for rank in range(2)]
    assert 0.35 < written[0] / sum(written) < 0.65, written
    tensors = _tensors(path, saved["tmp"])
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sum(written) < 1.2 * stored, (written, stored)  # nothing written twice


@pytest.mark.multiprocess
def test_dp2_checkpoint_resumes_at_dp2_and_dp1(saved: dict, tmp_path: Path) -> None:
    ckpt = str(_ckpt(saved["tmp"] / "async", 2))
    later = {k: v for k, v in saved["sync"]["train"].items() if int(k) > 2}
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(ckpt, damaged)
    fqn = flip_bit(damaged, "optimizer.state.exp_avg_sq")
    resume = {"devices": 2, "overlap": True, "max_steps": STEPS, "resume": ckpt, "read_threads": 2}
    resumed, refused = run_workers([resume, {**resume, "resume": str(damaged), "expect_load_error": True}], tmp_path)
    assert resumed["train"] == later  # the same layout: bit-identical
    # Read in parallel: each data-parallel rank reads about half the checkpoint (Megatron's fully-parallel load
    # hands the other half over), each in 2 threads, which verify the optimizer state's share they read.
    others = [json.loads(f.read_text()) for f in tmp_path.glob("result-*.json.rank1")]
    (other,), (refused_other,) = [o for o in others if "error" not in o], [o for o in others if "error" in o]
    loads = [resumed["last_load"], other["last_load"]]
    stored = sum(f.stat().st_size for f in Path(ckpt).glob("*.distcp"))
    assert all(load["read_parts"] >= 2 for load in loads), loads
    assert 0.35 < loads[0]["read_bytes"] / stored < 0.65, (loads, stored)
    assert 0.9 < (loads[0]["read_bytes"] + loads[1]["read_bytes"]) / stored < 1.01, (loads, stored)
    optimizer = sum(s.length for i, s in checkpoint_metadata(Path(ckpt)).storage_data.items() if i.fqn.startswith(
        "optimizer."))  # fmt: skip
    verified = [load["read_verified_bytes"] for load in loads]
    assert sum(verified) == optimizer, (verified, optimizer)
    assert 0.3 < verified[0] / optimizer < 0.7, (verified, optimizer)
    # A damaged moment, read by one of the ranks: both refuse the checkpoint naming it, before any step.
    for result in (refused, refused_other):
        assert re.search(rf"is damaged: .* hold .*{re.escape(fqn)}", result["error"]), result["error"]
        assert result["train"] == {}
    one = run_here({"devices": 1, "max_steps": STEPS, "resume": ckpt}, tmp_path)
    assert sorted(one["train"]) == sorted(later)
    for step, loss in later.items():
        assert one["train"][step] == pytest.approx(loss, rel=2e-4)
    # Loaded at DP=1 exactly: what one process loaded (no step taken) saves back to the same tensors.
    again = tmp_path / "again.ckpt"
    run_here({"devices": 1, "max_steps": 2, "resume": ckpt, "save_to": str(again)}, tmp_path)
    original, reloaded = _tensors(Path(ckpt), tmp_path), _tensors(again, tmp_path)
    assert original.keys() == reloaded.keys()
    for key, tensor in original.items():
        assert torch.equal(reloaded[key], tensor), key


@pytest.mark.multiprocess
def test_checkpoints_without_the_model_weights_resume_at_dp2_and_dp1(tmp_path: Path) -> None:
    """A DP=2 bf16 run whose checkpoints hold the trained weights only as fp32 main weights (several gradient
    buckets, parameters split between the ranks' optimizer shards) resumes at DP=2 exactly, at one process and at
    TP=2."""
    run = {"devices": 2, "overlap": True, "max_steps": STEPS, "ckpt_every": 1, "precision": "bf16-mixed"}
    saving = run_worker({**run, "ckpt_dir": str(tmp_path / "lean"), "lean": True}, tmp_path)
    ckpt = str(_ckpt(tmp_path / "lean", 2))
    assert not any(
        key.endswith("linear_fc1.weight") for key in _tensors(Path(ckpt), tmp_path) if "optimizer" not in key
    )
    later = {k: v for k, v in saving["train"].items() if int(k) > 2}
    resumed = run_worker({**run, "resume": ckpt}, tmp_path)
    assert resumed["train"] == later
    one = run_here({"devices": 1, "max_steps": STEPS, "precision": "bf16-mixed", "resume": ckpt}, tmp_path)
    tp2 = run_worker({"devices": 2, "tp": 2, "max_steps": STEPS, "precision": "bf16-mixed", "resume": ckpt}, tmp_path)
    for other in (one, tp2):  # the weights rebuilt in shards: TP=2 splits SwiGLU's fc1 (a factory) in halves
        assert sorted(other["train"]) == sorted(later)
        for step, loss in later.items():
            assert other["train"][step] == pytest.approx(loss, rel=1e-2)  # bf16 at another layout


def test_plan_structure_ignores_the_common_entries() -> None:
    # ModelCheckpoint(monitor=...) keys its best-k models by path: every save changes the common entries, which
    # are saved as one object whatever they hold; only the sharded tensors and objects decide the plan.
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lightning_megatron.checkpointing.save.plans import structure

    def state(rows: int, best: dict) -> dict:
        weight = ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 4), replica_id=0)
        return {"model0": {"w": weight}, "callbacks": {"ModelCheckpoint": {"best_k_models": best}}}

    first = structure(state(2, {"epoch=0-step=1.ckpt": 1.0}))
    assert structure(state(2, {"epoch=0-step=2.ckpt": 0.5, "epoch=0-step=1.ckpt": 1.0})) == first
    assert structure(state(3, {"epoch=0-step=1.ckpt": 1.0})) != first


def test_checksums_are_computed_while_the_shards_are_written(tmp_path: Path) -> None:
    """checksums.Recorder follows the files as they grow: blocks get their checksum before the writer is done, and
    the table is the CRC-32 of every 64 KiB block of the final files (a partial last block included)."""
    import json
    import os
    import time
    import zlib

    from lightning_megatron.checkpointing.integrity import checksums

    block = checksums.BLOCK_BYTES
    data = {name: os.urandom(size) for name, size in [("a__0_0.distcp", 5 * block + 123), ("a__0_1.distcp", block)]}
    (tmp_path / "b__1_0.distcp").write_bytes(b"another rank's file")
    with checksums.Recorder(tmp_path, rank=0) as recorder:
        for name, content in data.items():
            with open(tmp_path / name, "wb") as f:
                for start in range(0, len(content), 40_000):  # appends that straddle the blocks
                    f.write(content[start : start + 40_000])
                    f.flush()
        deadline = time.monotonic() + 30
        while recorder.blocks < 6 and time.monotonic() < deadline:  # the complete blocks, before the exit
            time.sleep(0.01)
        assert recorder.blocks == 6
    table = json.loads((tmp_path / "checksums_0.json").read_text())
    want = {
        name: {
            "size": len(content),
            "blocks": [zlib.crc32(content[i : i + block]) for i in range(0, len(content), block)],
        }
        for name, content in data.items()
    }
    assert table["files"] == want
    failed = tmp_path / "failed"
    failed.mkdir()
    with checksums.Recorder(failed, rank=0) as recorder:
        (failed / "a__0_0.distcp").write_bytes(b"incomplete")
        recorder.discard()
    assert not (failed / "checksums_0.json").exists()


def _segment_maps() -> set[str]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line for line in lines if "/memfd:lightning_megatron_ckpt_" in line}


def test_host_buffers_can_be_given_back_after_each_save(tmp_path: Path) -> None:
    """CheckpointConfig(keep_host_buffers=False): after each save and after a load no host buffer is held, every
    save allocates its buffers again, and the checkpoints still resume exactly."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, tiny_gpt
    from lightning_megatron.data.corpus import synthetic_tokens
    from tests.conftest import one_process_trainer

    seen: list[tuple[int, int]] = []  # (bytes held, allocations so far) at each step's start, after the last save
    losses: dict[int, float] = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            buffers = trainer.strategy.checkpoint_writer.buffers
            seen.append((buffers.bytes, buffers.allocations))
            gc.collect()  # the memory itself went back: no segment of this run is still mapped
            assert _segment_maps() == self.before

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.before = _segment_maps()  # (those of earlier tests in this process, if any)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses[trainer.global_step] = float(outputs["loss"])

    def fit(steps: int, ckpt_path: str | None = None) -> MegatronStrategy:
        strategy = MegatronStrategy(micro_batch_size=2, checkpoint=CheckpointConfig(keep_host_buffers=False))
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = one_process_trainer(steps, strategy=strategy, callbacks=[Probe(), saver], enable_checkpointing=True)
        data = DataLoader(synthetic_tokens(8 * steps, 32, 256, seed=2), batch_size=4)
        trainer.fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data, ckpt_path=ckpt_path)
        return strategy

    fit(3)
    assert [held for held, _ in seen] == [0, 0, 0]
    allocations = [count for _, count in seen[1:]]
    assert allocations[1] > allocations[0] > 0  # each save allocated its buffers again
    full = dict(losses)
    seen.clear()
    losses.clear()
    fit(3, ckpt_path=str(tmp_path / "step=1.ckpt"))
    assert seen[0][0] == 0  # the load's buffers were given back too
    assert losses == {2: full[2], 3: full[3]}  # resumed exactly from step 1 (steps 2 and 3 again)


def test_checkpoints_without_the_model_weights_resume_exactly(tmp_path: Path) -> None:
    """CheckpointConfig(save_model_weights=False) (bf16 weights): the trained weights are stored once, as the fp32
    main weights (the checkpoint is smaller by the bf16 copy); a resume continues exactly as from a full checkpoint,
    and the loads of the weights alone (validate with ckpt_path, load_from_checkpoint, a LoRA module's frozen base)
    rebuild the same bf16 weights from the main weights."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, tiny_gpt
    from lightning_megatron.data.corpus import synthetic_tokens
    from tests.conftest import one_process_trainer

    losses: dict[int, float] = {}

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses[trainer.global_step] = float(outputs["loss"])

    data = DataLoader(synthetic_tokens(24, 32, 256, seed=2), batch_size=4)

    def trainer(steps: int, lean: bool, directory: Path) -> L.Trainer:
        strategy = MegatronStrategy(micro_batch_size=2, checkpoint=CheckpointConfig(save_model_weights=not lean))
        saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        return one_process_trainer(
            steps, strategy=strategy, callbacks=[Losses(), saver], enable_checkpointing=True, precision="bf16-mixed"
        )

    trainer(3, lean=False, directory=tmp_path / "full").fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data)
    full = dict(losses)
    losses.clear()
    trainer(3, lean=True, directory=tmp_path / "lean").fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data)
    assert losses == full  # saving less changes nothing in the run
    lean, whole = (
        _tensors(tmp_path / "lean" / "step=1.ckpt", tmp_path),
        _tensors(tmp_path / "full" / "step=1.ckpt", tmp_path),
    )
    weights = {k for k in whole if not k.startswith("optimizer.") and whole[k].dtype == torch.bfloat16}
    assert weights
    assert not weights & set(lean)  # no bf16 weight stored...
    assert set(lean) == set(whole) - weights  # ...and nothing else left out
    for key, main in lean.items():
        if key.startswith("optimizer.state.param."):  # ...the main weights, which round to them
            torch.testing.assert_close(
                main.bfloat16(), whole[key.removeprefix("optimizer.state.param.")], rtol=0, atol=0
            )
    losses.clear()
    trainer(3, lean=True, directory=tmp_path / "again").fit(
        MegatronLMModule(tiny_gpt(), lr=1e-2), data, ckpt_path=str(tmp_path / "lean" / "step=1.ckpt")
    )
    assert losses == {2: full[2], 3: full[3]}  # resumed exactly
    val = DataLoader(synthetic_tokens(8, 32, 256, seed=5), batch_size=4)
    metrics = [
        one_process_trainer(1, precision="bf16-mixed").validate(
            MegatronLMModule(tiny_gpt(), lr=1e-2), val, ckpt_path=str(tmp_path / kind / "step=3.ckpt"), verbose=False
        )[0]["val_loss"]
        for kind in ("full", "lean")
    ]
    assert metrics[0] == metrics[1]
    # load_from_checkpoint, and a LoRA module whose frozen base is the checkpoint (B = 0: the base's outputs)
    predictor = one_process_trainer(1, precision="bf16-mixed")
    tokens = DataLoader(synthetic_tokens(4, 32, 256, seed=6), batch_size=4)
    full_model = MegatronLMModule.load_from_checkpoint(tmp_path / "full" / "step=3.ckpt")
    want = torch.cat(predictor.predict(full_model, tokens))
    for lora in (None, {"rank": 2, "alpha": 4.0}):
        module = MegatronLMModule.load_from_checkpoint(tmp_path / "lean" / "step=3.ckpt", lora=lora)
        torch.testing.assert_close(torch.cat(predictor.predict(module, tokens)), want, rtol=0, atol=0)


def test_the_weights_stored_once_need_the_distributed_optimizer(tmp_path: Path) -> None:
    """save_model_weights=False without the distributed optimizer is refused before any process group exists;
    with save_model_weights left on, that optimizer's checkpoints resume exactly (the load looks for main weights
    only in the distributed optimizer's state)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, tiny_gpt
    from lightning_megatron.data.corpus import synthetic_tokens
    from tests.conftest import one_process_trainer

    losses: dict[int, float] = {}

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses[trainer.global_step] = float(outputs["loss"])

    data = DataLoader(synthetic_tokens(12, 32, 256, seed=3), batch_size=4)

    def fit(lean: bool, ckpt_path: str | None = None) -> None:
        checkpoint = CheckpointConfig(save_model_weights=not lean)
        strategy = MegatronStrategy(micro_batch_size=2, use_distributed_optimizer=False, checkpoint=checkpoint)
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = one_process_trainer(3, strategy=strategy, callbacks=[Losses(), saver], enable_checkpointing=True)
        trainer.fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data, ckpt_path=ckpt_path)

    with pytest.raises(ValueError, match=r"save_model_weights=False\) .* use_distributed_optimizer=False"):
        fit(lean=True)
    fit(lean=False)
    full = dict(losses)
    losses.clear()
    fit(lean=False, ckpt_path=str(tmp_path / "step=1.ckpt"))
    assert losses == {2: full[2], 3: full[3]}


def test_read_threads_none_is_the_cpus_per_rank() -> None:
    from lightning_megatron import CheckpointConfig, MegatronStrategy
    from lightning_megatron.checkpointing.load.reading import default_threads

    writer = MegatronStrategy().checkpoint_writer
    assert writer.config.read_threads is None  # by default: the CPUs per rank
    writer.prepare(distributed_optimizer=True, processes_per_node=2)
    with writer.loading() as reading:
        assert reading.threads == default_threads(2) >= 1
    for threads in (1, 3):  # 1: Megatron's reader
        writer = MegatronStrategy(checkpoint=CheckpointConfig(read_threads=threads)).checkpoint_writer
        with writer.loading() as reading:
            assert reading.threads == threads


def test_async_saves_of_two_structures_without_kept_buffers_or_model_weights(tmp_path: Path) -> None:
    """Async saves with every option that changes what is staged: a full checkpoint and a weights-only one every step
    (two structures: a save plan each, reused from their second save on), host buffers given back after each save,
    the full checkpoints without the model's weights. Saving changes nothing in the run, the full checkpoint
    resumes exactly, and the weights-only one holds the run's final weights."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_megatron import CheckpointConfig, MegatronLMModule, MegatronStrategy, tiny_gpt
    from lightning_megatron.data.corpus import synthetic_tokens
    from tests.conftest import one_process_trainer

    losses: dict[int, float] = {}
    plans: list[tuple[int, list[bool]]] = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses[trainer.global_step] = float(outputs["loss"])
            writer = trainer.strategy.checkpoint_writer
            plans.append((writer.plans.made, writer.plans.reused()))

    data = DataLoader(synthetic_tokens(24, 32, 256, seed=2), batch_size=4)

    def fit(steps: int, saving: bool, ckpt_path: str | None = None) -> None:
        checkpoint = CheckpointConfig(async_save=saving, keep_host_buffers=False, save_model_weights=False)
        strategy = MegatronStrategy(micro_batch_size=2, checkpoint=checkpoint)
        savers = [ModelCheckpoint(dirpath=tmp_path / "full", every_n_train_steps=1, save_top_k=-1, filename="{step}"),
                  ModelCheckpoint(dirpath=tmp_path / "weights", every_n_train_steps=1, save_top_k=-1,
                                  filename="{step}", save_weights_only=True, monitor="train_loss")  # (a state key)
                  ] if saving else []  # fmt: skip
        trainer = one_process_trainer(steps, strategy=strategy, callbacks=[Probe(), *savers], enable_checkpointing=True)
        trainer.fit(MegatronLMModule(tiny_gpt(), lr=1e-2), data, ckpt_path=ckpt_path)

    fit(3, saving=False)
    unsaved = dict(losses)
    losses.clear()
    fit(3, saving=True)
    assert losses == unsaved
    # Saves happen after each step's end: at step k's end the plans of steps 1..k-1 exist.
    assert [made for made, _ in plans[-3:]] == [0, 2, 2]
    assert plans[-1][1] == [True, True]  # both structures' plans are reused
    losses.clear()
    fit(3, saving=False, ckpt_path=str(tmp_path / "full" / "step=2.ckpt"))
    assert losses == {3: unsaved[3]}
    predictor = one_process_trainer(1)
    tokens = DataLoader(synthetic_tokens(4, 32, 256, seed=6), batch_size=4)
    want = torch.cat(
        predictor.predict(MegatronLMModule.load_from_checkpoint(tmp_path / "full" / "step=3.ckpt"), tokens)
    )
    got = torch.cat(
        predictor.predict(MegatronLMModule.load_from_checkpoint(tmp_path / "weights" / "step=3.ckpt"), tokens)
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    untrained = torch.cat(predictor.predict(MegatronLMModule(tiny_gpt()), tokens))
    assert not torch.equal(untrained, want)  # the checkpoints hold trained weights
