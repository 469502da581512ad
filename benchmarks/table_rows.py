"""The rows of benchmarks/results/*.jsonl and what every table reads of them (benchmarks/tables.py prints the tables).

:class:`Row` (one line of a result file, with its date, commit and device) and :func:`rows` (every line, in date,
file-name and line order); the cells and numbers every table prints (:func:`cell`, :func:`number`,
:func:`newest`); the throughput rows' configuration, what leaves one out, and their labels (variant, layout, shape);
:func:`throughput`, the latest row of each configuration and chip; and the standard MFU count
(:func:`llama_parameters`, :func:`flops_per_token`, :func:`standard_mfu`), as benchmarks/tables.py's docstring says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# The shapes of benchmarks/throughput.py (SHAPES, VOCAB), repeated so that the tables import neither torch nor
# the package (it runs in CI in milliseconds).
SHAPES = {
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=2048),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
    "3b": dict(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192),
    # MoE shapes: their rows always record N (flops_params), so only the sizes the count reads are repeated here.
    "moe1b": dict(num_layers=16, hidden_size=2048),
    "mla_moe1b": dict(num_layers=16, hidden_size=2048),
    "dsv3_1b": dict(num_layers=16, hidden_size=2048),
    "gptoss1b": dict(num_layers=16, hidden_size=2048),
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


def number(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def newest(found: list[Row]) -> list[Row]:
    """The rows of the newest date among ``found``."""
    if not found:
        return []
    date = max(r.date for r in found)
    return [r for r in found if r.date == date]


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
        str(data.get("window_size")), str(data.get("window_attn_skip_freq")),  # JSON lists: not hashable
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
    """The standard-count MFU of a throughput row, from its own fields (see benchmarks/tables.py's docstring)."""
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
    extras += [window_label(data)] if data.get("window_size") else []
    return label + (" + " + ", ".join(extras) if extras else "")


def window_label(data: dict[str, Any]) -> str:
    """Sliding windows of N tokens (``window_size`` (N - 1, 0)), one layer in K full (``window_attn_skip_freq``)."""
    every = data.get("window_attn_skip_freq")
    layers = ", every layer" if every is None else f", 1 layer in {every} full" if isinstance(every, int) else ""
    return f"window {data['window_size'][0] + 1}{layers}"


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
