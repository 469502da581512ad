"""The benchmarks' own arithmetic that CPU can check (the runs themselves need GPUs)."""

from __future__ import annotations

import argparse

import pytest


@pytest.mark.parametrize(("devices", "tp", "pp", "cp"), [(2, 2, 1, 1), (4, 2, 2, 1), (4, 2, 1, 2), (16, 2, 2, 2)])
def test_replica_ranks_follow_megatron_rank_order(devices: int, tp: int, pp: int, cp: int) -> None:
    from megatron.core.parallel_state import RankGenerator

    from benchmarks.throughput import data_parallel, replica_ranks

    args = argparse.Namespace(devices=devices, tp=tp, pp=pp, cp=cp)
    dp = data_parallel(args)
    assert dp * tp * pp * cp == devices
    # Megatron's default order (initialize_model_parallel's): the first tensor x pipeline group is one replica.
    groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp").get_ranks("tp-pp")
    assert replica_ranks(args) == groups[0]


def test_gc_pauses_records_the_collections_of_its_window_only() -> None:
    import gc

    from benchmarks.recorders import GcPauses

    pauses = GcPauses()
    gc.collect()  # before the window
    pauses.start()
    gc.collect()  # a full collection
    gc.collect(0)
    pauses.stop()
    gc.collect()  # after it: not counted
    report = pauses.report()
    assert report["collections"][0] >= 1
    assert report["collections"][2] == 1
    assert len(report["gen2_ms"]) == 1
    assert report["ms"] >= report["gen2_ms"][0]
