"""Multi-node launch on localhost: two "nodes" of one process each train at DP=2 and reproduce the single-node
(devices=2) run exactly, started by Lightning's own launcher (``Trainer(num_nodes=2, devices=1)`` started twice with
``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``); the single-node reference's two ranks are forked from the test
session's fork server. (Processes started by torchrun, which Lightning joins through its
TorchElastic environment: tests/test_layouts.py::test_torchrun_launch, one node; tensor-parallel peers reading the
same samples: tests/hf_worker.py.) The same runs check what each rank read: data-parallel ranks on different nodes
read disjoint samples (TokenFileDataModule's sharding by the data-parallel rank)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_megatron.data.tokens import write_token_file
from tests.conftest import child_env, free_port, run_forked, run_together

WORKER = Path(__file__).parent / "ux_worker.py"
STEPS = 3
TIMEOUT = 300


def _launch(commands: list[tuple[list[str], dict[str, str]]], cwd: Path) -> None:
    """Start every command at once (the nodes must meet) and wait for all; each must succeed."""
    for proc in run_together([(cmd, env, cwd) for cmd, env in commands], TIMEOUT):
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def _results(out: Path) -> dict[int, dict]:
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == [0, 1], sorted(results)
    return results


def _worker(args: dict, out: Path) -> list[str]:
    out.mkdir()
    return [str(WORKER), json.dumps({**args, "out": str(out)})]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    tmp = tmp_path_factory.mktemp("multinode")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (64, 32))
    tokens[:, 16:] = tokens[:, :16]  # learnable: the second half repeats the first
    write_token_file([tokens.ravel()], tmp / "tokens.bin")
    args = {"tokens": str(tmp / "tokens.bin"), "max_steps": STEPS}
    env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    runs = {}

    # Lightning's launcher on each "node": Trainer(num_nodes=2, devices=1), node rank and rendezvous from the env.
    port, cmd = free_port(), _worker({**args, "devices": 1, "num_nodes": 2}, tmp / "lightning")
    node_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    nodes = [([sys.executable, *cmd], {**env, **node_env, "NODE_RANK": str(node)}) for node in (0, 1)]
    # The reference, one node of 2 processes (ranks forked from the session's fork server, which has imported the
    # stack: tests/forked.py), side by side with the two "nodes", which spend their first seconds importing it.
    (tmp / "single").mkdir()
    single = {**args, "devices": 2, "out": str(tmp / "single")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_forked, "ux_worker:main", single, 2, tmp, env, TIMEOUT)
        _launch(nodes, tmp)
        reference.result()
    runs["single"] = _results(tmp / "single")
    runs["lightning"] = _results(tmp / "lightning")
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", ["lightning"])
def test_two_nodes_match_one_node(runs: dict, launch: str) -> None:
    single, multi = runs["single"], runs[launch]
    assert len(single[0]["train"]) == STEPS
    for rank in range(2):
        assert multi[rank]["train"] == single[0]["train"]  # identical losses on every rank, bit for bit
        assert multi[rank]["samples"] == single[rank]["samples"]  # each global rank read what it read on one node
        # Global vs local ranks: node n holds global rank n as its local rank 0.
        assert (multi[rank]["world_size"], multi[rank]["global_rank"]) == (2, rank)
        assert (multi[rank]["node_rank"], multi[rank]["local_rank"]) == (rank, 0)
        assert multi[rank]["device"] == "cpu"
        assert (multi[rank]["dp_rank"], multi[rank]["tp_rank"]) == (rank, 0)
    losses = list(single[0]["train"].values())
    assert len(set(losses)) == STEPS  # the weights do change: the steps are not trivially equal


@pytest.mark.multiprocess
def test_ranks_read_their_data_parallel_shard(runs: dict) -> None:
    results = runs["lightning"]
    assert len(results[0]["samples"]) == STEPS
    for step in results[0]["samples"]:
        assert not set(results[0]["samples"][step]) & set(results[1]["samples"][step])  # DP ranks: disjoint
        assert len(results[0]["samples"][step]) == 4  # batch_size per data-parallel rank
