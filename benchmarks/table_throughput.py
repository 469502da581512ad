"""The throughput tables of benchmarks/README.md, the MoE-against-dense table, and README.md's headline table.

Each from the latest throughput row of each configuration and chip (:func:`benchmarks.table_rows.throughput`).
"""

from __future__ import annotations

from benchmarks.table_rows import (
    SHAPES,
    VARIANTS,
    VOCAB,
    Row,
    Throughput,
    cell,
    configuration,
    is_throughput,
    layout,
    left_out,
    num_layers,
    number,
    shape_label,
    standard_mfu,
    throughput,
    variant_label,
)


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
        "Each row is the newest of its configuration, so rows of one table come from different calls and often "
        "different machines: the same MoE shape has run 1.6x apart on two H100s (1.2x in two calls on one), "
        "the dense shapes a few percent apart. Compare rows of one call (the same date and commit, "
        "or the MoE-against-dense table).",
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


def moe_against_dense_table(all_rows: list[Row]) -> list[str]:
    """Each MoE throughput row beside the dense 1B row of the same file (one call, one machine) with as many layers and
    the same variant, layout, sequence, micro-batches, fp8 and CUDA graphs: the ratio of their tokens/s, the newest
    pair of each MoE configuration."""
    pairs = moe_dense_pairs(all_rows)
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


def moe_dense_pairs(all_rows: list[Row]) -> dict[tuple, tuple[Row, Row]]:
    """The newest (MoE row, dense 1B row) pair of each MoE configuration and device, both rows from one file (one
    call, one machine; see :func:`moe_against_dense_table`)."""
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
    return pairs


# The README's headline rows: (the variant's label in the throughput tables, shape, device), each the latest row of
# its configuration at one GPU, 2,048 tokens per sequence and micro-batches 4x2 (an MoE shape's: the latest measured
# in one call with the dense 1B).
MOE_SHAPES = ("moe1b",)
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
    paired = [moe for moe, _ in moe_dense_pairs(all_rows).values()]
    for label, shape, device in HEADLINE:
        # An MoE row is the newest measured beside the dense 1B in one call: the ratio quoted with it is that call's.
        candidates = paired if shape in MOE_SHAPES else table.latest.values()
        found = [row for row in candidates if headline_row(row) == (label, shape, device)]
        if len(found) != 1:
            raise ValueError(f"headline row {label!r} {shape} {device}: {len(found)} rows in the throughput tables")
        row = found[0]
        out.append(
            f"| {label} | {shape_label(row.data)} | {row.data['tokens_per_s']:,} | {standard_mfu(row.data):.1%} | "
            f"{cell(row)}"
        )
    return out
