"""Packed vs padded SFT-like batches, and the attention kernels behind packing (one GPU).

    python benchmarks/packing.py --mode attention            # kernels only: SDPA, FlexAttention, varlen, mask
    python benchmarks/packing.py --mode padded,budget,packed  # Trainer + MegatronStrategy, 1.0B Llama shape
    python benchmarks/packing.py --mode packed --cp 2 --row-length 32768 --docs-per-step 16  # packed rows, 2 GPUs

Training modes, each in its own process, on the same documents (random lengths 64-4,096 tokens, synthetic ids),
``--docs-per-step`` documents per optimizer step:
``padded``: one DataLoader batch per step, padded to its longest document (``attention_mask``), fixed micro-batches
of ``--docs-per-micro-batch``; ``budget``: the same batches with ``max_tokens_per_micro_batch=--budget`` (each
micro-batch cut to its own longest document, grouped by length); ``packed``: the documents packed first-fit into
rows of ``--row-length`` (``pack_sequences``), one row per micro-batch, as many rows per step as the step's
documents need (fixed per run: the rows are dealt to steps in order, ``--docs-per-step`` on average).
Useful tokens/s counts document tokens only (no padding). Prints one JSON line per mode. ``--cp N`` runs the packed
mode with context parallelism on N GPUs (each row split over them; peak memory is rank 0's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

SHAPE = dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632)
VOCAB = 32000


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="padded,budget,packed")
    p.add_argument("--row-length", type=int, default=8192)
    p.add_argument("--docs-per-step", type=int, default=32)
    p.add_argument("--docs-per-micro-batch", type=int, default=4)
    p.add_argument("--budget", type=int, default=16384, help="budget mode: max_tokens_per_micro_batch")
    p.add_argument("--min-length", type=int, default=64)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cp", type=int, default=1, help="packed mode only: context parallelism over this many GPUs")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cp > 1 and args.mode != "packed":
        p.error(f"--cp {args.cp} runs the packed mode only (--mode packed); got --mode {args.mode}")
    return args


def documents(args: argparse.Namespace) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    count = args.docs_per_step * (args.warmup + args.steps)
    lengths = torch.randint(args.min_length, args.max_length + 1, (count,), generator=generator)
    return [torch.randint(0, VOCAB, (int(n),), generator=generator) for n in lengths]


def padded_steps(docs: list[torch.Tensor], per_step: int) -> list[dict[str, torch.Tensor]]:
    """One batch per step: the step's documents right-padded to the longest of them."""
    steps = []
    for start in range(0, len(docs), per_step):
        chunk = docs[start : start + per_step]
        longest = max(len(d) for d in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for i, d in enumerate(chunk):
            ids[i, : len(d)], mask[i, : len(d)] = d, 1
        steps.append({"input_ids": ids, "attention_mask": mask})
    return steps


def packed_steps(args: argparse.Namespace, docs: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    from lightning_megatron import pack_sequences

    rows = pack_sequences(docs, args.row_length)
    per_step = len(rows) // (args.warmup + args.steps)
    return [
        {k: torch.stack([r[k] for r in rows[i : i + per_step]]) for k in rows[0]}
        for i in range(0, per_step * (args.warmup + args.steps), per_step)
    ]


def train(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L

    from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig

    docs = documents(args)
    mode = args.child
    steps = packed_steps(args, docs) if mode == "packed" else padded_steps(docs, args.docs_per_step)
    seq = args.row_length if mode == "packed" else max(s["input_ids"].shape[1] for s in steps)
    config = ModelConfig(**SHAPE, vocab_size=VOCAB, seq_length=max(seq, args.row_length), kernels="torch")
    module = MegatronLMModule(config, lr=1e-4, decay_steps=1000)
    if mode == "padded":
        strategy = MegatronStrategy(micro_batch_size=args.docs_per_micro_batch)
    elif mode == "budget":
        strategy = MegatronStrategy(max_tokens_per_micro_batch=args.budget)
    else:
        strategy = MegatronStrategy(micro_batch_size=1, cp=args.cp)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step in (args.warmup, args.warmup + args.steps):
                torch.cuda.synchronize()
                self.stamps.append(time.perf_counter())
            if trainer.global_step == args.warmup:  # the peak of the timed steps (not reset after the last one)
                torch.cuda.reset_peak_memory_stats()

    clock = Clock()
    trainer = L.Trainer(
        accelerator="gpu", devices=args.cp, precision="bf16-mixed", strategy=strategy, logger=False,
        max_steps=args.warmup + args.steps, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[clock], use_distributed_sampler=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(steps, batch_size=None, pin_memory=True)  # one prepared batch per step
    trainer.fit(module, loader)
    timed = steps[args.warmup : args.warmup + args.steps]
    useful = sum(int(_real_tokens(s)) for s in timed)
    total = sum(s["input_ids"].numel() for s in timed)
    if mode == "budget":  # what the micro-batches hold after grouping and cutting (as on the GPU)
        from lightning_megatron.micro_batches import GPU_LENGTH_MULTIPLE, MicroBatching

        rule = MicroBatching(max_tokens=args.budget, length_multiple=GPU_LENGTH_MULTIPLE)
        total = sum(m["input_ids"].numel() for s in timed for m in rule.split(s))
    elapsed = clock.stamps[1] - clock.stamps[0]
    return {
        "mode": mode, "useful_tokens_per_s": round(useful / elapsed), "computed_tokens_per_s": round(total / elapsed),
        "padding_fraction": round(1 - useful / total, 4), "step_time_s": round(elapsed / args.steps, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "docs_per_step": args.docs_per_step, "row_length": args.row_length, "cp": args.cp,
        "gpu": torch.cuda.get_device_name(),
    }  # fmt: skip


def _real_tokens(step: dict[str, torch.Tensor]) -> torch.Tensor:
    if "attention_mask" in step:
        return step["attention_mask"].sum()
    # Packed: tokens of documents with a label (the padding document at a row's end has none; documents >= 64).
    document = (step["position_ids"] == 0).cumsum(1)  # [R, L]
    labelled = torch.zeros(document.shape[0], int(document.max()) + 1, dtype=torch.bool)
    labelled.scatter_reduce_(1, document, step["labels"] != -100, "amax")
    return labelled.gather(1, document).sum()


def attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    """fwd+bwd of 8 documents x 2048 tokens, 16 heads, d=128, bf16: unpacked SDPA vs the packed kernels."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    docs, length, heads, dim = 8, 2048, 16, 128
    q, k, v = (torch.randn(docs, heads, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    packed = [t.transpose(0, 1).reshape(1, heads, docs * length, dim) for t in (q, k, v)]  # one row
    doc_ids = torch.arange(docs * length, device="cuda") // length
    flex = torch.compile(flex_attention, dynamic=False)

    def same_doc(b, h, qi, ki):  # noqa: ANN001, ANN202
        return (ki <= qi) & (doc_ids[qi] == doc_ids[ki])

    block = create_block_mask(same_doc, 1, None, docs * length, docs * length, device="cuda")
    mask = (doc_ids[:, None] == doc_ids[None, :]) & torch.ones(
        docs * length, docs * length, device="cuda"
    ).tril().bool()
    kernels = {
        "sdpa_unpacked": lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
        "flex_packed": lambda a, b, c: flex(a, b, c, block_mask=block),
        "sdpa_mask_packed": lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask[None, None]),
    }
    out = []
    for name, fn in kernels.items():
        inputs = [t.detach().requires_grad_() for t in (q, k, v) if name == "sdpa_unpacked"] or [
            t.detach().requires_grad_() for t in packed
        ]
        out.append({"kernel": name, "fwd_bwd_ms": round(_time(lambda: fn(*inputs).sum().backward()), 3)})
    try:
        from torch.nn.attention.varlen import varlen_attn

        flat = [t.detach().squeeze(0).transpose(0, 1).contiguous().requires_grad_() for t in packed]  # [T, h, d]
        cu = torch.arange(0, docs * length + 1, length, device="cuda", dtype=torch.int32)
        call = lambda: varlen_attn(*flat, cu, cu, length, length, window_size=(-1, 0)).sum().backward()  # noqa: E731
        out.append({"kernel": "varlen_packed", "fwd_bwd_ms": round(_time(call), 3)})
    except Exception as error:  # noqa: BLE001
        out.append({"kernel": "varlen_packed", "error": repr(error)[:300]})
    return out


def _time(fn: Any, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    args = parse()
    if args.child:
        result = train(args)
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # under --cp, Lightning's launcher started the other ranks
            print("RESULT " + json.dumps(result), flush=True)
        return
    for mode in args.mode.split(","):
        if mode == "attention":
            for line in attention(args):
                print(json.dumps({"benchmark": "packed_attention", **line, "gpu": torch.cuda.get_device_name()}))
            continue
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", mode], env=env, capture_output=True,
                              text=True)  # fmt: skip
        lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        print(lines[-1] if lines else json.dumps({"mode": mode, "error": (proc.stdout + proc.stderr)[-3000:]}))


if __name__ == "__main__":
    main()
