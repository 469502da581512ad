"""The benchmarks' own arithmetic that CPU can check (the runs themselves need GPUs)."""

from __future__ import annotations

import pytest


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


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_counts_leave_the_input_embedding_out(tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.recorders import hf_counts

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=100, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    counts = hf_counts(model)
    total = sum(p.numel() for p in model.parameters())
    assert counts["params"] == total
    assert counts["flops_params"] == (total if tied else total - 100 * 32)  # a tied matrix counts once, as the head


def test_stock_variant_builds_megatron_core_alone() -> None:
    """Variant b0's chunk: Megatron-Core's local spec and modules only, the same parameters and count as b's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from benchmarks.raw_megatron import build_chunk
    from benchmarks.recorders import megatron_counts
    from lightning_megatron import tiny_gpt
    from tests.conftest import one_process_megatron

    config = tiny_gpt()
    with one_process_megatron(port=29673):
        stock = build_chunk(config, config.to_transformer_config(kernels="local"), True, True, None, "local", True)
        ours = build_chunk(config, config.to_transformer_config(kernels="torch"), True, True, None, "torch", False)
        assert {type(m).__module__.split(".")[0] for m in stock.modules()} <= {"megatron", "torch"}
        assert any(isinstance(m, DotProductAttention) for m in stock.modules())
        assert any(type(m).__module__.startswith("lightning_megatron") for m in ours.modules())
        assert megatron_counts([stock]) == megatron_counts([ours])
        assert megatron_counts([stock])["flops_params"] == megatron_counts([stock])["params"] - 256 * 64


def test_tables_print_the_current_figures(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import tables

    tables.main([])
    out = capsys.readouterr().out
    one_b = [line for line in out.splitlines() if line.startswith("| (a) Trainer + MegatronStrategy | 1b | 1 GPU |")]
    assert one_b, out
    assert "MFU" in out


def test_tables_block_in_the_readme_is_current() -> None:
    from benchmarks import tables

    text = tables.README.read_text()
    block = text[text.index(tables.START) + len(tables.START) : text.index(tables.END)]
    assert block == "\n" + tables.render(), "run: python benchmarks/tables.py --write"


def test_tables_count_as_the_package() -> None:
    from benchmarks import tables
    from lightning_megatron.parallel.counts import model_flops_per_token

    assert tables.flops_per_token(900, 100, 16, 2048, 2048) == model_flops_per_token(900, 100, 16, 2048, 2048)
    total, n = tables.llama_parameters(**tables.SHAPES["1b"])
    assert total == 953_223_168  # what throughput.py's 1.0B rows record as params
    assert n == total - 32000 * 2048
    assert tables.llama_parameters(**tables.SHAPES["1b"], tied=True) == (n, n)
    assert tables.llama_parameters(**tables.SHAPES["125m"])[0] == 134_105_856
    assert tables.llama_parameters(**tables.SHAPES["3b"])[0] == 3_141_172_224
    row = {"shape": "1b", "seq": 2048, "tokens_per_s": 85_072, "params": total}
    assert tables.standard_mfu(row) == pytest.approx(0.4928, abs=1e-4)  # N = params - V x H
    assert tables.standard_mfu({**row, "flops_params": n, "flops_frozen_params": 0}) == tables.standard_mfu(row)


def test_checkpoint_tables_take_each_mode_from_its_newest_run_against_that_runs_disk() -> None:
    from benchmarks import tables

    def row(file: str, **data: object) -> tables.Row:
        return tables.Row({"shape": "1b", "checkpoint_bytes": 10e9, **data}, file, 1)

    old, new = "2026-01-01-h100-checkpoint-1b-a.jsonl", "2026-01-02-h100-checkpoint-1b-a.jsonl"
    found = [
        row(old, mode="sync", save=0, save_blocked_s=20.0, published_after_s=20.0),
        row(old, mode="async", save=0, save_blocked_s=0.3, published_after_s=30.0),
        row(old, mode="disk", disk_write_gb_s=1.0, disk_read_gb_s=2.0),
        row(new, mode="async", save=0, save_blocked_s=0.3, published_after_s=6.0),
        row(new, mode="disk", disk_write_gb_s=0.5, disk_read_gb_s=1.0),
    ]
    lines = [line for line in tables.checkpoint_table(found) if line.startswith("| 1b |")]
    assert [line.split(" | ")[1] for line in lines] == ["sync", "async"]
    assert "| 2.00 | 2026-01-01 |" in lines[0]  # 20 s against 10 GB at 1 GB/s
    assert "| 0.30 | 2026-01-02 |" in lines[1]  # 6 s against 10 GB at 0.5 GB/s: the newer run's own disk


def test_checkpoint_tables_measure_a_save_against_the_mean_of_its_runs_disk_probes() -> None:
    from benchmarks import tables

    file = "2026-01-02-h100-checkpoint-1b-a.jsonl"
    found = [
        tables.Row({"shape": "1b", "mode": "disk", "probe": "before", "disk_write_gb_s": 2.0}, file, 1),
        tables.Row({"shape": "1b", "checkpoint_bytes": 10e9, "mode": "sync", "published_after_s": 7.2}, file, 2),
        tables.Row({"shape": "1b", "mode": "disk", "probe": "after", "disk_write_gb_s": 1.0}, file, 3),
    ]
    table = tables.checkpoint_table(found)
    [line] = [line for line in table if line.startswith("| 1b |")]
    assert "| 1.08 | 2026-01-02 |" in line  # 7.2 s against 10 GB at 1.5 GB/s (6.67 s), not at 2.0 or 1.0 GB/s
    assert any("2.00 (before), 1.00 (after) GB/s write" in line for line in table)


def test_the_checkpoint_benchmark_expects_the_bytes_the_1b_checkpoint_holds() -> None:
    import argparse

    from benchmarks import checkpoint

    # The 1B shape's 953,223,168 parameters: the host buffers of its saves held 13,345,124,352 bytes (14 per
    # parameter: bf16 weight, fp32 main weight, two fp32 Adam moments), 11,438,678,016 without the bf16 weights.
    full = argparse.Namespace(shape="1b", model_weights=True, cpu=False)
    assert checkpoint.expected_bytes(full) == 13_345_124_352
    assert checkpoint.expected_bytes(argparse.Namespace(shape="1b", model_weights=False, cpu=False)) == 11_438_678_016
