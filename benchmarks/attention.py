"""Attention kernels alone (one GPU): forward + backward of the core attention the model builds, bf16.

    PYTHONPATH=. python benchmarks/attention.py                       # parts a, b, c
    PYTHONPATH=. python benchmarks/attention.py --parts c --iters 50
    PYTHONPATH=. python benchmarks/attention.py --device cpu --tiny    # tiny sizes in seconds: a smoke test

Parts (one JSON line per case and sequence length, then one ``summary`` line per part and length):

* a: the 1B shape's core attention (``sdpa``: 16 heads of 128, ``--query-groups`` key/value heads, SDPA's kernels)
  against Multi-Latent Attention's as the model runs it (``mla_sdpa``: 16 heads, query/key 128 + 64, value 128, SDPA
  choosing its kernel) at 2,048 and 8,192 tokens, and the ways MLA could run instead: ``mla_padded`` (values
  zero-padded to 192, one head size for SDPA's flash kernels), ``mla_cudnn`` (SDPA held to cuDNN's kernel) and
  ``mla_flex`` (FlexAttention); issue 58's target: MLA's attention costs no more per FLOP than GQA's (the FLOPs
  count the value's 128 columns, not the padding);
* b: a sliding window of ``--window`` tokens (``flex_window``: FlexAttention with a block mask that skips the blocks
  outside it) against full causal attention on the same FlexAttention path (``flex_causal``) and against ``sdpa``,
  the 1B shape's default, at 8,192 and 16,384 tokens;
* c: learnable attention sinks (``flex_sinks``: ``softmax_type='learnable'``, FlexAttention and its log-sum-exp,
  the output rescaled by eager kernels) against ``flex_causal`` (the same kernel without sinks) and ``sdpa`` at
  8,192 tokens, and two candidates, this file's own code (not the model's): ``flex_sinks_fused`` (the rescaling
  compiled into one function with the FlexAttention call, so Inductor can fuse it) and ``flex_sinks_column`` (the
  sink as one more key whose score is the head's sink logit, set by a ``score_mod``, and whose value is zeros: no
  log-sum-exp and no rescaling); issue 59's target: sinks cost <= 5% over plain attention.

Entry points: ``SDPAttention`` built from the layer spec as the model builds it (``specs.layer_spec``; MLA's with the
head sizes and scale ``MLASelfAttention`` passes), called on Megatron's [S, B, heads, d] layout; RoPE is left out
(MLA rotates outside its core attention: both time the attention alone). ``flex_causal`` calls
``kernels.variants.attend_variant`` as ``SDPAttention`` does for its variants. Each length runs ``--tokens`` tokens
(batch = tokens / length). A window of N tokens is the query and the N - 1 before it (``window_size=(N - 1, 0)``).

FLOPs: matmul FLOPs over the attended (query, key) pairs P (causal: S (S + 1) / 2 per head and sequence; a window:
the pairs inside it): forward 2 P (d_qk + d_v), backward 2 P (3 d_qk + 2 d_v) (the scores recomputed, as the flash
kernels do: 2.5x the forward where d_qk = d_v). ``tflops`` counts those; a window's ``tflops_causal_equivalent``
counts the causal pairs instead (its speed as if it computed full attention); ``tflops_model_count`` counts 3x the
forward, as the MFU count's attention term does. Timing: CUDA events over ``--iters`` iterations after ``--warmup``,
gradients reset in each; dynamo's caches are reset before each case, so each compiles for its one shape as training
at one sequence length does. ``kernels``: the GPU kernels of one step by time (torch.profiler).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: benchmarks.*
from benchmarks.recorders import elapsed_ms  # noqa: E402
from benchmarks.shapes import attended_pairs  # noqa: E402

PARTS = {
    "a": ("sdpa", "mla_sdpa", "mla_padded", "mla_cudnn", "mla_flex"),
    "b": ("flex_window", "flex_causal", "sdpa"),
    "c": ("flex_sinks", "flex_sinks_fused", "flex_sinks_column", "flex_causal", "sdpa"),
}
TARGETS = {
    "a": "mla_cost_per_flop_over_sdpa <= 1 (issue 58)",
    "b": "a 5:1 windowed 1B model >= 1.4x tokens/s at 16K (issue 59; benchmarks/throughput.py --window)",
    "c": "sinks_over_flex_causal <= 1.05 (issue 59)",
}


@dataclass(frozen=True)
class Sizes:
    heads: int
    groups: int
    head_dim: int
    mla_rope_dim: int
    window: int
    seqs: dict[str, list[int]]
    tokens: int


def sizes(args: argparse.Namespace) -> Sizes:
    if args.tiny:  # a few milliseconds a case on CPU
        seqs = {"a": [32, 64], "b": [64, 128], "c": [64]}
        return Sizes(4, args.query_groups or 4, 16, 8, 16, seqs, 128)
    seqs = {part: [int(n) for n in getattr(args, f"seq_{part}").split(",")] for part in PARTS}
    return Sizes(16, args.query_groups or 16, 128, 64, args.window, seqs, args.tokens)


def model(s: Sizes, mla: bool = False, **variant: Any) -> Any:
    """A one-layer ModelConfig with the benchmark's heads (the 1B shape's at full size)."""
    from lightning_megatron import ModelConfig

    fields: dict[str, Any] = dict(
        num_layers=1, hidden_size=s.heads * s.head_dim, num_attention_heads=s.heads, ffn_hidden_size=4 * s.head_dim,
        vocab_size=128, seq_length=max(max(v) for v in s.seqs.values()), kernels="torch",
    )  # fmt: skip
    if mla:
        fields |= dict(multi_latent_attention=True, q_lora_rank=4 * s.head_dim, kv_lora_rank=4 * s.head_dim,
                       qk_head_dim=s.head_dim, qk_pos_emb_head_dim=s.mla_rope_dim, v_head_dim=s.head_dim)  # fmt: skip
    else:
        fields["num_query_groups"] = s.groups
    return ModelConfig(**fields, **variant)


def core_attention(config: Any, dtype: torch.dtype, **mla: Any) -> torch.nn.Module:
    """The layer spec's core attention of ``config``, built with the arguments its attention module passes."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from lightning_megatron.gpt import specs

    tc = config.to_transformer_config(kernels="torch", params_dtype=dtype, use_cpu_initialization=True)
    core = specs.layer_spec(config, "torch").submodules.self_attention.submodules.core_attention
    if isinstance(core, functools.partial):  # RoPE out: the attention alone (MLA rotates outside it anyway)
        kept = {name: value for name, value in core.keywords.items() if name not in ("rotary", "local_rotary")}
        core = functools.partial(core.func, **kept) if kept else core.func
    return build_module(
        core, config=tc, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        softmax_scale=mla.pop("softmax_scale", tc.softmax_scale), **mla,
    )  # fmt: skip


@dataclass
class Built:
    step: Callable[..., torch.Tensor]
    params: list[torch.Tensor]
    qk_dim: int
    v_dim: int
    groups: int
    window: int | None  # keys before the query (window_size[0]); None: causal over all
    kernel: str


def build(case: str, s: Sizes, device: torch.device, dtype: torch.dtype) -> Built:
    """The module (or call) of ``case`` on ``device``."""
    gpu = device.type == "cuda"
    flex = "flex" if gpu else "masked_reference"  # kernels.variants: FlexAttention on GPU, the reference elsewhere
    qk = s.head_dim + s.mla_rope_dim
    if case in ("mla_sdpa", "mla_padded", "mla_cudnn"):
        module = core_attention(
            model(s, mla=True), dtype, softmax_scale=qk**-0.5, k_channels=qk, v_channels=s.head_dim
        )  # fmt: skip
        step = as_step(module.to(device))
        if case == "mla_padded":
            step = values_padded(step, s.heads)
        elif case == "mla_cudnn":
            step = with_backend(step, "CUDNN_ATTENTION")
        return Built(step, [], qk, s.head_dim, s.heads, None, "sdpa_cudnn" if case == "mla_cudnn" else "sdpa")
    if case in ("flex_causal", "mla_flex"):
        from lightning_megatron.kernels.variants import Variant, attend_variant

        qk_dim, groups = (qk, s.heads) if case == "mla_flex" else (s.head_dim, s.groups)

        def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            seq, batch = q.shape[:2]  # as SDPAttention: [S, B, n, d] -> [B, n, S, d] views and back
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = attend_variant(q, k, v, None, Variant(), None, qk_dim**-0.5, 0.0, False)
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

        return Built(step, [], qk_dim, s.head_dim, groups, None, flex)
    if case in ("flex_sinks_fused", "flex_sinks_column"):
        return sinks_candidate(case, s, device, dtype)
    variant = {
        "sdpa": {},
        "flex_window": {"window_size": (s.window - 1, 0)},
        "flex_sinks": {"softmax_type": "learnable"},
    }[case]
    module = core_attention(model(s, **variant), dtype).to(device)
    window = s.window - 1 if case == "flex_window" else None
    kernel = flex if variant else "sdpa"
    return Built(as_step(module), list(module.parameters()), s.head_dim, s.head_dim, s.groups, window, kernel)


def sinks_candidate(case: str, s: Sizes, device: torch.device, dtype: torch.dtype) -> Built:
    """``flex_sinks_fused`` or ``flex_sinks_column`` (module docstring) with a sink logit per head, compiled on GPU.
    On CPU (no FlexAttention backward there) both run :func:`dense_sinks`, eager: their CPU rows time no candidate."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from lightning_megatron.kernels.variants import variant_block_mask

    sink = torch.nn.Parameter(torch.zeros(s.heads, device=device, dtype=dtype))
    scale, gpu = s.head_dim**-0.5, device.type == "cuda"

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        out, aux = flex_attention(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
        )  # fmt: skip
        return rescaled(out, aux.lse, sink)

    compiled = torch.compile(fused) if case == "flex_sinks_fused" else torch.compile(flex_attention)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq, batch = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if not gpu:
            out = dense_sinks(q, k, v, sink, scale)
        elif case == "flex_sinks_fused":  # the model's own causal block mask (cached per shape)
            out = compiled(q, k, v, variant_block_mask(None, None, 1, seq, seq, device))
        else:
            out = sink_column_attention(q, k, v, sink, scale, compiled, sink_column_mask(seq, device))
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    return Built(step, [sink], s.head_dim, s.head_dim, s.groups, None, "flex" if gpu else "dense_reference")


def rescaled(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention's output with a sink per head joined to its softmax: ``out * sigmoid(lse - sink)``."""
    factor = torch.sigmoid(lse - sink.float().view(1, -1, 1))
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


@functools.cache
def sink_column_mask(seq: int, device: torch.device) -> Any:
    """Causal over ``seq`` keys, and every query sees key ``seq`` (the sink's column)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, i, j: (j <= i) | (j == seq), None, None, seq, seq + 1, device=device)


def sink_column_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, scale: float, flex: Any, mask: Any
) -> torch.Tensor:
    """Sinks as one more key ([B, n, S, d] inputs): a zero key and value appended, the key's score replaced by the
    head's sink logit in a ``score_mod``; ``flex`` is FlexAttention (compiled or not), ``mask``
    :func:`sink_column_mask`'s."""
    seq = k.shape[2]
    k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (k, v))

    def sink_score(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return torch.where(kv_idx == seq, sink[h].to(score.dtype), score)

    return flex(q, k, v, score_mod=sink_score, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def dense_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Sink attention from the full score matrix (the CPU stand-in of both candidates)."""
    return rescaled(*dense_causal(q, k, v, scale), sink)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention's output and natural-log log-sum-exp ([B, n, S]) from the full score matrix, in
    float32 (keys/values repeated over grouped heads)."""
    repeat = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(repeat, dim=1).float() for t in (k, v))
    scores = q.float() @ k.transpose(-2, -1) * scale
    from lightning_megatron.kernels.variants import allowed_mask

    scores = scores.masked_fill(~allowed_mask(None, q.shape[2], k.shape[2], None, q.device), float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype), scores.logsumexp(-1)


def values_padded(step: Callable[..., torch.Tensor], heads: int) -> Callable[..., torch.Tensor]:
    """``step`` on values zero-padded to the query/key head size (one head size for SDPA's flash kernels, as
    Megatron pads MLA's values for Transformer Engine's packed path), its output cut back to the value size."""

    def padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = step(q, k, torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1])))
        return out.unflatten(-1, (heads, q.shape[-1]))[..., : v.shape[-1]].flatten(-2)

    return padded


def with_backend(step: Callable[..., torch.Tensor], backend: str) -> Callable[..., torch.Tensor]:
    """``step`` with SDPA held to one backend (``torch.nn.attention.SDPBackend``'s name); on CPU unchanged."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def held(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not q.is_cuda:
            return step(q, k, v)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return step(q, k, v)

    return held


def as_step(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``module`` called as ``SelfAttention`` calls its core attention: no mask tensor (causal by its mask type)."""
    return lambda q, k, v: module(q, k, v, None)


def flops(b: Built, batch: int, heads: int, seq: int, window: int | None) -> tuple[int, int]:
    """(forward + backward FLOPs, forward FLOPs) over the (query, key) pairs attended (module docstring)."""
    pairs = batch * heads * attended_pairs(seq, window)
    return 2 * pairs * (4 * b.qk_dim + 3 * b.v_dim), 2 * pairs * (b.qk_dim + b.v_dim)


def kernel_names(fn: Callable[[], Any], device: torch.device) -> list[str] | None:
    """The GPU kernels of one call of ``fn``, longest total time first (None on CPU; a note if profiling fails)."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        timed = []
        for event in prof.key_averages():
            us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
            if us > 0:
                timed.append((us, event.key[:90]))
        return [f"{name} ({us / 1e3:.2f} ms)" for us, name in sorted(timed, reverse=True)[:5]]
    except Exception as error:  # the timing stands without it
        return [f"profiler failed: {type(error).__name__}: {error}"[:200]]


def measure(case: str, seq: int, s: Sizes, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = torch.bfloat16
    if device.type == "cuda":
        torch._dynamo.reset()  # this case compiles for its own shape (see the module docstring)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    b = build(case, s, device, dtype)
    batch = max(1, s.tokens // seq)
    torch.manual_seed(0)
    q = torch.randn(seq, batch, s.heads, b.qk_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(seq, batch, b.groups, b.qk_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(seq, batch, b.groups, b.v_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(seq, batch, s.heads * b.v_dim, device=device, dtype=dtype)
    leaves = [q, k, v, *b.params]

    def once() -> None:
        for t in leaves:
            t.grad = None
        b.step(q, k, v).backward(grad)

    for _ in range(args.warmup):
        once()
    ms = elapsed_ms(once, args.iters, device)
    fwd_ms = elapsed_ms(lambda: b.step(q, k, v), args.iters, device)
    total, fwd = flops(b, batch, s.heads, seq, b.window)
    causal = flops(b, batch, s.heads, seq, None)[0]
    row = {
        "case": case, "kernel": b.kernel, "seq": seq, "batch": batch, "heads": s.heads, "query_groups": b.groups,
        "head_dim_qk": b.qk_dim, "head_dim_v": b.v_dim,
        "window_size": None if b.window is None else [b.window, 0],
        "softmax_type": "learnable" if case.startswith("flex_sinks") else "vanilla",
        "ms": round(ms, 4), "fwd_ms": round(fwd_ms, 4), "flops": total, "tflops": round(total / ms / 1e9, 2),
        "tflops_model_count": round(3 * fwd / ms / 1e9, 2),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.type == "cuda" else None,
        "kernels": kernel_names(once, device),
    }  # fmt: skip
    if b.window is not None:
        row["tflops_causal_equivalent"] = round(causal / ms / 1e9, 2)
    return row


def run_case(case: str, seq: int, s: Sizes, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """:func:`measure`, or the error's last lines (the other cases still run: one GPU call measures them all)."""
    try:
        return measure(case, seq, s, args, device)
    except Exception:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"case": case, "seq": seq, "error": traceback.format_exc()[-1500:]}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else round(numerator / denominator, 4)


def summary(part: str, seq: int, found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The part's comparison at one length: ratios of milliseconds (and of FLOPs) between its cases."""
    ms = {case: row.get("ms") for case, row in found.items()}
    row: dict[str, Any] = {"summary": part, "seq": seq, "target": TARGETS[part]}
    if part == "a":
        mla, sdpa = found["mla_sdpa"], found["sdpa"]
        per_flop = {case: None if "ms" not in r else r["ms"] / r["flops"] for case, r in found.items()}
        row |= {"mla_ms_over_sdpa": ratio(ms["mla_sdpa"], ms["sdpa"]),
                "mla_flops_over_sdpa": ratio(mla.get("flops"), sdpa.get("flops")),
                "mla_cost_per_flop_over_sdpa": ratio(per_flop["mla_sdpa"], per_flop["sdpa"])}  # fmt: skip
        for case in ("mla_padded", "mla_cudnn", "mla_flex"):  # the other kernels MLA could use
            row[f"{case}_ms_over_mla_sdpa"] = ratio(ms[case], ms["mla_sdpa"])
    elif part == "b":
        share = ratio(found["flex_window"].get("flops"), found["flex_causal"].get("flops"))
        row |= {"flex_causal_over_flex_window": ratio(ms["flex_causal"], ms["flex_window"]),
                "sdpa_over_flex_window": ratio(ms["sdpa"], ms["flex_window"]),
                "flex_causal_over_sdpa": ratio(ms["flex_causal"], ms["sdpa"]), "window_flops_share": share}  # fmt: skip
    else:
        row |= {"sinks_over_flex_causal": ratio(ms["flex_sinks"], ms["flex_causal"]),
                "sinks_over_sdpa": ratio(ms["flex_sinks"], ms["sdpa"]),
                "fused_sinks_over_flex_causal": ratio(ms["flex_sinks_fused"], ms["flex_causal"]),
                "column_sinks_over_flex_causal": ratio(ms["flex_sinks_column"], ms["flex_causal"])}  # fmt: skip
    return row


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b,c", help="comma-separated: a (MLA vs GQA), b (windows), c (sinks)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="4 heads of 16, 32 to 128 tokens (a CPU smoke test)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per call: batch = tokens / sequence length")
    p.add_argument("--query-groups", type=int, default=None, help="key/value heads of sdpa and flex_* (default: all)")
    p.add_argument("--window", type=int, default=1024, help="flex_window's window: the query and N - 1 before it")
    p.add_argument("--seq-a", default="2048,8192")
    p.add_argument("--seq-b", default="8192,16384")
    p.add_argument("--seq-c", default="8192")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20; --tiny: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5; --tiny: 1)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        p.error(f"--parts {args.parts}: unknown {unknown}; use a comma-separated subset of {','.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu (with --tiny)")
    if args.window < 1 or args.tokens < 1:
        p.error(f"--window {args.window} and --tokens {args.tokens} must be >= 1")
    args.iters = args.iters or (2 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print (and return) one JSON line per case and length, and one summary line per part and length."""
    from benchmarks.throughput import commit

    args = parse(argv)
    device, s = torch.device(args.device), sizes(args)
    common = {
        "benchmark": "attention", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "commit": commit(), "dtype": "bfloat16", "tokens": s.tokens,
        "iters": args.iters, "warmup": args.warmup,
    }  # fmt: skip
    measured: dict[tuple[str, int], dict[str, Any]] = {}
    lines: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        lines.append({**row, **common})
        print(json.dumps(lines[-1]), flush=True)

    from lightning_megatron.parallel.state import one_process

    with one_process(29675, cpu=device.type != "cuda"):
        for part in args.parts.split(","):
            for seq in s.seqs[part]:
                for case in PARTS[part]:
                    if (case, seq) not in measured:  # a case two parts share runs once, in the first
                        measured[case, seq] = run_case(case, seq, s, args, device)
                        emit({"part": part, **measured[case, seq]})
                emit(summary(part, seq, {case: measured[case, seq] for case in PARTS[part]}))
    return lines


if __name__ == "__main__":
    main()
