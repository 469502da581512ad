"""The benchmarks' own arithmetic that CPU can check (the runs themselves need GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


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


def test_tables_blocks_in_the_readmes_are_current() -> None:
    """benchmarks/README.md's tables and README.md's headline and checkpoint tables are the script's output."""
    from benchmarks import tables

    for path, start, end, content in tables.blocks():
        assert tables.block(path.read_text(), start, end) == "\n" + content, (
            f"{path.name} {start}: run python benchmarks/tables.py --write"
        )


def test_every_result_line_is_a_json_object() -> None:
    """benchmarks/results/*.jsonl is JSON lines: every line one object (metadata as fields, prose in a sidecar .md)."""
    import json

    from benchmarks import tables

    files = sorted(tables.RESULTS.glob("*.jsonl"))
    assert files
    problems = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                data = json.loads(line)
            except json.JSONDecodeError as error:
                problems.append(f"{path.name}:{number}: {error}: {line[:60]!r}")
                continue
            if not isinstance(data, dict):
                problems.append(f"{path.name}:{number}: a JSON {type(data).__name__}, not an object")
    assert not problems, "\n".join(problems)


def test_tables_refuse_a_line_that_is_not_a_json_object(tmp_path: Path) -> None:
    from benchmarks import tables

    (tmp_path / "2026-01-01-h100-x.jsonl").write_text('{"a": 1}\n# a comment\n')
    with pytest.raises(ValueError, match=r"2026-01-01-h100-x.jsonl:2: not a JSON line"):
        list(tables.rows(tmp_path))
    (tmp_path / "2026-01-01-h100-x.jsonl").write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"2026-01-01-h100-x.jsonl:2: a JSON list, not an object"):
        list(tables.rows(tmp_path))


def test_every_table_names_date_commit_and_device() -> None:
    from benchmarks import tables

    text = "\n".join(content for _, _, _, content in tables.blocks())
    lines = text.splitlines()
    headers = [line for line, below in zip(lines, lines[1:], strict=False) if below.startswith("|---")]
    assert len(headers) >= 10
    for header in headers:
        cells = [cell.strip() for cell in header.strip("|").split("|")]
        assert {"date", "dates"} & set(cells), header
        assert {"commit", "commits"} & set(cells), header
        assert "device" in cells, header


def test_a_row_names_its_device_and_commit() -> None:
    from benchmarks import table_rows

    assert table_rows.Row({"gpu": "NVIDIA H100 80GB HBM3"}, "2026-01-01-h200-x.jsonl", 1).device == "H100"
    assert table_rows.Row({}, "2026-01-01-h200x2-x.jsonl", 1).device == "H200"
    assert table_rows.Row({"device": "cpu"}, "2026-01-01-cpu-x.jsonl", 1).device == "CPU"
    assert table_rows.Row({"commit": "abc1234+uncommitted"}, "f", 1).commit == "abc1234+uncommitted"
    assert table_rows.Row({"code": "landed (ce9370d)"}, "f", 1).commit == "ce9370d"
    assert table_rows.Row({}, "f", 1).commit == ""


def test_tables_count_as_the_package() -> None:
    from benchmarks import table_rows
    from lightning_megatron.parallel.counts import model_flops_per_token

    assert table_rows.flops_per_token(900, 100, 16, 2048, 2048) == model_flops_per_token(900, 100, 16, 2048, 2048)
    total, n = table_rows.llama_parameters(**table_rows.SHAPES["1b"])
    assert total == 953_223_168  # what throughput.py's 1.0B rows record as params
    assert n == total - 32000 * 2048
    assert table_rows.llama_parameters(**table_rows.SHAPES["1b"], tied=True) == (n, n)
    assert table_rows.llama_parameters(**table_rows.SHAPES["125m"])[0] == 134_105_856
    assert table_rows.llama_parameters(**table_rows.SHAPES["3b"])[0] == 3_141_172_224
    row = {"shape": "1b", "seq": 2048, "tokens_per_s": 85_072, "params": total}
    assert table_rows.standard_mfu(row) == pytest.approx(0.4928, abs=1e-4)  # N = params - V x H
    assert table_rows.standard_mfu({**row, "flops_params": n, "flops_frozen_params": 0}) == table_rows.standard_mfu(row)


def test_checkpoint_tables_take_each_mode_from_its_newest_run_against_that_runs_disk() -> None:
    from benchmarks import table_checkpoints, table_rows

    def row(file: str, **data: object) -> table_rows.Row:
        return table_rows.Row({"shape": "1b", "checkpoint_bytes": 10e9, **data}, file, 1)

    old, new = "2026-01-01-h100-checkpoint-1b-a.jsonl", "2026-01-02-h100-checkpoint-1b-a.jsonl"
    found = [
        row(old, mode="sync", save=0, save_blocked_s=20.0, published_after_s=20.0),
        row(old, mode="async", save=0, save_blocked_s=0.3, published_after_s=30.0),
        row(old, mode="disk", disk_write_gb_s=1.0, disk_read_gb_s=2.0),
        row(new, mode="async", save=0, save_blocked_s=0.3, published_after_s=6.0),
        row(new, mode="disk", disk_write_gb_s=0.5, disk_read_gb_s=1.0),
    ]
    lines = [line for line in table_checkpoints.checkpoint_table(found) if line.startswith("| 1b |")]
    assert [line.split(" | ")[1] for line in lines] == ["sync", "async"]
    assert "| 2.00 | 2026-01-01 |" in lines[0]  # 20 s against 10 GB at 1 GB/s
    assert "| 0.30 | 2026-01-02 |" in lines[1]  # 6 s against 10 GB at 0.5 GB/s: the newer run's own disk


def test_checkpoint_tables_measure_a_save_against_the_mean_of_its_runs_disk_probes() -> None:
    from benchmarks import table_checkpoints, table_rows

    file = "2026-01-02-h100-checkpoint-1b-a.jsonl"
    found = [
        table_rows.Row({"shape": "1b", "mode": "disk", "probe": "before", "disk_write_gb_s": 2.0}, file, 1),
        table_rows.Row({"shape": "1b", "checkpoint_bytes": 10e9, "mode": "sync", "published_after_s": 7.2}, file, 2),
        table_rows.Row({"shape": "1b", "mode": "disk", "probe": "after", "disk_write_gb_s": 1.0}, file, 3),
    ]
    table = table_checkpoints.checkpoint_table(found)
    [line] = [line for line in table if line.startswith("| 1b |")]
    assert "| 1.08 | 2026-01-02 |" in line  # 7.2 s against 10 GB at 1.5 GB/s (6.67 s), not at 2.0 or 1.0 GB/s
    assert any(line.startswith("| 1b-a | 2.00 (before), 1.00 (after) |") for line in table)  # the disk table


def test_the_checkpoint_benchmark_expects_the_bytes_the_1b_checkpoint_holds() -> None:
    import argparse

    from benchmarks import checkpoint

    # The 1B shape's 953,223,168 parameters: the host buffers of its saves held 13,345,124,352 bytes (14 per
    # parameter: bf16 weight, fp32 main weight, two fp32 Adam moments), 11,438,678,016 without the bf16 weights.
    full = argparse.Namespace(shape="1b", model_weights=True, cpu=False)
    assert checkpoint.expected_bytes(full) == 13_345_124_352
    assert checkpoint.expected_bytes(argparse.Namespace(shape="1b", model_weights=False, cpu=False)) == 11_438_678_016


def test_a_file_with_a_time_is_the_latest_of_its_date_and_moe_rows_pair_with_their_calls_dense_row(
    tmp_path: Path,
) -> None:
    import json

    from benchmarks import table_rows, table_throughput

    def line(shape: str, tokens: int, **extra: object) -> str:
        data = {"variant": "lightning_megatron", "shape": shape, "seq": 2048, "micro_batch": "4x2", "kernels": "auto"}
        return json.dumps({**data, "tokens_per_s": tokens, "gpu": "NVIDIA H100 80GB HBM3", **extra}) + "\n"

    moe = {"num_moe_experts": 32, "moe_router_topk": 8, "flops_params": 1}
    (tmp_path / "2026-01-01-h100-moe.jsonl").write_text(line("1b", 100) + line("moe1b", 60, **moe))
    (tmp_path / "2026-01-01T0930-h100-headline.jsonl").write_text(line("1b", 110))
    (tmp_path / "2026-01-01-h100-zzz.jsonl").write_text(line("qwen3moe", 90, num_layers=4, **moe))
    found = list(table_rows.rows(tmp_path))
    assert [row.device for row in found] == ["H100"] * 4
    latest = table_rows.throughput(found).latest.values()
    assert [r.data["tokens_per_s"] for r in latest if r.data["shape"] == "1b"] == [110]  # the timed file: after
    table = table_throughput.moe_against_dense_table(found)
    assert "moe1b" in table[-2]
    assert "| 60 | 100 | 0.60x |" in table[-2]
    assert not [line for line in table if "qwen3moe" in line]  # 4 layers and no dense row of its call: no ratio


def test_attention_benchmark_runs_every_case_in_its_tiny_cpu_mode() -> None:
    """benchmarks/attention.py end to end on CPU (tiny sizes): a row per case and length, none failed, FLOPs counted
    over the attended pairs, and each part's summary."""
    from benchmarks import attention
    from benchmarks.shapes import attended_pairs

    lines = attention.main(["--device", "cpu", "--tiny", "--query-groups", "2"])  # grouped keys/values too
    rows = {(row["case"], row["seq"]): row for row in lines if "case" in row}
    assert not [row for row in rows.values() if "error" in row], [row.get("error") for row in rows.values()]
    s = attention.sizes(attention.parse(["--tiny", "--query-groups", "2"]))
    for part, cases in attention.PARTS.items():
        assert {(case, seq) for case in cases for seq in s.seqs[part]} <= rows.keys()
    for row in rows.values():
        pairs = row["batch"] * row["heads"] * attended_pairs(row["seq"], (row["window_size"] or [None])[0])
        assert row["flops"] == 2 * pairs * (4 * row["head_dim_qk"] + 3 * row["head_dim_v"])
        assert row["ms"] > 0
        assert row["batch"] * row["seq"] == s.tokens
    assert rows["mla_sdpa", 32]["head_dim_qk"] == rows["sdpa", 32]["head_dim_qk"] + s.mla_rope_dim
    assert rows["flex_window", 128]["window_size"] == [s.window - 1, 0]
    assert rows["flex_window", 128]["flops"] < rows["flex_causal", 128]["flops"]
    assert rows["flex_sinks", 64]["kernel"] == "masked_reference"  # the CPU path of kernels.variants
    assert rows["flex_sinks", 64]["query_groups"] == 2
    summaries = {(row["summary"], row["seq"]): row for row in lines if "summary" in row}
    assert summaries.keys() == {(part, seq) for part in attention.PARTS for seq in s.seqs[part]}
    assert summaries["a", 64]["mla_cost_per_flop_over_sdpa"] > 0
    assert summaries["c", 64]["sinks_over_flex_causal"] > 0
    assert summaries["c", 64]["fused_sinks_over_flex_causal"] > 0
    assert summaries["c", 64]["column_sinks_over_flex_causal"] > 0


def test_the_sinks_candidates_compute_the_models_sink_attention() -> None:
    """attention.py's sinks candidates against the model's sink attention (``flex_sinks``: kernels.variants'
    reference path on CPU) for the same sink logits, grouped keys too. What CPU can check: the rescaling formula
    (``flex_sinks_fused``'s CPU stand-in, a dense attention rescaled the same way; its FlexAttention call and
    compilation run on GPU only) and the sink-column formulation's forward through FlexAttention's eager path (no
    FlexAttention backward on CPU: the column's gradient, through the ``score_mod``, is FlexAttention's on GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    from benchmarks import attention

    s = attention.sizes(attention.parse(["--tiny", "--query-groups", "2"]))
    cpu = torch.device("cpu")
    built = {case: attention.build(case, s, cpu, torch.float32) for case in ("flex_sinks_fused", "flex_sinks")}
    generator = torch.Generator().manual_seed(0)
    sinks = torch.randn(s.heads, generator=generator) * 3
    for b in built.values():
        (param,) = b.params
        with torch.no_grad():
            param.copy_(sinks)
    seq, batch = 64, 2
    q = torch.randn(seq, batch, s.heads, s.head_dim, generator=generator)
    k, v = (torch.randn(seq, batch, s.groups, s.head_dim, generator=generator) for _ in range(2))
    want = built["flex_sinks"].step(q, k, v)
    assert want.shape == (seq, batch, s.heads * s.head_dim)
    torch.testing.assert_close(built["flex_sinks_fused"].step(q, k, v), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        heads_first = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
        mask = attention.sink_column_mask(seq, cpu)
        column = attention.sink_column_attention(*heads_first, sinks, s.head_dim**-0.5, flex_attention, mask)
    torch.testing.assert_close(column.permute(2, 0, 1, 3).reshape(seq, batch, -1), want, rtol=1e-5, atol=1e-5)
    plain = attention.build("flex_causal", s, cpu, torch.float32).step(q, k, v)
    assert (plain - want).abs().max() > 0.1  # the sinks move the output: the comparisons can fail


def test_windowed_pairs_and_flops_count_the_keys_inside_each_window() -> None:
    from benchmarks.shapes import attended_pairs, needed_attention_flops

    for seq, window in [(1, 0), (5, 0), (5, 1), (7, 3), (7, 6), (7, 50), (9, None)]:
        brute = sum(min(query, seq if window is None else window) + 1 for query in range(seq))
        assert attended_pairs(seq, window) == brute, (seq, window)
    full = 6 * 64 * 100
    assert needed_attention_flops((False, False), 64, 100, 9) == 2 * full
    assert needed_attention_flops((True, False), 64, 100, 9) == round(full + full * attended_pairs(100, 9) / 5050)


def test_throughput_window_options_and_the_gpt_oss_shape_map_to_model_fields() -> None:
    from benchmarks import throughput
    from lightning_megatron.gpt.attention_variants import window_layers
    from lightning_megatron.gpt.hf.families.gpt_oss import GptOss

    args = throughput.parse(["--variants", "a", "--seq-length", "16384", "--window", "1024", "--window-every", "6"])
    config = throughput.model_config(args)
    assert (config.window_size, config.window_attn_skip_freq) == ((1023, 0), 6)
    assert [i + 1 for i, windowed in enumerate(window_layers(config)) if not windowed] == [6, 12]  # Gemma 3's 5:1
    row = throughput.attention_fields(args, 10**10)
    assert row["windowed_layers"] == 14
    assert row["sliding_window"] == 1024
    assert 0 < row["flops_per_token_needed"] < row["flops_per_token"] == 10**10  # mfu keeps the standard count
    assert throughput.attention_fields(throughput.parse(["--variants", "a"]), 5)["window_size"] is None
    gpt_oss = throughput.model_config(throughput.parse(["--shape", "gptoss1b", "--variants", "a"]))
    assert GptOss().matches(gpt_oss)  # what the GPT-OSS import would build (sinks, GLU offset, quick_gelu, ...)
    assert gpt_oss.add_bias_linear
    assert gpt_oss.activation_func_clamp_value == 7.0
    assert window_layers(gpt_oss) == (True, False) * 8
    assert gpt_oss.window_size == (127, 0)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--window-every", "6"], "--window-every needs --window"),
        (["--window", "0"], "--window 0"),
        (["--window", "64", "--window-every", "1"], "--window-every 1"),
    ],
)
def test_throughput_refuses_bad_window_options(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import throughput

    with pytest.raises(SystemExit):
        throughput.parse(["--variants", "a", *argv])
    assert match in capsys.readouterr().err


def test_cutting_a_shape_cuts_its_per_layer_moe_pattern() -> None:
    from benchmarks import throughput

    config = throughput.model_config(throughput.parse(["--variants", "a", "--shape", "dsv3_1b", "--num-layers", "5"]))
    assert config.num_layers == 5
    assert tuple(config.moe_layer_freq) == (0, 1, 1, 1, 1)  # the dense first layer kept, 16 entries cut to 5
