"""Every rank of a model replica sees the same batch, whatever the data path, and Lightning's gradient accumulation
makes one optimizer step of k batches: real 4- and 2-process runs over gloo (tests/data_worker.py, several short fits
per launch)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import child_env, run_forked
from tests.data_worker import write_litdata

pytestmark = pytest.mark.multiprocess

MISMATCH = "differs between the ranks of one model replica"


def _launch(runs: list[dict], devices: int, tmp_path, **extra: object) -> dict:  # noqa: ANN001
    out = tmp_path / f"data-{os.urandom(4).hex()}.json"
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}
    args = {"devices": devices, "runs": runs, "out": str(out), **extra}
    run_forked("data_worker:main", args, devices, tmp_path, env, timeout=900, expect=out)
    results = json.loads(out.read_text())
    crashed = {name: r["crash"] for name, r in results.items() if "crash" in r}
    assert not crashed, crashed
    return results


def _same(a: dict, b: dict) -> None:
    assert "error" not in a, a
    assert "error" not in b, b
    assert a["train"] == pytest.approx(b["train"], rel=1e-6, abs=1e-6)
    assert a["lr"] == pytest.approx(b["lr"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # the gradient's scale, which Adam hides
    assert a["weights"] == pytest.approx(b["weights"], rel=1e-6)
    assert a["steps"] == b["steps"]


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DP=2 x TP=2 (4 processes): global-rank sharding, DataParallelShard, HF datasets streaming, accumulation."""
    tp = {"tp": 2}
    runs = [
        {"name": "global_rank", "strategy": tp, "data": "global_rank", "batch_size": 4},
        {"name": "map_ordered", "strategy": tp, "data": "map_ordered", "batch_size": 4},
        {"name": "dp_shard", "strategy": tp, "data": "dp_shard", "batch_size": 4},
        {"name": "hf", "strategy": tp, "data": "hf", "batch_size": 4},
        {"name": "accumulate", "strategy": tp, "data": "map_ordered", "batch_size": 2, "accumulate": 2},
        {"name": "unchecked", "strategy": {**tp, "check_batches": False}, "data": "global_rank", "batch_size": 4},
    ]
    return _launch(runs, 4, tmp_path_factory.mktemp("dp2_tp2"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """PP=2 and CP=2 (2 processes): global-rank sharding, LitData, accumulation through the pipeline schedule."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    write_litdata(str(tmp / "litdata"))
    pp, cp = {"pp": 2}, {"cp": 2}
    runs = [
        {"name": "pp_global_rank", "strategy": pp, "data": "global_rank", "batch_size": 4},
        {"name": "pp_map_ordered", "strategy": pp, "data": "map_ordered", "batch_size": 4, "micro_batch_size": 2,
         "max_steps": 4},
        {"name": "pp_litdata", "strategy": pp, "data": "litdata", "batch_size": 4, "micro_batch_size": 2,
         "max_steps": 4, "ckpt_dir": str(tmp / "ckpt")},
        {"name": "pp_litdata_resumed", "strategy": pp, "data": "litdata", "batch_size": 4, "micro_batch_size": 2,
         "max_steps": 4, "resume": str(tmp / "ckpt" / "step=2.ckpt")},
        {"name": "pp_accumulate", "strategy": pp, "data": "map_ordered", "batch_size": 2, "accumulate": 2,
         "micro_batch_size": 2, "max_steps": 4},
        {"name": "cp_global_rank", "strategy": cp, "data": "global_rank", "batch_size": 4},
    ]  # fmt: skip
    return _launch(runs, 2, tmp, litdata_dir=str(tmp / "litdata"))


@pytest.mark.parametrize("name", ["global_rank"])
def test_global_rank_sharding_fails_before_any_forward_at_tp2(dp2_tp2: dict, name: str) -> None:
    result = dp2_tp2[name]
    assert MISMATCH in result.get("error", ""), result
    assert result["error"].startswith("ValueError")
    assert result["batches"] == 0  # the first step failed: no batch trained
    assert "data_parallel_rank" in result["error"]
    assert "check_batches=False" in result["error"]


@pytest.mark.parametrize("name", ["pp_global_rank", "cp_global_rank"])
def test_global_rank_sharding_fails_at_pp2_and_cp2(two_ranks: dict, name: str) -> None:
    result = two_ranks[name]
    assert MISMATCH in result.get("error", ""), result
    assert result["batches"] == 0


def test_the_check_can_be_turned_off(dp2_tp2: dict) -> None:
    assert "error" not in dp2_tp2["unchecked"], dp2_tp2["unchecked"]  # trains on the mix, as the user asked


@pytest.mark.parametrize("name", ["dp_shard", "hf"])
def test_iterables_sharded_by_data_parallel_rank_equal_the_sampler(dp2_tp2: dict, name: str) -> None:
    _same(dp2_tp2[name], dp2_tp2["map_ordered"])


def test_litdata_at_pp2_equals_map_style(two_ranks: dict) -> None:
    _same(two_ranks["pp_litdata"], two_ranks["pp_map_ordered"])


def test_litdata_resumes_mid_epoch_at_pp2(two_ranks: dict) -> None:
    full, resumed = two_ranks["pp_litdata"], two_ranks["pp_litdata_resumed"]
    assert "error" not in resumed, resumed
    assert resumed["train"] == pytest.approx(full["train"][2:], rel=1e-6)  # the loader's own state, restored


@pytest.mark.parametrize(("fixture", "name", "reference"), [
    ("dp2_tp2", "accumulate", "map_ordered"), ("two_ranks", "pp_accumulate", "pp_map_ordered"),
])  # fmt: skip
def test_accumulation_equals_one_step_over_the_doubled_batch(
    request: pytest.FixtureRequest, fixture: str, name: str, reference: str
) -> None:
    results = request.getfixturevalue(fixture)
    accumulated, single = results[name], results[reference]
    _same(accumulated, single)  # loss (token-weighted over both batches), LR, weights, global_step
    assert accumulated["batches"] == 2 * single["batches"] == 2 * single["steps"]
