"""Lightning's CSV and TensorBoard loggers under pipeline parallelism (PP=2, 2 processes): rank 0 -- the first
stage, which computes no loss -- writes exactly one row per logged step with the last stage's values, one
TensorBoard event file, and val_ppl (torchmetrics) agrees with val_loss."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_megatron.data.tokens import write_token_file
from tests.conftest import child_env, run_forked

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("loggers")
    tokens = np.random.default_rng(1).integers(0, 256, (48, 32))
    write_token_file([tokens.ravel()], tmp / "tokens.bin")
    args = {"tokens": str(tmp / "tokens.bin"), "devices": 2, "pp": 2, "max_steps": STEPS, "logs": str(tmp / "logs"),
            "val_check_interval": 2, "limit_val_batches": 2, "out": str(tmp)}  # fmt: skip
    run_forked("ux_worker:main", args, 2, tmp, child_env(CUDA_VISIBLE_DEVICES=""), expect=tmp / "rank1.json")
    ranks = {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)}
    return {"logs": tmp / "logs", "ranks": ranks}


@pytest.mark.multiprocess
def test_csv_has_one_row_per_logged_step(run: dict) -> None:
    versions = sorted((run["logs"] / "csv").iterdir())
    assert [v.name for v in versions] == ["version_0"]  # one writer, one version
    rows = list(csv.DictReader((versions[0] / "metrics.csv").open()))
    train = [r for r in rows if r["train_loss"]]
    val = [r for r in rows if r["val_loss"]]
    assert [int(r["step"]) for r in train] == list(range(STEPS))  # no duplicates, none missing
    assert len(rows) == len(train) + len(val)
    assert all(r["lr"] and r["tokens_per_s"] and r["grad_norm"] for r in train)
    # Rank 0 (first stage) logged the last stage's loss: what every rank returned for the step.
    first, last = run["ranks"][0]["train"], run["ranks"][1]["train"]
    assert first == last
    assert [float(r["train_loss"]) for r in train] == pytest.approx(list(last.values()), rel=1e-6)
    assert [int(r["step"]) for r in val] == [1, 3]  # after steps 2 and 4
    for row in val:
        assert float(row["val_ppl"]) == pytest.approx(math.exp(float(row["val_loss"])), rel=1e-5)
    assert run["ranks"][1]["metrics"]["val_ppl"] == pytest.approx(float(val[-1]["val_ppl"]), rel=1e-6)


@pytest.mark.multiprocess
def test_tensorboard_written_once_by_rank_zero(run: dict) -> None:
    versions = sorted((run["logs"] / "tb").iterdir())
    assert [v.name for v in versions] == ["version_0"]
    events = list(versions[0].glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    scalars = EventAccumulator(str(events[0])).Reload()
    losses = scalars.Scalars("train_loss")
    assert [e.step for e in losses] == list(range(STEPS))
    assert [e.value for e in losses] == pytest.approx(list(run["ranks"][1]["train"].values()), rel=1e-6)
    assert len(scalars.Scalars("val_ppl")) == 2
