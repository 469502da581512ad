"""The other tables of benchmarks/README.md, one benchmark each: fp8 against bf16 (the loss), EMA of the weights, MoE
experts in fp8, packed rows and their attention kernels, the attention kernels alone, the async-save writer's memory,
and the per-step batch check.
"""

from __future__ import annotations

import re
from typing import Any

from benchmarks.table_rows import Row, cell, newest, number, shape_label, variant_label


def fp8_loss_table(all_rows: list[Row]) -> list[str]:
    """benchmarks/fp8_convergence.py with CUDA graphs: for each fp8 format, the mean validation loss after 300 steps
    of the 1B shape over its seeds, against the mean of bf16's runs of the same seeds (the latest run of each)."""
    runs: dict[tuple[str, Any], Row] = {}
    for row in all_rows:
        data = row.data
        if "val_loss" not in data or data.get("steps") != 300 or not data.get("cuda_graphs"):
            continue
        if data.get("fp8_bf16_layers") or any(word in str(data.get("code", "")) for word in ("discarded", "not kept")):
            continue
        fp8 = "e4m3" if "e4m3" in (data.get("fp8"), data.get("grad_dtype")) else data.get("fp8")
        runs[(fp8, data.get("seed"))] = row
    out: list[str] = []
    for fp8 in ("e4m3", "hybrid"):
        seeds = [seed for (kind, seed) in runs if kind == fp8 and ("none", seed) in runs]
        if not seeds:
            continue
        mine = [runs[(fp8, seed)] for seed in seeds]
        bf16 = [runs[("none", seed)] for seed in seeds]
        ours = sum(r.data["val_loss"] for r in mine) / len(mine)
        theirs = sum(r.data["val_loss"] for r in bf16) / len(bf16)
        both = mine + bf16
        dates = ", ".join(sorted(dict.fromkeys(r.date for r in both)))
        commits = ", ".join(dict.fromkeys(r.commit or "-" for r in both))
        devices = ", ".join(dict.fromkeys(r.device for r in both))
        out.append(
            f"| {fp8} | {len(seeds)} | {ours:.4f} | {theirs:.4f} | {ours / theirs - 1:+.1%} | {dates} | {commits} | "
            f"{devices} |"
        )
    if not out:
        return []
    return [
        "#### fp8 against bf16: the loss",
        "",
        "`python benchmarks/fp8_convergence.py --fp8 none|hybrid|e4m3`: the 1B shape with a vocabulary of 256 on byte "
        "text, 300 steps of 4 x 2 x 2,048 tokens with CUDA graphs, the validation loss at the end: the mean over the "
        "seeds run in fp8, against the mean of bf16's runs of the same seeds.",
        "",
        "| fp8 | seeds | fp8 loss | bf16 loss | fp8 above bf16 | dates | commits | device |",
        "|---|---|---|---|---|---|---|---|",
        *out,
        "",
    ]


def ema_tables(all_rows: list[Row]) -> list[str]:
    """The newest EMA run (files named ``...-ema...``): the training steps without and with
    ``MegatronEMA``, in their order, and one update timed alone (``benchmarks/ema_update.py``)."""
    files = [r for r in all_rows if re.search(r"-ema[-.]", r.file)]
    steps = [r for r in files if "tokens_per_s" in r.data and "variant" in r.data]
    steps = [r for r in steps if r.file == max(r.file for r in steps)]  # the newest run only (rows sort by file)
    updates = newest([r for r in all_rows if r.data.get("bench") == "ema_update"])
    out: list[str] = []
    if steps:
        out += [
            "#### EMA of the weights: training steps",
            "",
            "`bash benchmarks/run_lists.sh ema`: variant (a) without and with `MegatronEMA` updated after every step, "
            "in turn, each row its own process.",
            "",
            "| variant | shape | tokens/s | step s | peak memory GiB | date | commit | device |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in steps:
            data = row.data
            out.append(
                f"| {variant_label(data)} | {shape_label(data)} | {data['tokens_per_s']:,} | "
                f"{number(data.get('step_time_s'), 4)} | {number(data.get('peak_memory_gib'), 2)} | {cell(row)}"
            )
        out.append("")
    if updates:
        out += [
            "#### EMA of the weights: one update",
            "",
            "`python benchmarks/ema_update.py`: one update of the 1B shape's average from its weights, timed alone.",
            "",
            "| way | parameters | ms | GB/s at 10 bytes per parameter | date | commit | device |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in updates:
            data = row.data
            out.append(
                f"| {data.get('way')} | {data.get('params', 0):,} | {number(data.get('ms'), 3)} | "
                f"{number(data.get('gb_per_s_at_10_bytes'))} | {cell(row)}"
            )
        out.append("")
    return out


def moe_fp8_table(all_rows: list[Row]) -> list[str]:
    """The MoE expert MLP's grouped GEMMs in fp8 against bf16 (``benchmarks/moe_fp8_probe.py``), newest run."""
    found = newest([r for r in all_rows if "-moe-fp8-probe" in r.file and "gemm" in r.data])
    if not found:
        return []
    first = found[0].data
    out = [
        "#### MoE experts in fp8",
        "",
        "`python benchmarks/moe_fp8_probe.py`: the grouped GEMMs of one layer's expert MLP, forward and backward "
        f"({first.get('routed_rows', 0):,} routed "
        f"rows, {first.get('num_moe_experts')} experts, hidden {first.get('hidden_size')}, ffn "
        f"{first.get('moe_ffn_hidden_size')}): bf16 (`torch._grouped_mm`) against fp8 e4m3 with row-wise scales "
        "(`torch._scaled_grouped_mm`); the casts to fp8 they need, compiled, on their own.",
        "",
        "| GEMM | bf16 ms | fp8 ms | fp8 casts ms | date | commit | device |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in found:
        data = row.data
        out.append(
            f"| {data['gemm']} | {number(data.get('bf16_ms'), 2)} | {number(data.get('fp8_ms'), 2)} | "
            f"{number(data.get('fp8_casts_compiled_ms'), 2)} | {cell(row)}"
        )
    return [*out, ""]


PACKING_MODES = {"packed": "packed rows", "budget": "token budget", "padded": "padded to the longest document"}
ATTENTION_KERNELS = {
    "sdpa_unpacked": "SDPA, each document alone (causal)",
    "flex_packed": "FlexAttention, packed, document mask",
    "varlen_packed": "torch varlen_attn, packed",
    "sdpa_mask_packed": "SDPA, packed, boolean mask",
}


def packing_tables(all_rows: list[Row]) -> list[str]:
    """benchmarks/packing.py: the latest row of each mode and row length, and of each attention kernel."""
    latest: dict[tuple, Row] = {}
    kernels_latest: dict[str, Row] = {}
    for row in all_rows:
        data = row.data
        if data.get("mode") in PACKING_MODES and "useful_tokens_per_s" in data:
            key = (data["row_length"], data.get("docs_per_step"), data.get("cp") or 1, data["mode"])
            latest[key] = row
        elif data.get("benchmark") == "packed_attention":
            kernels_latest[data["kernel"]] = row
    out: list[str] = []
    if latest:
        out += [
            "#### Packed rows, token budgets and padding",
            "",
            "`python benchmarks/packing.py --mode packed,budget,padded`: the 1B shape on documents of 64-4,096 tokens. "
            "`useful`: the documents' own tokens per second; "
            "`computed`: every token the model ran, padding included.",
            "",
            "| mode | row length | documents per step | useful tokens/s | computed tokens/s | padding | date | commit "
            "| device |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        modes = list(PACKING_MODES)
        for key in sorted(latest, key=lambda k: (k[0], k[1] or 0, k[2], modes.index(k[3]))):
            row = latest[key]
            data = row.data
            out.append(
                f"| {PACKING_MODES[data['mode']]} | {data['row_length']:,} | {data.get('docs_per_step', '-')} | "
                f"{data['useful_tokens_per_s']:,} | {data['computed_tokens_per_s']:,} | "
                f"{data['padding_fraction']:.1%} | {cell(row)}"
            )
        out.append("")
    if kernels_latest:
        out += [
            "#### Attention kernels for packed rows",
            "",
            "`python benchmarks/packing.py --mode attention`: 8 documents of 2,048 tokens in one row, 16 heads of 128, "
            "bf16, forward and backward.",
            "",
            "| kernel | ms | date | commit | device |",
            "|---|---|---|---|---|",
        ]
        for name, row in sorted(kernels_latest.items(), key=lambda item: item[1].data["fwd_bwd_ms"]):
            out.append(f"| {ATTENTION_KERNELS.get(name, name)} | {number(row.data['fwd_bwd_ms'], 2)} | {cell(row)}")
        out.append("")
    return out


def batch_check_table(all_rows: list[Row]) -> list[str]:
    """The per-step batch check's host work (``benchmarks/batch_check.py``): the latest row of each batch size."""
    latest: dict[tuple, Row] = {}
    for row in all_rows:
        if row.data.get("benchmark") == "batch_check":
            latest[(row.data["world"], row.data["seq"], row.data["batch"])] = row
    if not latest:
        return []
    out = [
        "#### The per-step batch check",
        "",
        "`torchrun --nproc-per-node 2 benchmarks/batch_check.py`: the check's host work per DataLoader batch, timed "
        "alone (medians): the batch's fingerprint, and the all-reduce of two integers over a model replica's gloo "
        "group that compares the fingerprints.",
        "",
        "| ranks | batch | seq | fingerprint ms | all-reduce ms | date | commit | device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(latest):
        row = latest[key]
        data = row.data
        out.append(
            f"| {data['world']} | {data['batch']} | {data['seq']:,} | {number(data['fingerprint_us'] / 1000, 2)} | "
            f"{number(data['allreduce_us'] / 1000, 2)} | {cell(row)}"
        )
    return [*out, ""]


def writer_memory_table(all_rows: list[Row]) -> list[str]:
    """The async-save writer process's memory once it serves (``benchmarks/writer_memory.py``), newest run."""
    found = newest([r for r in all_rows if r.data.get("bench") == "writer_memory"])
    if not found:
        return []
    out = [
        "#### The async-save writer process",
        "",
        "`python benchmarks/writer_memory.py`: its memory once it serves (imports done, no save yet): resident in "
        "all, its own heap, and mapped files "
        "(shared libraries, shared with other processes that map them); `started`: from its start until it idled.",
        "",
        "| resident GB | heap GB | mapped files GB | started s | CPUs | torch | date | commit | device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in found:
        data = row.data
        out.append(
            f"| {number(data['rss_gb'], 2)} | {number(data.get('rss_anon_gb'), 2)} | "
            f"{number(data.get('rss_file_gb'), 2)} | {number(data.get('start_s'))} | {data.get('cpus', '-')} | "
            f"{data.get('torch', '-')} | {cell(row)}"
        )
    return [*out, ""]


def attention_kernel_table(all_rows: list[Row]) -> list[str]:
    """benchmarks/attention.py on a GPU: the latest row of each case and sequence length."""
    latest: dict[tuple[str, int], Row] = {}
    for row in all_rows:
        data = row.data
        if data.get("benchmark") == "attention" and "case" in data and "ms" in data and data.get("device") != "cpu":
            latest[(data["case"], data["seq"])] = row
    if not latest:
        return []
    out = [
        "#### Attention kernels",
        "",
        "`python benchmarks/attention.py`: the core attention modules alone, forward + backward, bf16, 16,384 tokens "
        "per call, 16 heads (query/key/value heads of 128; MLA's query/key 192, value 128). TFLOP/s counts the "
        "attended (query, key) pairs; a window's `causal-equivalent` counts full causal attention's pairs; `longest "
        "kernel`: the GPU kernel of the most time in one step (torch.profiler), which names SDPA's backend.",
        "",
        "| case | kernel | tokens per sequence | ms | forward ms | TFLOP/s | causal-equivalent TFLOP/s "
        "| longest kernel | date | commit | device |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, seq in sorted(latest, key=lambda key: (key[1], key[0])):
        data = latest[(case, seq)].data
        out.append(
            f"| `{case}` | {data.get('kernel', '-')} | {seq:,} | {number(data['ms'], 3)} | "
            f"{number(data.get('fwd_ms'), 3)} | {number(data.get('tflops'))} | "
            f"{number(data.get('tflops_causal_equivalent'))} | {_longest_kernel(data)} | {cell(latest[(case, seq)])}"
        )
    return [*out, ""]


def _longest_kernel(data: dict[str, Any]) -> str:
    """The first of a row's ``kernels`` (longest first), its name cut to 48 characters, in backticks."""
    kernels = data.get("kernels") or []
    if not kernels:
        return "-"
    name = re.sub(r" \([\d.]+ ms\)$", "", kernels[0]).replace("|", "/")
    return f"`{name[:48]}`"
