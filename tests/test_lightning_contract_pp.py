"""Lightning's contract where it depends on the pipeline stage (PP=2, 2 processes, CPU): rank 0 holds the first
stage, which computes no loss, yet its callbacks, ModelCheckpoint and CSVLogger see each step's own values."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import child_env, run_forked

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("contract_pp")
    args = {"out": str(out), "steps": STEPS}
    run_forked("contract_worker:main", args, 2, out, child_env(CUDA_VISIBLE_DEVICES=""), expect=out / "rank1.json")
    return {"out": out, "ranks": {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}}


@pytest.mark.multiprocess
def test_callbacks_on_every_stage_see_their_step(run: dict) -> None:
    for rank, result in run["ranks"].items():
        steps = result["steps"]
        assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
        for row in steps:
            assert row["train_loss"] == pytest.approx(row["loss"], rel=1e-6), rank
            assert row["mean_loss"] == pytest.approx(row["train_loss"], rel=1e-6), rank  # loss_fn's (sum, count)
            assert row["ones"] == 1.0
            assert row["rank_value"] == float(rank)  # sync_dist reduced over the data-parallel group only
        assert result["norms"] == pytest.approx([row["grad_norm"] for row in steps], rel=1e-5)
    assert run["ranks"][0]["steps"] == [
        {**row, "rank_value": 0.0} for row in run["ranks"][1]["steps"]
    ]  # the first stage logged the last stage's values


@pytest.mark.multiprocess
def test_model_checkpoint_ranks_steps_by_their_own_loss(run: dict) -> None:
    for result in run["ranks"].values():
        losses = {row["step"]: row["train_loss"] for row in result["steps"]}
        best = min(losses, key=losses.get)
        assert result["best_score"] == pytest.approx(losses[best], rel=1e-6)
        assert result["best_path"] == f"step={best}.ckpt"


@pytest.mark.multiprocess
def test_loss_fn_logs_reach_rank_zero_s_logger(run: dict) -> None:
    rows = list(csv.DictReader(next((run["out"] / "csv").glob("version_*/metrics.csv")).open()))
    train = [row for row in rows if row["train_loss"]]
    assert len(train) == STEPS
    for row in train:
        assert float(row["mean_loss"]) == pytest.approx(float(row["train_loss"]), rel=1e-6)
        assert float(row["ones"]) == 1.0


@pytest.mark.multiprocess
def test_test_loss_and_save_after_fit(run: dict) -> None:
    for result in run["ranks"].values():
        assert result["test_loss"] == pytest.approx(result["val_loss"], rel=1e-6)
        resumed = result["resumed"]  # two steps after the after-fit save and after the last step's checkpoint
        assert len(resumed["final"]) == 2
        assert resumed["final"] == pytest.approx(resumed["every"], rel=1e-6)
