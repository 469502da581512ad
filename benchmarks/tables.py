"""Markdown tables of the current benchmark figures, from the committed rows in benchmarks/results/*.jsonl.

    python benchmarks/tables.py            # print the tables
    python benchmarks/tables.py --write    # rewrite the generated blocks of benchmarks/README.md and README.md

Every line of a result file is one JSON object (a line that is not raises, naming the file and line). Every table
names, per row, the date of its file, the commit of the code measured (``commit``, or a commit in the row's ``code``
note; ``-`` where the row records none) and the device (the GPU the row names, else the chip in its file name).

Throughput rows (benchmarks/throughput.py's JSON lines): the latest row of each configuration and chip (variant, shape,
layout, sequence length, micro-batches and the options that change the step: fp8, CUDA graphs, LoRA, recompute,
kernels); "latest" by the date in the file name, then file name, then line. A file may name the UTC time its run
ended after the date (``2026-12-07T1507-h100-headline.jsonl``): it then sorts after that date's files without a time,
and in time order among those with one. MFU is the standard count
(lightning_megatron/parallel/counts.py:model_flops_per_token) recomputed from the row's own fields: N from
``flops_params``/``flops_frozen_params`` where the row records them, else ``params`` less the input embedding
table (V x H; every shape of throughput.py has untied embeddings), else from the shape's dimensions
(:func:`llama_parameters`). Rows timed under a profiler, beside other jobs on the same GPU, with
``--sync-debug``, or marked discarded are left out, and so are rows without the fields the count needs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
START, END = "<!-- tables:start -->", "<!-- tables:end -->"
ROOT_README = HERE.parent / "README.md"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
SAVES_START, SAVES_END = "<!-- checkpoints:start -->", "<!-- checkpoints:end -->"

# The shapes of benchmarks/throughput.py (SHAPES, VOCAB), repeated so that this script imports neither torch nor
# the package (it runs in CI in milliseconds).
SHAPES = {
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=2048),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
    "3b": dict(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192),
    # MoE shapes: their rows always record N (flops_params), so only the sizes the count reads are repeated here.
    "moe1b": dict(num_layers=16, hidden_size=2048),
    "mla_moe1b": dict(num_layers=16, hidden_size=2048),
    "qwen3moe": dict(num_layers=8, hidden_size=2048),
}
VOCAB = 32000
PEAK_FLOPS = 989e12  # dense bf16 of one H100/H200, as throughput.py
VARIANTS = {
    "lightning_megatron": "(a) Trainer + MegatronStrategy",
    "raw_megatron_core": "(b) raw Megatron-Core, the project's kernels",
    "raw_megatron_core_stock": "(b0) raw Megatron-Core, stock local spec",
    "lightning_hf_llama": "(c) Trainer + HF Llama",
    "hf_llama_fsdp2_compile": "(d) HF Llama + FSDP2 + compile",
}
# Words in a row's "code" note that say its timing is not the configuration's: left out.
NOT_COMPARABLE = ("discarded", "not kept", "profiler", "at once", "experimental")


def llama_parameters(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int,
    vocab_size: int = VOCAB,
    num_query_groups: int | None = None,
    tied: bool = False,
) -> tuple[int, int]:
    """(all parameters, N of the MFU count) of a Llama-shaped model: RMSNorm, SwiGLU, no biases, RoPE.

    Per layer: Q and output projections ``2 H^2``, K and V ``2 H kv`` (``kv = H groups / heads``: GQA), the MLP's
    gate, up and down projections ``3 H F``, two norms ``2 H``; a final norm ``H``; the embedding table and the
    output head ``V H`` each, one matrix when tied. N leaves the input table out (a tied one counts once, as the
    head)."""
    groups = num_query_groups or num_attention_heads
    kv = hidden_size * groups // num_attention_heads
    layer = 2 * hidden_size * hidden_size + 2 * hidden_size * kv + 3 * hidden_size * ffn_hidden_size + 2 * hidden_size
    body = num_layers * layer + hidden_size + vocab_size * hidden_size  # the layers, the final norm, the head
    return (body if tied else body + vocab_size * hidden_size), body


def flops_per_token(trainable: int, frozen: int, num_layers: int, hidden_size: int, seq_length: int) -> int:
    """lightning_megatron.parallel.counts.model_flops_per_token (checked equal by tests/test_benchmark_helpers.py)."""
    return 6 * trainable + 4 * frozen + 6 * num_layers * hidden_size * seq_length


@dataclass
class Row:
    data: dict[str, Any]
    file: str
    line: int

    @property
    def date(self) -> str:
        return self.file[:10]

    @property
    def device(self) -> str:
        """The GPU of the row (``H100``, ``H200``) or ``CPU``: from its ``gpu``/``device``/``machine`` field, else
        from its file name (``...-h100-...``, ``...-h200x2-...``, ``...-cpu-...``)."""
        for key in ("gpu", "device", "machine"):
            value = str(self.data.get(key) or "")
            chip = re.search(r"H[12]00", value.upper())
            if chip:
                return chip.group(0)
            if value.lower() == "cpu":
                return "CPU"
        match = re.match(r"\d{4}-\d{2}-\d{2}(?:T\d{4})?-(h[12]00|cpu)", self.file)
        return match.group(1).upper() if match else "?"

    @property
    def commit(self) -> str:
        if self.data.get("commit"):
            return str(self.data["commit"])
        match = re.search(r"\b([0-9a-f]{7,40})\b", str(self.data.get("code", "")))
        return match.group(1) if match else ""


def rows(results: Path = RESULTS) -> Iterator[Row]:
    """Every line of the result files, in date, file-name and line order; each must be one JSON object."""
    for path in sorted(results.glob("*.jsonl")):
        for number, text in enumerate(path.read_text().splitlines(), 1):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path.name}:{number}: not a JSON line ({error})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path.name}:{number}: a JSON {type(data).__name__}, not an object")
            yield Row(data, path.name, number)


def cell(row: Row) -> str:
    """The date, commit and device cells that end a table row."""
    return f"{row.date} | {row.commit or '-'} | {row.device} |"


@dataclass
class Throughput:
    """The throughput table's rows and the notes on what was left out or derived."""

    latest: dict[tuple, Row] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)
    from_params: int = 0
    from_shape: int = 0

    def skip(self, why: str) -> None:
        self.left_out[why] = self.left_out.get(why, 0) + 1


def configuration(data: dict[str, Any]) -> tuple:
    fp8 = data.get("fp8_format") or ("hybrid" if data.get("fp8") else None)
    return (
        data["variant"], data["shape"], data.get("devices", 1), data.get("tp", 1), data.get("pp", 1),
        data.get("vpp"), data.get("cp") or 1, bool(data.get("sp")), data["seq"], data["micro_batch"],
        data.get("recompute"), fp8, bool(data.get("cuda_graphs")), data.get("lora_rank") or 0,
        data.get("weight_cast_reuse", True), kernels(data), data.get("check_batches") is not False,
        num_layers(data), data.get("ep") or 1, data.get("moe_grouped_gemm"), data.get("ema"),
    )  # fmt: skip


def num_layers(data: dict[str, Any]) -> int:
    """The row's layers: its own field (``--num-layers``) or its shape's."""
    return data.get("num_layers") or SHAPES[data["shape"]]["num_layers"]


def kernels(data: dict[str, Any]) -> str:
    value = data.get("kernels") or "auto"
    return "hf_sdpa" if value == "sdpa" else value  # the HF variants' early rows wrote "sdpa"


def left_out(data: dict[str, Any]) -> str | None:
    """Why a throughput row is left out of the tables, or ``None`` where it is shown."""
    if "timing" in data:
        return "timed with --sync-debug"
    if any(word in str(data.get("code", "")) for word in NOT_COMPARABLE):
        return "timed under a profiler, beside other jobs, or discarded (their `code` note)"
    if not all(key in data for key in ("seq", "micro_batch")) or data.get("shape") not in SHAPES:
        return "without the sequence length, micro-batches or a known shape (the MFU cannot be recomputed)"
    return None


def is_throughput(row: Row) -> bool:
    return "tokens_per_s" in row.data and "variant" in row.data


def throughput(all_rows: list[Row]) -> Throughput:
    table = Throughput()
    for row in filter(is_throughput, all_rows):
        why = left_out(row.data)
        if why:
            table.skip(why)
            continue
        table.latest[(*configuration(row.data), row.device)] = row  # each chip's latest, H100 and H200 side by side
    return table


def standard_mfu(data: dict[str, Any], table: Throughput | None = None) -> float:
    """The standard-count MFU of a throughput row, from its own fields (see the module docstring)."""
    shape = SHAPES[data["shape"]]
    if "flops_params" in data:
        trainable, frozen = data["flops_params"], data.get("flops_frozen_params", 0)
    elif "params" in data:
        table_size = VOCAB * shape["hidden_size"]
        frozen_all = data.get("frozen_params") or 0  # LoRA freezes the whole base, the embedding table included
        trainable = data["params"] - frozen_all - (0 if frozen_all else table_size)
        frozen = frozen_all - table_size if frozen_all else 0
        if table is not None:
            table.from_params += 1
    else:
        trainable, frozen = llama_parameters(**shape)[1], 0
        if table is not None:
            table.from_shape += 1
    flops = flops_per_token(trainable, frozen, num_layers(data), shape["hidden_size"], data["seq"])
    return data["tokens_per_s"] * flops / (PEAK_FLOPS * data.get("devices", 1))


def variant_label(data: dict[str, Any]) -> str:
    label = VARIANTS.get(data["variant"], data["variant"])
    fp8 = data.get("fp8_format") or ("hybrid" if data.get("fp8") else None)
    extras = [f"fp8 {fp8}"] if fp8 else []
    extras += ["CUDA graphs"] if data.get("cuda_graphs") else []
    extras += [f"LoRA r{data['lora_rank']}"] if data.get("lora_rank") else []
    extras += [f"EMA {data['ema']}"] if data.get("ema") else []
    extras += [f"recompute {data['recompute']}"] if data.get("recompute") else []
    extras += ["weights cast per micro-batch"] if data.get("weight_cast_reuse") is False else []
    extras += (
        [f"kernels={data['kernels']}"] if data.get("kernels") not in ("auto", "hf_sdpa", "megatron_local_spec") else []
    )
    extras += ["no batch check"] if data.get("check_batches") is False else []
    extras += ["experts looped"] if data.get("moe_grouped_gemm") is False else []
    return label + (" + " + ", ".join(extras) if extras else "")


def layout(data: dict[str, Any]) -> str:
    keys = (("tp", "TP"), ("pp", "PP"), ("vpp", "VPP"), ("cp", "CP"), ("ep", "EP"))
    parts = [f"{name}{data[key]}" for key, name in keys
             if (data.get(key) or 1) > 1]  # fmt: skip
    parts += ["SP"] if data.get("sp") else []
    devices = data.get("devices", 1)
    return f"{devices} GPU{'s' if devices > 1 else ''}" + (f" ({' x '.join(parts)})" if parts else "")


def shape_label(data: dict[str, Any]) -> str:
    shape = data["shape"]
    layers = f", {num_layers(data)} layers" if num_layers(data) != SHAPES[shape]["num_layers"] else ""
    experts = (
        f" ({data['num_moe_experts']} experts, top-{data['moe_router_topk']}{layers})"
        if data.get("num_moe_experts")
        else ""
    )
    return shape + (experts or (f" ({num_layers(data)} layers)" if layers else ""))


def _order(row: Row) -> tuple:
    data = row.data
    shapes = list(SHAPES)
    return (data.get("devices", 1), data["seq"], shapes.index(data["shape"]), list(VARIANTS).index(data["variant"])
            if data["variant"] in VARIANTS else 99, variant_label(data), data["micro_batch"])  # fmt: skip


def throughput_tables(table: Throughput) -> list[str]:
    head = [
        "| variant | shape | GPUs | seq | micro-batch | tokens/s | MFU | MFU as recorded | peak GiB | date | commit "
        "| device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[str, list[str]] = {
        "one GPU, 2,048 tokens per sequence": [],
        "longer sequences": [],
        "several GPUs": [],
        "mixture of experts (MFU on active parameters)": [],
    }
    for row in sorted(table.latest.values(), key=_order):
        data = row.data
        mfu = standard_mfu(data, table)
        line = (
            f"| {variant_label(data)} | {shape_label(data)} | {layout(data)} | {data['seq']:,} | "
            f"{data['micro_batch']} | "
            f"{data['tokens_per_s']:,} | {mfu:.1%} | {data['mfu']:.1%} | {number(data.get('peak_memory_gib'))} | "
            f"{cell(row)}"
        )
        group = "several GPUs" if data.get("devices", 1) > 1 else "one GPU, 2,048 tokens per sequence"
        if data.get("devices", 1) == 1 and data["seq"] != 2048:
            group = "longer sequences"
        if data.get("num_moe_experts"):
            group = "mixture of experts (MFU on active parameters)"
        groups[group].append(line)
    out = []
    for title, lines in groups.items():
        if lines:
            out += [f"#### Throughput: {title}", "", *head, *lines, ""]
    notes = [
        "MFU: the standard count, tokens/s x (6 N + 6 layers hidden seq) / (989 TFLOP/s x GPUs), N the parameters "
        "without the input embedding table (MoE: each routed expert's parameters times top-k / experts, the active "
        "parameters); recomputed from each row's fields. \"MFU as recorded\": the row's own `mfu` field (a row "
        "without `flops_params` counted 6 x all parameters, the input table included). `peak GiB`: the GPU memory "
        "the step allocated at its peak (`torch.cuda.max_memory_allocated`), of one GPU.",
    ]
    if table.from_params:
        notes.append(
            f"{table.from_params} rows record all parameters only (`params`): N = params - V x H (V = {VOCAB:,}; the "
            "benchmark shapes have untied embeddings; a LoRA run's frozen base includes the table)."
        )
    if table.from_shape:
        notes.append(f"{table.from_shape} rows record no parameter count: N from the shape (Llama, untied).")
    notes += [f"Left out: {count} rows {why}." for why, count in table.left_out.items()]
    return out + [f"- {note}" for note in notes] + [""]


def checkpoint_rows(all_rows: list[Row], lean: bool) -> tuple[list[Row], dict[str, list[dict[str, Any]]]]:
    """The rows of full checkpoints (or, ``lean``, of checkpoints without the model weights: ``model_weights:
    false``) shown for sync saves, async saves and resumes: each mode's rows of the newest day that measured it (each
    of that day's files: they may be different machines), and every such file's disk probes. Rows discarded by their
    ``code`` note are left out."""
    found = [r for r in all_rows if "-checkpoint-" in r.file]
    found = [r for r in found if not any(word in str(r.data.get("code", "")) for word in NOT_COMPARABLE)]
    mine = [r for r in found if (r.data.get("model_weights") is False) == lean]
    chosen: list[Row] = []
    for mode in ("sync", "async", "resume"):
        rows_of_mode = sorted((r for r in mine if r.data.get("mode") == mode), key=lambda r: (r.file, r.line))
        if rows_of_mode:
            newest = max(r.date for r in rows_of_mode)
            chosen += [r for r in rows_of_mode if r.date == newest]
    disks: dict[str, list[dict[str, Any]]] = {}
    for r in mine:
        if r.data.get("mode") == "disk":
            disks.setdefault(r.file, []).append(r.data)
    return chosen, disks


def checkpoint_table(all_rows: list[Row]) -> list[str]:
    """Checkpoint benchmark tables, of full checkpoints and of checkpoints without the model weights: each save and
    resume of :func:`checkpoint_rows` against the disk speed measured in its own file (the mean of its probes:
    before and after the saves, where both ran), the disk probes, the loads' timelines and the checksums."""
    out: list[str] = []
    for lean in (False, True):
        chosen, disks = checkpoint_rows(all_rows, lean)
        if chosen:
            files = {r.file for r in chosen}
            checks = [r for r in all_rows if r.file in files and r.data.get("mode") == "checksums"]
            out += checkpoint_file(chosen, disks, lean, checks)
    return out


def checkpoint_file(
    chosen: list[Row], disks: dict[str, list[dict[str, Any]]], lean: bool, checks: list[Row] | None = None
) -> list[str]:
    size = next((r.data["checkpoint_bytes"] for r in chosen if "checkpoint_bytes" in r.data), 0)
    title = "without the model weights (`save_model_weights=False`)" if lean else "full"
    out = [
        f"#### Checkpoints, {title} (benchmarks/checkpoint.py)",
        "",
        f"Checkpoint {number(size / 1e9)} GB. Each save's step blocked for `blocked`, against `step`, a training step "
        "of the same run without a save; `stage` builds the state and copies it to host buffers, `plan` plans (and "
        "for async saves hands the shards to the writer), `write` writes, checksums and publishes (sync). `x disk`: "
        "the save until published (a load from the disk) against the checkpoint's bytes at that run's disk speed "
        "(the mean of its probes, where it measured the disk before and after the saves). Save 0 is the first save "
        "of a fit. Loads from the disk (cold) and the page cache (warm).",
        "",
        *disk_table(chosen, disks),
        *optimizer_build(chosen),
        "| shape | mode | save | blocked s | step s | stage s | plan s | write s | published after s | load s | x disk "
        "| date | run | commit | device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in chosen:
        data, timeline = row.data, row.data.get("timeline", {})
        which = data.get("save", data.get("cache", "-"))
        if data["mode"] == "resume" and "read_threads" in data:
            threads = data["read_threads"] or "default"
            which = f"{which}, {threads} thread{'s' if threads != 1 else ''}"
        out.append(
            f"| {data.get('shape')} | {data['mode']} | {which} | {number(data.get('save_blocked_s'))} | "
            f"{number(data.get('normal_step_s'))} | {number(timeline.get('stage_s'))} | "
            f"{number(timeline.get('plan_s'))} | {number(timeline.get('write_s'))} "
            f"| {number(data.get('published_after_s'))} | {number(data.get('resume_load_s'))} | "
            f"{number(against_disk(data, disks.get(row.file, [])), 2)} | {row.date} | {run_label(row.file)} | "
            f"{row.commit or '-'} | {row.device} |"
        )
    out += ["", *load_timeline([r for r in chosen if r.data.get("mode") == "resume"])]
    return out + checksum_table(checks or [])


def disk_table(chosen: list[Row], disks: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The disk's speed (fsynced writes, then reads) in each run, each probe named where the run says when it ran."""
    files = sorted({r.file for r in chosen if r.file in disks})
    if not files:
        return []

    def probes(file: str, key: str) -> str:  # "1.75 (before), 1.61 (after)" where the probes say when they ran
        if not any(probe.get("probe") for probe in disks[file]):
            return ", ".join(number(probe.get(key), 2) for probe in disks[file])
        return ", ".join(f"{number(probe.get(key), 2)} ({probe.get('probe', '?')})" for probe in disks[file])

    first = {r.file: r for r in chosen}
    out = ["| run | disk write GB/s | disk read GB/s | date | commit | device |", "|---|---|---|---|---|---|"]
    for file in files:
        row = first[file]
        out.append(
            f"| {run_label(file)} | {probes(file, 'disk_write_gb_s')} | {probes(file, 'disk_read_gb_s')} | {cell(row)}"
        )
    return [*out, ""]


def checksum_table(checks: list[Row]) -> list[str]:
    """Checksumming the whole checkpoint (files in the page cache): recording, and verifying what a load reads."""
    if not checks:
        return []
    out = [
        "Checksums (`mode: checksums`): recording the CRC-32 of every 64 KiB block of the whole checkpoint and "
        "verifying them, on files in the page cache.",
        "",
        "| run | record s | verify s | record GB/s | verify GB/s | date | commit | device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in checks:
        data = row.data
        out.append(
            f"| {run_label(row.file)} | {number(data.get('checksum_record_s'))} | "
            f"{number(data.get('checksum_verify_s'))} | {number(data.get('checksum_record_gb_s'))} | "
            f"{number(data.get('checksum_verify_gb_s'))} | {cell(row)}"
        )
    return [*out, ""]


def run_label(file: str) -> str:
    """A checkpoint result file's run, as the end of its name says (``...-checkpoint-1b-c2.jsonl``: ``1b-c2``)."""
    return file.removesuffix(".jsonl").partition("-checkpoint-")[2] or file


def against_disk(data: dict[str, Any], probes: list[dict[str, Any]]) -> float | None:
    """A save until published, or a load, against the checkpoint's bytes at the disk's speed of the same run (the
    mean of its probes)."""
    if data.get("cache") == "warm":  # read from the page cache, not the disk
        return None
    seconds = data.get("resume_load_s") if data.get("mode") == "resume" else data.get("published_after_s")
    key = "disk_read_gb_s" if data.get("mode") == "resume" else "disk_write_gb_s"
    speeds = [probe[key] for probe in probes if probe.get(key)]
    speed = sum(speeds) / len(speeds) if speeds else None
    if not (isinstance(seconds, int | float) and speed and data.get("checkpoint_bytes")):
        return None
    return seconds / (data["checkpoint_bytes"] / 1e9 / speed)


def load_timeline(found: list[Row]) -> list[str]:
    """Where each load's time went (``CheckpointWriter.last_load``), for rows that recorded it."""
    loads = [r for r in found if r.data.get("timeline")]
    if not loads:
        return []
    parts = ("open_s", "state_s", "check_s", "verify_s", "read_s", "verify_after_read_s", "apply_s")
    out = [
        "Loads (`CheckpointWriter.last_load`, seconds): `state` builds the state to read into with its host buffers, "
        "`verify` checks what is read into the model, `read` is Megatron's load (the optimizer state's checksums "
        "verified meanwhile, where `verify after` is recorded), `apply` puts it into the model and optimizer.",
        "",
        "| cache | read threads | load | "
        + " | ".join(p.removesuffix("_s").replace("_", " ") for p in parts)
        + " | date | run | commit | device |",
        "|---|---|---|" + "---|" * len(parts) + "---|---|---|---|",
    ]
    for row in loads:
        data = row.data
        cells = [number(data["timeline"].get(p), 2) for p in parts]
        threads = data.get("read_threads", 1)  # rows without the field: Megatron's own reader
        if threads is None:  # the default: the read split into parts by the CPUs at hand
            threads = f"default ({data['timeline'].get('read_parts', '?')})"
        line = f"| {data.get('cache', '-')} | {threads} | {number(data.get('resume_load_s'))} | "
        end = f" | {row.date} | {run_label(row.file)} | {row.commit or '-'} | {row.device} |"
        out.append(line + " | ".join(cells) + end)
    return [*out, ""]


def optimizer_build(found: list[Row]) -> list[str]:
    """A sentence on building the distributed optimizer's state for a save: Megatron's own method against ours."""
    row = next((r for r in found if "megatron_optimizer_state_s" in r.data), None)
    if row is None:
        return []
    data = row.data
    return [
        f"Building the distributed optimizer's state for a save (run {run_label(row.file)}): Megatron's "
        f"`sharded_state_dict` (fully_reshardable) {number(data['megatron_optimizer_state_s'])} s, this package's "
        f"{number(data['optimizer_state_s'], 2)} s ({number(data['optimizer_state_first_s'])} s into new host "
        "buffers, which it allocates and pins).",
        "",
    ]


def newest(found: list[Row]) -> list[Row]:
    """The rows of the newest date among ``found``."""
    if not found:
        return []
    date = max(r.date for r in found)
    return [r for r in found if r.date == date]


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


def moe_against_dense_table(all_rows: list[Row]) -> list[str]:
    """Each MoE throughput row beside the dense 1B row of the same file (one call, one machine) with as many layers and
    the same variant, layout, sequence, micro-batches, fp8 and CUDA graphs: the ratio of their tokens/s, the newest
    pair of each MoE configuration."""
    shown = [r for r in all_rows if is_throughput(r) and left_out(r.data) is None]
    same = ("variant", "devices", "tp", "pp", "seq", "micro_batch", "fp8", "cuda_graphs")
    pairs: dict[tuple, tuple[Row, Row]] = {}
    for moe in (r for r in shown if r.data.get("num_moe_experts")):
        data = moe.data
        dense = [
            r for r in shown
            if r.file == moe.file and not r.data.get("num_moe_experts")
            and r.data["shape"] == "1b" and num_layers(r.data) == num_layers(data)
            and all(r.data.get(key) == data.get(key) for key in same)
        ]  # fmt: skip
        if dense:
            pairs[(*configuration(data), moe.device)] = (moe, dense[-1])
    if not pairs:
        return []
    out = [
        "#### Mixture of experts against the dense 1B in the same call",
        "",
        "| variant | MoE shape | MoE tokens/s | dense tokens/s | MoE / dense | date | commit | device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for moe, dense in pairs.values():
        ratio = moe.data["tokens_per_s"] / dense.data["tokens_per_s"]
        out.append(
            f"| {variant_label(moe.data)} | {shape_label(moe.data)} | {moe.data['tokens_per_s']:,} | "
            f"{dense.data['tokens_per_s']:,} | {ratio:.2f}x | {cell(moe)}"
        )
    return [*out, ""]


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


# The README's headline rows: (the variant's label in the throughput tables, shape, device), each the latest row of
# its configuration at one GPU, 2,048 tokens per sequence and micro-batches 4x2.
HEADLINE = (
    ("(a) Trainer + MegatronStrategy", "1b", "H100"),
    ("(b) raw Megatron-Core, the project's kernels", "1b", "H100"),
    ("(a) Trainer + MegatronStrategy + fp8 e4m3, CUDA graphs", "1b", "H100"),
    ("(a) Trainer + MegatronStrategy", "moe1b", "H100"),
    ("(a) Trainer + MegatronStrategy", "1b", "H200"),
    ("(b) raw Megatron-Core, the project's kernels", "1b", "H200"),
    ("(b0) raw Megatron-Core, stock local spec", "1b", "H200"),
    ("(d) HF Llama + FSDP2 + compile", "1b", "H200"),
    ("(a) Trainer + MegatronStrategy + fp8 e4m3, CUDA graphs", "1b", "H200"),
)


def headline_row(row: Row) -> tuple[str, str, str] | None:
    """A throughput row's (label, shape, device) where it is one GPU, 2,048 tokens per sequence, micro-batches 4x2."""
    data = row.data
    if data.get("devices", 1) != 1 or data["seq"] != 2048 or data["micro_batch"] != "4x2":
        return None
    return variant_label(data), data["shape"], row.device


def headline(all_rows: list[Row]) -> list[str]:
    """The README's throughput table: the :data:`HEADLINE` rows of the throughput tables."""
    table = throughput(all_rows)
    out = [
        "| run | model | tokens/s | MFU | date | commit | device |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, shape, device in HEADLINE:
        found = [row for row in table.latest.values() if headline_row(row) == (label, shape, device)]
        if len(found) != 1:
            raise ValueError(f"headline row {label!r} {shape} {device}: {len(found)} rows in the throughput tables")
        row = found[0]
        out.append(
            f"| {label} | {shape_label(row.data)} | {row.data['tokens_per_s']:,} | {standard_mfu(row.data):.1%} | "
            f"{cell(row)}"
        )
    return out


def span(values: list[float], digits: int) -> str:
    """``low-high`` of the values (one number when they agree at these digits), ``-`` for none."""
    if not values:
        return "-"
    low, high = number(min(values), digits), number(max(values), digits)
    return low if low == high else f"{low}-{high}"


def checkpoint_summary(all_rows: list[Row]) -> list[str]:
    """The README's checkpoint table: full checkpoints, the rows of :func:`checkpoint_rows` summed up per kind of
    save (first of a fit, later) and for resumes from the disk by 8 threads: how many, the ranges over them."""
    chosen, disks = checkpoint_rows(all_rows, lean=False)
    size = next((r.data["checkpoint_bytes"] for r in chosen if "checkpoint_bytes" in r.data), 0)
    kinds = {
        "sync save, first of a fit": ("sync", True),
        "sync save, later": ("sync", False),
        "async save, first of a fit": ("async", True),
        "async save, later": ("async", False),
        "resume from the disk, 8 threads": ("resume", None),
    }
    out = [
        f"| {number(size / 1e9)} GB checkpoint | saves | blocked s | step s | published after s | load s | x disk | "
        "date | commits | device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (mode, first) in kinds.items():
        found = [r for r in chosen if r.data["mode"] == mode]
        if first is None:  # resumes: read from the disk by 8 threads
            found = [r for r in found if r.data.get("cache") == "cold" and r.data.get("read_threads") == 8]
        else:
            found = [r for r in found if (r.data.get("save") == 0) == first]
        if not found:
            continue

        def values(key: str, found: list[Row] = found) -> list[float]:
            return [r.data[key] for r in found if isinstance(r.data.get(key), int | float)]

        ratios = [x for r in found if (x := against_disk(r.data, disks.get(r.file, []))) is not None]
        commits = ", ".join(dict.fromkeys(r.commit or "-" for r in found))
        dates = ", ".join(dict.fromkeys(r.date for r in found))
        devices = ", ".join(dict.fromkeys(r.device for r in found))
        out.append(
            f"| {name} | {len(found)} | {span(values('save_blocked_s'), 1)} | {span(values('normal_step_s'), 1)} | "
            f"{span(values('published_after_s'), 1)} | {span(values('resume_load_s'), 1)} | {span(ratios, 2)} | "
            f"{dates} | {commits} | {devices} |"
        )
    return out


def number(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def render(results: Path = RESULTS) -> str:
    """benchmarks/README.md's block: every table."""
    all_rows = list(rows(results))
    lines = [
        *throughput_tables(throughput(all_rows)),
        *fp8_loss_table(all_rows),
        *ema_tables(all_rows),
        *moe_against_dense_table(all_rows),
        *moe_fp8_table(all_rows),
        *packing_tables(all_rows),
        *checkpoint_table(all_rows),
        *writer_memory_table(all_rows),
        *batch_check_table(all_rows),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_headline(results: Path = RESULTS) -> str:
    """README.md's throughput block."""
    return "\n".join(headline(list(rows(results)))) + "\n"


def render_checkpoints(results: Path = RESULTS) -> str:
    """README.md's checkpoint block."""
    return "\n".join(checkpoint_summary(list(rows(results)))) + "\n"


def blocks(results: Path = RESULTS) -> list[tuple[Path, str, str, str]]:
    """(file, start marker, end marker, the block's text) of every generated block."""
    return [
        (README, START, END, render(results)),
        (ROOT_README, HEADLINE_START, HEADLINE_END, render_headline(results)),
        (ROOT_README, SAVES_START, SAVES_END, render_checkpoints(results)),
    ]


def block(text: str, start: str, end: str) -> str:
    """The text between a file's markers."""
    return text[text.index(start) + len(start) : text.index(end)]


def write(results: Path = RESULTS) -> list[Path]:
    """Rewrite every generated block; the files that changed."""
    changed = []
    for path, start, end, content in blocks(results):
        text = path.read_text()
        new = text[: text.index(start) + len(start)] + "\n" + content + text[text.index(end) :]
        if new != text:
            path.write_text(new)
            changed.append(path)
    return list(dict.fromkeys(changed))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--write", action="store_true", help="rewrite the generated blocks of benchmarks/README.md and README"
    )
    args = p.parse_args(argv)
    if args.write:
        changed = write()
        print("rewritten: " + (", ".join(str(path.relative_to(HERE.parent)) for path in changed) or "none"))
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
