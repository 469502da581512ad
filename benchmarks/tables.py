"""Markdown tables of the current benchmark figures, from the committed rows in benchmarks/results/*.jsonl.

    python benchmarks/tables.py            # print the tables
    python benchmarks/tables.py --write    # rewrite the block between the markers in benchmarks/README.md

Throughput rows (benchmarks/throughput.py's JSON lines): the latest row of each configuration and chip (variant, shape,
layout, sequence length, micro-batches and the options that change the step: fp8, CUDA graphs, LoRA, recompute,
kernels); "latest" by the date in the file name, then file name, then line. MFU is the standard count
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

# The shapes of benchmarks/throughput.py (SHAPES, VOCAB), repeated so that this script imports neither torch nor
# the package (it runs in CI in milliseconds).
SHAPES = {
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=2048),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
    "3b": dict(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192),
    # MoE shapes: their rows always record N (flops_params), so only the sizes the count reads are repeated here.
    "moe1b": dict(num_layers=16, hidden_size=2048),
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
    header_code: str | None = None  # a "code at <commit>" in the file's comment lines before the row

    @property
    def date(self) -> str:
        return self.file[:10]

    @property
    def machine(self) -> str:
        if self.data.get("machine"):
            return self.data["machine"]
        match = re.match(r"\d{4}-\d{2}-\d{2}-(h[12]00(?:x\d+)?)-", self.file)
        if not match:
            return "?"
        chip, _, count = match.group(1).partition("x")
        if chip == "h100":  # the lent kinds' names: nvidia-h100-x1, nvidia-h100-x2, ...
            return f"nvidia-h100-x{count or 1}"
        return f"nvidia-{chip}" + (f"-x{count}" if count else "")

    @property
    def code(self) -> str:
        if self.data.get("commit"):
            return str(self.data["commit"])
        match = re.search(r"\b([0-9a-f]{7,40})\b", str(self.data.get("code", "")))
        return match.group(1) if match else (self.header_code or "")


def rows(results: Path = RESULTS) -> Iterator[Row]:
    """Every JSON object line of the result files, in date, file-name and line order (comments and other lines
    skipped)."""
    for path in sorted(results.glob("*.jsonl")):
        header_code = None
        for number, text in enumerate(path.read_text().splitlines(), 1):
            text = text.strip()
            if text.startswith("#"):
                match = re.search(r"code at ([0-9a-f]{7,40})", text)
                header_code = match.group(1) if match else header_code
                continue
            if not text.startswith("{"):
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict):
                yield Row(data, path.name, number, header_code)


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


def throughput(all_rows: list[Row]) -> Throughput:
    table = Throughput()
    for row in all_rows:
        data = row.data
        if "tokens_per_s" not in data or "variant" not in data:
            continue
        if "timing" in data:
            table.skip("timed with --sync-debug")
            continue
        if any(word in str(data.get("code", "")) for word in NOT_COMPARABLE):
            table.skip("timed under a profiler, beside other jobs, or discarded (their `code` note)")
            continue
        if not all(key in data for key in ("seq", "micro_batch")) or data.get("shape") not in SHAPES:
            table.skip("without the sequence length, micro-batches or a known shape (the MFU cannot be recomputed)")
            continue
        chip = "h100" if "h100" in row.machine else "h200"  # H100 and H200 rows side by side, each chip's latest
        table.latest[(*configuration(data), chip)] = row
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
        "| variant | shape | GPUs | seq | micro-batch | tokens/s | MFU | MFU as recorded | date | code | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"{data['tokens_per_s']:,} | {mfu:.1%} | {data['mfu']:.1%} | {row.date} | {row.code or '-'} | "
            f"{row.machine} |"
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
        "parameters); recomputed from each row's fields. \"MFU as recorded\": the row's own "
        "`mfu` field (before the standard count, rows counted 6 x all parameters, the input table included).",
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


def checkpoint_table(all_rows: list[Row]) -> list[str]:
    """Checkpoint benchmark rows, of full checkpoints and of checkpoints without the model weights (``model_weights:
    false``): for each of sync saves, async saves and resumes, the rows of the newest day that measured it (each of
    that day's files: they may be different machines), each against the disk speed measured in its own file (the
    mean of its probes: before and after the saves, where both ran). Rows discarded by their ``code`` note are left
    out."""
    found = [r for r in all_rows if "-checkpoint-" in r.file]
    found = [r for r in found if not any(word in str(r.data.get("code", "")) for word in NOT_COMPARABLE)]
    out: list[str] = []
    for lean in (False, True):
        mine = [r for r in found if (r.data.get("model_weights") is False) == lean]
        chosen: list[Row] = []
        for mode in ("sync", "async", "resume"):
            rows_of_mode = sorted((r for r in mine if r.data.get("mode") == mode), key=lambda r: (r.file, r.line))
            if rows_of_mode:
                newest = max(r.date for r in rows_of_mode)
                chosen += [r for r in rows_of_mode if r.date == newest]
        if chosen:
            disks: dict[str, list[dict[str, Any]]] = {}
            for r in mine:
                if r.data.get("mode") == "disk":
                    disks.setdefault(r.file, []).append(r.data)
            out += checkpoint_file(chosen, disks, lean)
    return out


def checkpoint_file(chosen: list[Row], disks: dict[str, list[dict[str, Any]]], lean: bool) -> list[str]:
    size = next((r.data["checkpoint_bytes"] for r in chosen if "checkpoint_bytes" in r.data), 0)
    title = "without the model weights (`save_model_weights=False`)" if lean else "full"

    def probes(file: str, key: str) -> str:  # "1.75 (before), 1.61 (after)" where the probes say when they ran
        if not any(probe.get("probe") for probe in disks[file]):
            return " then ".join(number(probe.get(key), 2) for probe in disks[file])
        return ", ".join(f"{number(probe.get(key), 2)} ({probe.get('probe', '?')})" for probe in disks[file])

    speeds = [
        f"{probes(file, 'disk_write_gb_s')} GB/s write and {probes(file, 'disk_read_gb_s')} GB/s read in run "
        f"{run_label(file)} of {file[:10]}"
        for file in sorted({r.file for r in chosen})
        if file in disks
    ]
    out = [
        f"#### Checkpoints, {title} (benchmarks/checkpoint.py)",
        "",
        f"Checkpoint {number(size / 1e9)} GB. The disk (fsynced writes), measured in each run: {'; '.join(speeds)}. "
        "Each save's step blocked for `blocked`; `stage` builds the state and copies it to host buffers, `plan` plans "
        "(and for async saves hands the shards to the writer), `write` writes, checksums and publishes (sync). "
        "`x disk`: the save until published (a load from the disk) against the checkpoint's bytes at that run's disk "
        "speed (the mean of its probes, where it measured the disk before and after the saves). Loads from the disk "
        "(cold) and the page cache (warm).",
        "",
        *optimizer_build(chosen),
        "| shape | mode | save | blocked s | stage s | plan s | write s | published after s | load s | x disk | date "
        "| run | code | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in chosen:
        data, timeline = row.data, row.data.get("timeline", {})
        which = data.get("save", data.get("cache", "-"))
        if data["mode"] == "resume" and "read_threads" in data:
            threads = data["read_threads"] or "default"
            which = f"{which}, {threads} thread{'s' if threads != 1 else ''}"
        out.append(
            f"| {data.get('shape')} | {data['mode']} | {which} | {number(data.get('save_blocked_s'))} | "
            f"{number(timeline.get('stage_s'))} | {number(timeline.get('plan_s'))} | {number(timeline.get('write_s'))} "
            f"| {number(data.get('published_after_s'))} | {number(data.get('resume_load_s'))} | "
            f"{number(against_disk(data, disks.get(row.file, [])), 2)} | {row.date} | {run_label(row.file)} | "
            f"{row.code or '-'} | "
            f"{row.machine} |"
        )
    return [*out, "", *load_timeline([r for r in chosen if r.data.get("mode") == "resume"])]


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
    loads = [r.data for r in found if r.data.get("timeline")]
    if not loads:
        return []
    parts = ("open_s", "state_s", "check_s", "verify_s", "read_s", "verify_after_read_s", "apply_s")
    out = [
        "Loads (`CheckpointWriter.last_load`, seconds): `state` builds the state to read into with its host buffers, "
        "`verify` checks what is read into the model, `read` is Megatron's load (the optimizer state's checksums "
        "verified meanwhile, where `verify after` is recorded), `apply` puts it into the model and optimizer.",
        "",
        "| cache | read threads | load | " + " | ".join(p.removesuffix("_s").replace("_", " ") for p in parts) + " |",
        "|---|---|---|" + "---|" * len(parts),
    ]
    for data in loads:
        cells = [number(data["timeline"].get(p), 2) for p in parts]
        threads = data.get("read_threads", 1)  # rows without the field: Megatron's own reader
        if threads is None:  # the default: the read split into parts by the CPUs at hand
            threads = f"default ({data['timeline'].get('read_parts', '?')})"
        row = f"| {data.get('cache', '-')} | {threads} | {number(data.get('resume_load_s'))} | "
        out.append(row + " | ".join(cells) + " |")
    return [*out, ""]


def optimizer_build(found: list[Row]) -> list[str]:
    """A sentence on building the distributed optimizer's state for a save: Megatron's own method against ours."""
    row = next((r.data for r in found if "megatron_optimizer_state_s" in r.data), None)
    if row is None:
        return []
    return [
        f"Building the distributed optimizer's state for a save: Megatron's `sharded_state_dict` (fully_reshardable) "
        f"{number(row['megatron_optimizer_state_s'])} s, this package's {number(row['optimizer_state_s'], 2)} s "
        f"({number(row['optimizer_state_first_s'])} s into new host buffers, which it allocates and pins).",
        "",
    ]


def number(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def render(results: Path = RESULTS) -> str:
    all_rows = list(rows(results))
    lines = [*throughput_tables(throughput(all_rows)), *checkpoint_table(all_rows)]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(readme: Path = README, results: Path = RESULTS) -> bool:
    """Rewrite the block between the markers of ``readme``; whether it changed."""
    text = readme.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    new = text[:start] + "\n" + render(results) + text[end:]
    readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help=f"rewrite the tables between {START} and {END} in README")
    args = p.parse_args(argv)
    if args.write:
        print(f"{README}: {'rewritten' if write() else 'unchanged'}")
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
