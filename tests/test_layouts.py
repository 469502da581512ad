"""Layout parity: every parallel layout continues the single-process loss curve from one checkpoint.

Weight init differs between layouts (per-rank seeds, different layers per stage), so parity is tested the way
users rely on it: one process trains 2 steps and checkpoints; every layout resumes from that checkpoint and must
reproduce the single-process ``train_loss`` of the next steps (and ``val_loss``) within 2e-4 relative.
Tier 1 runs over gloo on CPU; the ``gpu`` variants run the same over NCCL when CUDA GPUs are present.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from tests.conftest import run_here, run_worker, run_workers

REL = 2e-4
CKPT_STEP = 2
MAX_STEPS = 4
VAL = {"limit_val_batches": 2, "val_check_interval": 2, "sanity": 2}
# Every run keeps an EMA of the weights (validation runs on it; the checkpoint holds it, resharded at each layout) and
# state of the module's own beside its chunks (a counter buffer and a small head, restored at each layout).
AVERAGED = {"ema": 0.5, "own_state": True}

LAYOUTS = {
    # grad reduce / param gather overlapped, several buckets; loss_fn logs and grad norms over data-parallel shards;
    # weight gradients fused into main_grad (kernels/linear.py) here, at PP=2, TP=2 and TP=2+SP x CP=2
    "dp2": {
        "devices": 2,
        "overlap": True,
        "logs": True,
        "metrics": True,
        "model": {"gradient_accumulation_fusion": True},
    },
    # the GPU default path: SDPA, fused CE, weight gradients accumulated into main_grad in the GEMM, at TP=2; the
    # Trainer's ModelSummary counts both shards
    "tp2": {
        "devices": 2,
        "tp": 2,
        "model": {"kernels": "torch", "gradient_accumulation_fusion": True},
        "summary": True,
        "metrics": True,
    },
    "pp2": {"devices": 2, "pp": 2, "model": {"gradient_accumulation_fusion": True}, "metrics": True},
    "pp2_vpp2": {"devices": 2, "pp": 2, "vpp": 2},
    # logs and grad norms over TP x PP; a user's own ModelSummary subclass prints the whole model's count too
    "tp2_pp2": {"devices": 4, "tp": 2, "pp": 2, "logs": True, "metrics": True, "summary": "subclass"},
    "tp2_sp": {"devices": 2, "tp": 2, "sp": True},
    # context parallelism (kernels='auto' is the torch-native attention, on CPU too): K/V all-gathered;
    # with SP each CP shard's tokens split over TP. (CP=2 alone, unpacked: tests/test_hf_layouts.py against
    # transformers.)
    "tp2_sp_cp2": {
        "devices": 4,
        "tp": 2,
        "cp": 2,
        "sp": True,
        "model": {"gradient_accumulation_fusion": True},
        "metrics": True,
    },
    # data-parallel groups of ranks {0, 2} and {1, 3}: the one layout whose data-parallel group is neither every rank
    # nor one rank (torchmetrics sync within each; the training curve too)
    "dp2_tp2": {"devices": 4, "tp": 2, "metrics": True},
    "cp2": {"devices": 2, "cp": 2},  # GPU only here (NCCL); on CPU, CP=2 alone runs in tests/test_hf_layouts.py
}
# On CPU, tp2_sp_cp2 covers sequence parallelism (tp2_sp runs on GPUs). "metrics": torchmetrics Sum/Mean/Cat metrics
# of the validation batches (tests/logged_module.py's Metered) equal one process's: synced over the data-parallel
# group, not over the model-parallel (TP, PP) or context-parallel peers, which see the same batch.
CPU_LAYOUTS = [name for name in LAYOUTS if name not in ("tp2_sp", "cp2", "dp2")] + ["dp2"]  # dp2's launch: last
# Packed rows (documents of 3-20 tokens in rows of 32, attention and loss per document) from the same checkpoint.
# The reference names kernels='torch'; kernels='auto' must pick kernels that take such rows (test_torchrun_launch).
PACKED = {"packed": True, "model": {"kernels": "torch"}}
# (CP=2 alone on packed rows: tests/test_hf_layouts.py, against transformers per document.)
PACKED_LAYOUTS = {
    "tp2_sp_cp2": {"devices": 4, "tp": 2, "cp": 2, "sp": True},
    "cp2_pp2": {"devices": 4, "cp": 2, "pp": 2},  # context x pipeline parallelism
}


# The resumes launched as users launch them, by their tests (and launcher): fresh interpreters importing the stack,
# under Lightning's launcher one rank after the other (seconds of a core left idle).
LAUNCHED = {
    "test_layout_continues_single_process_curve[dp2]": ("lightning", LAYOUTS["dp2"]),
    "test_torchrun_launch": ("torchrun", {"devices": 2, "tp": 2, "packed": True}),  # no kernels named: 'auto'
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict]:
    """One process: a run that checkpoints at step 2, and the uninterrupted run to step 4 (with validation).

    Then the ``LAUNCHED`` resumes of the tests selected start in the background (``reference["launched"]``), side by
    side with the tests in between; their tests check their results."""
    tmp = tmp_path_factory.mktemp("reference")
    ckpt_dir = tmp / "ckpt"
    saving = {"devices": 1, "max_steps": CKPT_STEP, "ckpt_dir": str(ckpt_dir), "ckpt_every": CKPT_STEP, **AVERAGED}
    saved = run_here(saving, tmp)
    full = run_here({"devices": 1, "max_steps": MAX_STEPS, **VAL, **AVERAGED, "summary": True, "metrics": True}, tmp)
    ckpt = ckpt_dir / f"epoch=0-step={CKPT_STEP}.ckpt"
    assert (ckpt / "metadata.json").is_file(), sorted(p.name for p in ckpt_dir.iterdir())
    result = {"ckpt": str(ckpt), "full": full, "tmp": tmp, "own_state": saved["own_state"]["at_end"], "launched": {}}
    selected = {item.name for item in request.session.items if item.module is request.module}
    with concurrent.futures.ThreadPoolExecutor(len(LAUNCHED)) as pool:
        for test, (launcher, layout) in LAUNCHED.items():
            if test in selected:
                (tmp / launcher).mkdir()
                result["launched"][test] = pool.submit(_resume, layout, result, tmp / launcher, launcher=launcher)
        yield result


def _launched(test: str, reference: dict, tmp_path: Path) -> dict:
    """The result of ``test``'s launched resume: started by ``reference``, or now."""
    if test in reference["launched"]:
        return reference["launched"][test].result()
    launcher, layout = LAUNCHED[test]
    return _resume(layout, reference, tmp_path, launcher=launcher)


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: steps {sorted(got)} != {sorted(want)}"
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=REL), f"{what} at step {step}: {got[step]} != {value}"


def _resume_args(layout: dict, reference: dict, **extra: object) -> dict:
    return {**layout, "max_steps": MAX_STEPS, "resume": reference["ckpt"], **VAL, **AVERAGED, **extra}


def _resume(layout: dict, reference: dict, tmp_path: Path, launcher: str = "fork", **extra: object) -> dict:
    return run_worker(_resume_args(layout, reference, **extra), tmp_path, launcher=launcher)


def _assert_continues(resumed: dict, full: dict) -> None:
    """A run resumed at CKPT_STEP has the training losses of ``full`` after that step and its final validation."""
    _assert_close(resumed["train"], {k: v for k, v in full["train"].items() if int(k) > CKPT_STEP}, "train_loss")
    _assert_close(resumed["val"], {str(MAX_STEPS): full["val"][str(MAX_STEPS)]}, "val_loss")


def test_resume_is_exact_at_one_layout(reference: dict, tmp_path: Path) -> None:
    resumed = _resume({"devices": 1}, reference, tmp_path)
    full_after = {k: v for k, v in reference["full"]["train"].items() if int(k) > CKPT_STEP}
    assert resumed["train"] == full_after  # bit-identical, not just close
    assert resumed["val"] == {str(MAX_STEPS): reference["full"]["val"][str(MAX_STEPS)]}
    assert resumed["own_state"]["at_start"] == reference["own_state"]
    assert int(reference["own_state"]["steps_seen"]) == CKPT_STEP


@pytest.mark.multiprocess
def test_module_state_that_differs_within_a_replica_is_refused_at_the_save(tmp_path: Path) -> None:
    # At TP=2 both ranks of the one replica run the same steps; a counter that starts at the rank differs between them.
    args = {"devices": 2, "tp": 2, "max_steps": 1, "ckpt_dir": str(tmp_path / "ckpt"), "ckpt_every": 1}
    result = run_worker({**args, "own_state": "per_rank"}, tmp_path)
    assert re.search(r"differs between the ranks of one model replica .*: steps_seen", result["error"]), result
    assert not list((tmp_path / "ckpt").glob("*.ckpt"))


def test_training_changes_the_loss(reference: dict) -> None:
    # Guards against a strategy that "trains" without updating weights: the losses of the same run differ
    # step to step and validation after training differs from the sanity check before it.
    train = reference["full"]["train"]
    assert len(set(train.values())) == len(train)
    assert reference["full"]["val"]["-1"] != reference["full"]["val"][str(MAX_STEPS)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CPU_LAYOUTS)
def test_layout_continues_single_process_curve(name: str, reference: dict, tmp_path: Path) -> None:
    # DP=2 as a user's script runs: Lightning's launcher starts the second process (in the background: LAUNCHED).
    # The others fork their ranks (tests/forked.py); test_torchrun_launch covers torchrun.
    if name == "dp2":
        resumed = _launched(f"test_layout_continues_single_process_curve[{name}]", reference, tmp_path)
    else:
        resumed = _resume(LAYOUTS[name], reference, tmp_path)
    full = reference["full"]
    _assert_continues(resumed, full)
    assert resumed["callback_metrics"]["train_loss"] == pytest.approx(full["callback_metrics"]["train_loss"], rel=REL)
    if LAYOUTS[name].get("logs"):  # what rank 0's callbacks saw in each step
        assert sorted(resumed["contract"]) == [str(step) for step in range(CKPT_STEP + 1, MAX_STEPS + 1)]
        for step, seen in resumed["contract"].items():
            assert seen["train_loss"] == pytest.approx(resumed["train"][step], rel=1e-6)
            assert seen["mean_loss"] == pytest.approx(seen["train_loss"], rel=1e-6)  # reduced over DP ranks too
            assert seen["ones"] == 1.0
            assert seen["norm_total"] == pytest.approx(seen["grad_norm"], rel=1e-5)  # Megatron's own norm
    if LAYOUTS[name].get("summary"):
        _assert_whole_model_summary(resumed["summary"], full["summary"])
    assert resumed["own_state"]["at_start"] == reference["own_state"]  # the module's own state, restored
    if LAYOUTS[name].get("metrics"):  # the last validation's, as one process computes them
        for metric in ("val_rows", "val_mean_token", "val_ppl"):  # val_ppl: TokenPerplexity, which never syncs
            assert resumed["callback_metrics"][metric] == pytest.approx(full["callback_metrics"][metric], rel=REL)
        assert resumed["callback_metrics"]["val_rows"] == 16.0  # 2 batches of 8 rows (8 // dp on each replica)
        assert resumed["row_sums"] == full["row_sums"]  # every row once, in any order


def _assert_whole_model_summary(summary: dict, one_process: dict) -> None:
    """The Trainer's ModelSummary of a multi-process run counts what one process counts of the same ModelConfig."""
    if summary["class"] == "UserSummary":  # the user's subclass stays, counting the whole model
        assert f"{get_human_readable_count(one_process['total']):<10}Total params" in summary["printed"]
        return
    assert summary["class"] == "MegatronModelSummary"  # the strategy replaced Lightning's at connect
    for key in ("total", "trainable", "size_mb"):
        assert summary[key] == one_process[key], key
    # The chunks, and the module's own head beside them (OwnState), where the run has one: the top-level rows that
    # hold parameters (rows below describe this rank's stage; metrics hold none).
    top = [
        {name: n for name, n in rows.items() if "." not in name and n}
        for rows in (summary["rows"], one_process["rows"])
    ]
    assert top[0] == top[1]
    assert one_process["total"] == sum(top[1].values())
    assert f"{get_human_readable_count(one_process['total']):<10}Total params" in summary["printed"]  # rank 0's table


@pytest.fixture(scope="module")
def packed_reference(reference: dict) -> dict:
    """One process resuming the reference checkpoint on packed rows."""
    return run_here(_resume_args({"devices": 1, **PACKED}, reference), reference["tmp"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(PACKED_LAYOUTS))
def test_packed_layout_continues_single_process_curve(
    name: str, packed_reference: dict, reference: dict, tmp_path: Path
) -> None:
    # Packing changes what the model sees (another curve than the unpacked one), and every layout follows it.
    assert packed_reference["train"] != {k: v for k, v in reference["full"]["train"].items() if int(k) > CKPT_STEP}
    saves = {"ckpt_dir": str(tmp_path / "ckpt"), "ckpt_every": MAX_STEPS} if name == "tp2_sp_cp2" else {}
    resumed = _resume({**PACKED, **PACKED_LAYOUTS[name], **saves}, reference, tmp_path)
    _assert_close(resumed["train"], packed_reference["train"], "packed train_loss")
    _assert_close(resumed["val"], packed_reference["val"], "packed val_loss")
    if saves:  # and back: the TP=2+SP x CP=2 checkpoint validates at one process to the same loss
        ckpt = str(tmp_path / "ckpt" / f"epoch=0-step={MAX_STEPS}.ckpt")
        validate = {"mode": "validate", "limit_val_batches": 2, "resume": ckpt, **AVERAGED}  # the EMA weights
        one = run_here({"devices": 1, **PACKED, **validate}, tmp_path)
        assert one["val"] == pytest.approx(resumed["val"][str(MAX_STEPS)], rel=REL)


@pytest.mark.multiprocess
def test_token_budget_at_cp2_pp2_equals_fixed_micro_batches(reference: dict, tmp_path: Path) -> None:
    """Samples of 4-32 tokens: micro-batches of at most 70 tokens (each cut to its longest sample rounded up to a
    multiple of 2*cp, shapes sent between the pipeline stages, each CP rank holding its chunks of them) give the
    loss of fixed micro-batches of 2 padded samples at one process."""
    layouts = [{"devices": 1, "varlen": True}, {"devices": 4, "pp": 2, "cp": 2, "varlen": True, "max_tokens": 70}]
    fixed, budget = run_workers([_resume_args(layout, reference) for layout in layouts], tmp_path)  # side by side
    _assert_close(budget["train"], fixed["train"], "budgeted train_loss")
    # The budget was applied: micro-batches within 70 tokens, some cut below the fixed ones' 32.
    shapes = budget["shapes"]
    assert shapes, "no training micro-batch recorded"
    assert all(rows * length <= 70 and length % 4 == 0 for rows, length in shapes), shapes
    assert any(length < 32 for _, length in shapes), shapes
    _assert_close(budget["val"], fixed["val"], "budgeted val_loss")


@pytest.mark.multiprocess
def test_tied_embeddings_across_pipeline_stages(tmp_path: Path) -> None:
    """Tied input/output embeddings live on the first and the last stage at PP=2 and must stay one tensor."""
    tied = {"model": {"share_embeddings_and_output_weights": True}}
    ckpt_dir = tmp_path / "ckpt"
    # One process runs to MAX_STEPS, checkpointing at CKPT_STEP on the way (checkpointing does not change the run:
    # test_resume_is_exact_at_one_layout).
    saves = {"ckpt_dir": str(ckpt_dir), "ckpt_every": CKPT_STEP}
    full = run_here({**tied, "devices": 1, "max_steps": MAX_STEPS, **saves, "summary": True}, tmp_path)
    ckpt = str(ckpt_dir / f"epoch=0-step={CKPT_STEP}.ckpt")
    pp2 = {**LAYOUTS["pp2"], "model": {**LAYOUTS["pp2"]["model"], **tied["model"]}}  # the fused LM head too
    resumed = run_worker({**pp2, "max_steps": MAX_STEPS, "resume": ckpt, "summary": True}, tmp_path)
    _assert_close(resumed["train"], {k: v for k, v in full["train"].items() if int(k) > CKPT_STEP}, "tied train_loss")
    # The Trainer's ModelSummary on rank 0 (the first stage) counts both stages, the tied embedding once.
    _assert_whole_model_summary(resumed["summary"], full["summary"])
    assert resumed["summary"]["rows"]["chunks.0"] < full["summary"]["total"]  # a row below: the first stage's chunk


def test_auto_kernels_take_packed_rows_at_one_process(packed_reference: dict, reference: dict, tmp_path: Path) -> None:
    # ModelConfig(kernels='auto') on CPU: the packed run of kernels='torch', step for step ('auto' must never pick
    # kernels that refuse the batch, as Megatron's local attention refuses packed rows).
    auto = run_here(_resume_args({"devices": 1, "packed": True}, reference), tmp_path)
    assert auto["train"] == packed_reference["train"]
    assert auto["val"] == packed_reference["val"]


@pytest.mark.multiprocess
def test_torchrun_launch(packed_reference: dict, reference: dict, tmp_path: Path) -> None:
    """The same script under torchrun (processes started outside Lightning) continues the same curve: packed rows at
    TP=2 with kernels='auto', which must take them, following the one-process run of kernels='torch' (launched in
    the background: LAUNCHED)."""
    resumed = _launched("test_torchrun_launch", reference, tmp_path)
    _assert_close(resumed["train"], packed_reference["train"], "packed train_loss")
    _assert_close(resumed["val"], packed_reference["val"], "packed val_loss")


@pytest.mark.multiprocess
def test_sanity_validation_runs_with_pipeline_parallelism(tmp_path: Path) -> None:
    # Lightning's sanity check stays on (it is not silently disabled) and runs the forward-only schedule.
    result = run_worker({**LAYOUTS["pp2_vpp2"], "max_steps": 2, **VAL}, tmp_path)
    assert set(result["val"]) == {"-1", "2"}
    assert 5.0 < result["val"]["-1"] < 6.0  # ~ln(256) for an untrained byte-level model


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["pp2"])  # TP=2 and CP=2 logits: tests/test_hf_layouts.py, against transformers
def test_validate_and_predict_parity(name: str, reference: dict, tmp_path: Path) -> None:
    # One process and the layout: validation loss and predicted logits from the reference checkpoint (two
    # independent runs, launched side by side).
    args = {"mode": "validate+predict", "limit_val_batches": 2, "resume": reference["ckpt"], **AVERAGED}
    one, many = run_workers(
        [
            {**args, "devices": 1, "pred_out": str(tmp_path / "one")},
            {**LAYOUTS[name], **args, "pred_out": str(tmp_path / "many")},
        ],
        tmp_path,
    )
    one_logits = torch.load(tmp_path / "one.rank0.pt")
    assert many["val"] == pytest.approx(one["val"], rel=REL)
    for rank in range(LAYOUTS[name]["devices"]):
        logits = torch.load(tmp_path / f"many.rank{rank}.pt")
        assert logits.shape == one_logits.shape == (16, 32, 256)  # full vocabulary on every rank
        torch.testing.assert_close(logits, one_logits, rtol=1e-4, atol=1e-4)


def _gpu_resume_follows_the_curve(name: str, reference: dict, tmp_path: Path) -> None:
    _assert_continues(_resume(LAYOUTS[name], reference, tmp_path, accelerator="gpu"), reference["full"])


@pytest.mark.gpu(devices=2)
@pytest.mark.parametrize("name", ["dp2", "tp2", "tp2_sp", "pp2", "pp2_vpp2", "cp2"])
def test_gpu_layout_continues_single_process_curve(name: str, reference: dict, tmp_path: Path) -> None:
    """Tier 2: the CPU reference checkpoint resumed over NCCL on GPUs continues the same curve."""
    _gpu_resume_follows_the_curve(name, reference, tmp_path)


@pytest.mark.gpu(devices=4)
@pytest.mark.parametrize("name", ["tp2_pp2", "tp2_sp_cp2"])
def test_gpu_four_gpu_layout_continues_single_process_curve(name: str, reference: dict, tmp_path: Path) -> None:
    """Tier 2 on four GPUs: TP x PP and TP+SP x CP over NCCL continue the same curve."""
    _gpu_resume_follows_the_curve(name, reference, tmp_path)


@pytest.mark.gpu(devices=4)
def test_gpu_tp2_pp2_checkpoint_resumes_at_dp4_and_on_cpu(tmp_path: Path) -> None:
    """The other way round: a checkpoint written by TP=2 x PP=2 on four GPUs continues that run's curve at DP=4 on
    the GPUs and at one process on CPU."""
    ckpt_dir = tmp_path / "ckpt"
    saves = {"ckpt_dir": str(ckpt_dir), "ckpt_every": CKPT_STEP}
    full = run_worker({**LAYOUTS["tp2_pp2"], "max_steps": MAX_STEPS, **VAL, **saves, "accelerator": "gpu"}, tmp_path)
    ckpt = str(ckpt_dir / f"epoch=0-step={CKPT_STEP}.ckpt")
    for layout in ({"devices": 4, "accelerator": "gpu"}, {"devices": 1}):
        _assert_continues(_resume(layout, {"ckpt": ckpt}, tmp_path), full)
