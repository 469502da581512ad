"""Mixture-of-experts GPT with expert parallelism (Megatron's MoE layer, local spec)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_megatron import MegatronStrategy, ParallelSizes, tiny_gpt
from tests.conftest import run_here, run_worker

MOE = {"model": {"num_moe_experts": 4, "moe_router_topk": 2}}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process: 2 steps, checkpointed (``ckpt``); what its ModelSummary counted (``summary``)."""
    tmp = tmp_path_factory.mktemp("moe")
    run = {**MOE, "devices": 1, "max_steps": 2, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2, "summary": True}
    result = run_here(run, tmp)
    return {"ckpt": str(tmp / "ckpt" / "epoch=0-step=2.ckpt"), "summary": result["summary"]}


@pytest.mark.multiprocess
def test_expert_parallel_matches_one_process(moe_run: dict, tmp_path: Path) -> None:
    """The same MoE weights give the same validation loss with all experts on one rank and split over two, on
    packed rows (documents attending only to themselves; the plain rows' EP run: test_expert_parallel_trains)."""
    packed = {"model": {**MOE["model"], "kernels": "torch"}, "packed": True}
    args = {**packed, "mode": "validate", "limit_val_batches": 2, "resume": moe_run["ckpt"]}
    one = run_here({**args, "devices": 1}, tmp_path)
    ep2 = run_worker({**args, "devices": 2, "ep": 2}, tmp_path)
    assert ep2["val"] == pytest.approx(one["val"], rel=2e-5)


@pytest.mark.multiprocess
def test_expert_parallel_trains(moe_run: dict, tmp_path: Path) -> None:
    fused = {"model": {**MOE["model"], "gradient_accumulation_fusion": True}}  # expert linears fused too
    result = run_worker({**fused, "devices": 2, "ep": 2, "max_steps": 3, "summary": True}, tmp_path)
    assert len(result["train"]) == 3
    assert len(set(result["train"].values())) == 3  # weights move
    # The Trainer's ModelSummary counts the experts of both ranks, the dense weights (data-parallel copies) once.
    summary, one_process = result["summary"], moe_run["summary"]
    assert summary["class"] == "MegatronModelSummary"
    assert (summary["total"], summary["trainable"]) == (one_process["total"], one_process["trainable"])
    assert summary["rows"] == one_process["rows"]  # at EP=2 both ranks hold every layer: each row whole


def test_expert_parallel_errors() -> None:
    with pytest.raises(ValueError, match=r"num_moe_experts=4 must be divisible by ep=3"):
        tiny_gpt(num_moe_experts=4).validate_parallel(ParallelSizes(ep=3))
    with pytest.raises(ValueError, match=r"ep=2"):
        tiny_gpt().validate_parallel(ParallelSizes(ep=2))  # a dense model has no experts to split
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tp\*pp\*ep"):
        MegatronStrategy(tp=2, ep=2)._sizes.data_parallel_size(2)


def test_optimizer_split_mismatch_is_refused(tmp_path: Path) -> None:
    """A one-optimizer checkpoint (MoE at ep=1) resumed where Megatron splits dense and expert optimizers (ep=2)."""
    from types import SimpleNamespace

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lightning_megatron.checkpointing import checks

    def state(*keys: str) -> dict:
        return {key: ShardedTensor.from_rank_offsets(key, torch.zeros(2)) for key in keys}

    one = SimpleNamespace(state_dict_metadata={"optimizer.state.exp_avg.w": 0, "w": 0})
    split = state("chained_0.optimizer.state.exp_avg.w", "chained_1.optimizer.state.exp_avg.e")
    with pytest.raises(ValueError, match=r"holds the state of 1 optimizer\(s\) and this run builds 2"):
        checks.check_optimizer_split(tmp_path, one, split)
    checks.check_optimizer_split(tmp_path, one, state("optimizer.state.exp_avg.w"))  # the same split loads
    two = SimpleNamespace(state_dict_metadata={k: 0 for k in split})
    checks.check_optimizer_split(tmp_path, two, split)


@pytest.mark.multiprocess
def test_resume_at_another_optimizer_split_raises(moe_run: dict, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"holds the state of 1 optimizer\(s\) and this run builds 2"):
        run_worker({**MOE, "devices": 2, "ep": 2, "max_steps": 3, "resume": moe_run["ckpt"]}, tmp_path)
