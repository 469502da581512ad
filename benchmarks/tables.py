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

This file is the entry point: it assembles the blocks and rewrites them. The tables are in four files, the last three
importing only the first: benchmarks/table_rows.py (the rows, their cells, labels and the MFU count),
benchmarks/table_throughput.py (the throughput tables, MoE against dense, the README's headline),
benchmarks/table_checkpoints.py (the checkpoint tables and the README's summary of them) and
benchmarks/table_sections.py (fp8 loss, EMA, MoE fp8, packing, the writer's memory, the batch check).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: benchmarks.*
from benchmarks.table_checkpoints import checkpoint_summary, checkpoint_table  # noqa: E402
from benchmarks.table_rows import HERE, RESULTS, rows, throughput  # noqa: E402
from benchmarks.table_sections import (  # noqa: E402
    attention_kernel_table,
    batch_check_table,
    ema_tables,
    fp8_loss_table,
    moe_fp8_table,
    packing_tables,
    writer_memory_table,
)
from benchmarks.table_throughput import headline, moe_against_dense_table, throughput_tables  # noqa: E402

README = HERE / "README.md"
START, END = "<!-- tables:start -->", "<!-- tables:end -->"
ROOT_README = HERE.parent / "README.md"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
SAVES_START, SAVES_END = "<!-- checkpoints:start -->", "<!-- checkpoints:end -->"


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
        *attention_kernel_table(all_rows),
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
