"""Mixture-of-experts GPT with expert parallelism (Megatron's MoE layer, local spec)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_megatron import MegatronStrategy, ParallelSizes, tiny_gpt
from tests.conftest import run_worker

MOE = {"model": {"num_moe_experts": 4, "moe_router_topk": 2}}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("moe")
    run_worker({**MOE, "devices": 1, "max_steps": 2, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2}, tmp)
    return str(tmp / "ckpt" / "epoch=0-step=2.ckpt")


@pytest.mark.multiprocess
def test_expert_parallel_matches_one_process(moe_checkpoint: str, tmp_path: Path) -> None:
    """The same MoE weights give the same validation loss with all experts on one rank and split over two."""
    args = {**MOE, "mode": "validate", "limit_val_batches": 2, "resume": moe_checkpoint}
    one = run_worker({**args, "devices": 1}, tmp_path)
    ep2 = run_worker({**args, "devices": 2, "ep": 2}, tmp_path)
    assert ep2["val"] == pytest.approx(one["val"], rel=2e-5)


@pytest.mark.multiprocess
def test_expert_parallel_trains(tmp_path: Path) -> None:
    result = run_worker({**MOE, "devices": 2, "ep": 2, "max_steps": 3}, tmp_path)
    assert len(result["train"]) == 3
    assert len(set(result["train"].values())) == 3  # weights move


def test_expert_parallel_errors() -> None:
    with pytest.raises(ValueError, match=r"num_moe_experts=4 must be divisible by ep=3"):
        tiny_gpt(num_moe_experts=4).validate_parallel(ParallelSizes(ep=3))
    with pytest.raises(ValueError, match=r"ep=2"):
        tiny_gpt().validate_parallel(ParallelSizes(ep=2))  # a dense model has no experts to split
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tp\*pp\*ep"):
        MegatronStrategy(tp=2, ep=2)._sizes.data_parallel_size(2)
