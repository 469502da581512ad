"""Training throughput: Lightning + MegatronStrategy vs a raw Megatron-Core loop vs Lightning + HF Llama.

    python benchmarks/throughput.py                                   # 1 GPU, 1.0B Llama shape, variants a,b,c,d
    python benchmarks/throughput.py --variants a,b,b0                 # ... and stock Megatron-Core (b0)
    python benchmarks/throughput.py --devices 2 --tp 2 --sp --variants a,b
    python benchmarks/throughput.py --devices 2 --pp 2 --vpp 2 --micro-batch-size 2 --micro-batches 16
    python benchmarks/throughput.py --devices 2 --cp 2 --seq-length 32768 --micro-batch-size 1 --variants a
    python benchmarks/throughput.py --shape moe1b --variants a        # MoE: 32 experts of ffn 768, top-8
    python benchmarks/throughput.py --shape qwen3moe --num-layers 4 --variants a   # Qwen3-30B-A3B's layers, cut
    python benchmarks/throughput.py --variants a --seq-length 16384 --micro-batch-size 1 --window 1024 --window-every 6

Prints one JSON line per variant, each measured in its own torchrun job on the same GPUs:
(a) ``Trainer`` + ``MegatronStrategy`` + ``MegatronLMModule``; (b) a raw Megatron-Core loop with the same model,
optimizer, batch and loss (benchmarks/raw_megatron.py); (b0) "stock Megatron-Core": that loop with Megatron-Core's
own local layer spec (``get_gpt_layer_local_spec``, unfused ``DotProductAttention``), loss and optimizer, none of
the project's kernels (benchmarks/raw_megatron.py); (c) ``Trainer`` + ``transformers`` ``LlamaForCausalLM``
of the same shape (SDPA attention, ``precision="bf16-mixed"``, fused AdamW; 1 GPU or DDP only; it takes a step's
sequences as one batch, where a and b run ``--micro-batches`` micro-batches); (d) the recipe a strong user would
pick without us: ``transformers`` Llama with FSDP2 ``fully_shard`` per block (fp32 master weights, bf16 compute,
fp32 gradient reduction), ``torch.compile`` per block, fused AdamW, the same micro-batches (benchmarks/hf_fsdp2.py).
All use bf16 compute with fp32 master weights, Adam, grad clipping 1.0, the same synthetic tokens, pinned host
batches unless ``--no-pin-memory``. ``--sync-debug`` counts each variant's host-GPU synchronisations per step by
call site (``torch.cuda.set_sync_debug_mode``) instead of measuring speed. ``--host-timeline PREFIX`` profiles
``--timeline-steps`` more steps after the timed ones (benchmarks/host_timeline.py) and prints, per variant, the GPU's
idle time per step and what the host ran meanwhile (named ranges around Lightning's hooks, the adapter, Megatron's
schedule and optimizer), a short form of it last.
MFU = tokens/s x (6 N + 6 layers hidden seq) / (989e12 x GPUs), the standard count
(lightning_megatron/parallel/counts.py:model_flops_per_token): N the parameters without the input embedding table
(a tied embedding counted once, as the output head; a frozen one, LoRA's base, 4 FLOPs instead of 6), the attention
term for causal attention (torchtitan counts 12 layers hidden seq: the full matrix), 989 TFLOP/s the dense bf16
peak of an H100/H200. Each line records ``params`` (every parameter of the whole model, the model summary's count),
``flops_params`` and ``flops_frozen_params`` (N, trainable and frozen) and ``commit``. Timing: wall clock over
``--steps`` steps after ``--warmup`` steps, the GPU drained at both ends only.
MoE shapes (variant a only): ``moe1b`` has the 1B shape's attention with 32 experts of ffn 768, top-8 (about the
dense 1B's active parameters); ``qwen3moe`` the layers of Qwen3-30B-A3B (hidden 2048, 32 query heads of 128 over 4
key/value groups, q/k norms, 128 experts of ffn 768, top-8, vocabulary 151,936), 8 of its 48 layers unless
``--num-layers``. N counts each routed expert's parameters times top-k / experts (the active parameters), so MFU is
on active parameters; rows carry ``num_moe_experts``, ``moe_router_topk``, ``ep`` and ``moe_grouped_gemm``.
``gptoss1b``: a GPT-OSS-like MoE (benchmarks/shapes.py). Sliding windows: ``--window N --window-every K`` (every K-th
layer full; Gemma 3's 5:1 is ``--window 1024 --window-every 6``; variants a and b). ``mfu`` keeps the standard count
for windowed layers; rows with windows add ``flops_per_token_needed`` (the pairs inside each window).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: benchmarks.*
from benchmarks.recorders import hf_counts, megatron_counts, start_profiler, timeline_path, total_steps, write_profile  # noqa: E402
from benchmarks.shapes import SHAPES, VOCAB, add_window_arguments, attention_row, shape, window_fields, window_problem  # noqa: E402
from lightning_megatron.parallel.counts import model_flops_per_token

VARIANTS = {
    "a": "lightning_megatron",
    "b": "raw_megatron_core",
    "b0": "raw_megatron_core_stock",
    "c": "lightning_hf_llama",
    "d": "hf_llama_fsdp2_compile",
}
PEAK_FLOPS = 989e12


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants", default="a,b,c,d",
        help="comma-separated, in order, repeats allowed (a,b,a,b): a (Trainer + MegatronStrategy), b (raw "
        "Megatron-Core loop with the project's kernels), b0 (raw Megatron-Core, stock local spec, no project "
        "kernels), c (Trainer + HF Llama), d (HF Llama + FSDP2 + torch.compile)",
    )  # fmt: skip
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set for the per-variant child job
    add_layout_arguments(p)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="per optimizer step and data-parallel rank")
    p.add_argument("--no-fused-adam", dest="fused_adam", action="store_false", help="variant b: foreach AdamW")
    p.add_argument("--recompute", choices=["selective", "full"], default=None)
    p.add_argument(
        "--fp8", nargs="?", const="hybrid", default=None, choices=["hybrid", "e4m3"],
        help="variant a: ModelConfig(fp8=...), fp8 GEMMs without TE ('--fp8' alone: 'hybrid')",
    )  # fmt: skip
    p.add_argument(
        "--no-weight-cast-reuse", dest="weight_cast_reuse", action="store_false",
        help="variant a with --fp8: cast weights on every micro-batch (linear.quantize_weight -> fp8.quantize_pair)",
    )  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=0, help="variant a: LoRA of this rank on every linear, alpha 2r")
    p.add_argument("--ema", type=float, default=None, help="variant a: an EMA of the weights with this decay")
    p.add_argument(
        "--wgrad-fusion", choices=["auto", "on", "off"], default="auto",
        help="variant a: ModelConfig.gradient_accumulation_fusion (auto: on with the torch kernels on GPU); "
        "variant b stays Megatron's unfused path (no apex)",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graphs", action="store_true",
        help="variants a and b: ModelConfig(cuda_graphs=True), Megatron's per-layer CUDA graphs",
    )  # fmt: skip
    add_measurement_arguments(p)
    args = p.parse_args(argv)
    if args.devices % (args.tp * args.pp * args.cp):
        p.error(f"--devices {args.devices} is not a multiple of --tp x --pp x --cp = {args.tp * args.pp * args.cp}")
    problem = window_problem(args)
    if problem:
        p.error(problem)
    if args.variant is None:  # the launcher: a bad shape or option fails here, not in each GPU job
        try:
            model_config(args)
        except ValueError as error:
            p.error(f"--shape {args.shape} with these options: {error}")
    return args


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """The model shape and the parallel layout."""
    p.add_argument("--shape", default="1b", choices=list(SHAPES))
    p.add_argument("--num-layers", type=int, default=None, help="the shape's layers, cut or grown to this many")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE shapes, variant a)")
    p.add_argument(
        "--moe-gemm", choices=["auto", "loop"], default="auto",
        help="MoE experts: grouped GEMMs where the GPU has them (ModelConfig(moe_grouped_gemm=None)), or Megatron's "
        "loop over the experts on the same module (moe_grouped_gemm=False)",
    )  # fmt: skip
    add_window_arguments(p)
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "local"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument(
        "--cp", type=int, default=1,
        help="context parallelism, variant a only (raw Megatron-Core's needs Transformer Engine; c and d have none)",
    )  # fmt: skip


def add_measurement_arguments(p: argparse.ArgumentParser) -> None:
    """How many steps are timed, and what else is recorded about them."""
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", help="write each variant's torch.profiler kernel table to PROFILE.<variant>")
    p.add_argument(
        "--host-timeline", metavar="PREFIX",
        help="after the timed steps, profile --timeline-steps more with host ranges (benchmarks/host_timeline.py): "
        "print the GPU's idle time per step and what the host ran meanwhile; trace in PREFIX.<variant>.<run>.json.gz",
    )  # fmt: skip
    p.add_argument("--timeline-steps", type=int, default=3)
    p.add_argument("--run-index", type=int, default=0, help=argparse.SUPPRESS)  # set for the per-variant child job
    p.add_argument(
        "--no-pin-memory", dest="pin_memory", action="store_false",
        help="pageable batches (default: pinned, so that the host-to-device copy does not wait for the GPU)",
    )  # fmt: skip
    p.add_argument(
        "--no-check-batches", dest="check_batches", action="store_false",
        help="variant a: MegatronStrategy(check_batches=False) (no per-step batch fingerprint over each replica)",
    )  # fmt: skip
    p.add_argument(
        "--sync-debug", action="store_true",
        help="count the host-GPU synchronisations of the timed steps by call site (slows the run: no timing)",
    )  # fmt: skip


def model_config(args: argparse.Namespace) -> Any:
    from lightning_megatron import ModelConfig

    recompute = {"recompute_granularity": args.recompute}
    if args.recompute == "full":
        recompute |= {"recompute_method": "uniform", "recompute_num_layers": 1}
    fusion = {"auto": None, "on": True, "off": False}[args.wgrad_fusion]
    moe = {"moe_grouped_gemm": None if args.moe_gemm == "auto" else False} if is_moe(args) else {}
    return ModelConfig(
        **shape(args), seq_length=args.seq_length, kernels=args.kernels, **moe,
        gradient_accumulation_fusion=fusion, fp8=args.fp8 if args.variant == "a" else None,
        cuda_graphs=args.cuda_graphs and args.variant in ("a", "b"), **recompute,
    )  # fmt: skip


def is_moe(args: argparse.Namespace) -> bool:
    return "num_moe_experts" in SHAPES[args.shape]


def dataset(args: argparse.Namespace, dp: int) -> torch.Tensor:
    from lightning_megatron.data.corpus import synthetic_tokens

    batch = args.micro_batch_size * args.micro_batches
    return synthetic_tokens(batch * dp * total_steps(args), args.seq_length, shape(args)["vocab_size"])


def data_parallel(args: argparse.Namespace) -> int:
    """Data-parallel replicas of variants a and b: the GPUs over the model-parallel ones (TP x PP x CP)."""
    return args.devices // (args.tp * args.pp * args.cp)


def make_clock(args: argparse.Namespace) -> Any:
    """The callback that times the steps after the warm-up (and records the warm-up losses, counts syncs, profiles)."""
    import lightning as L

    from benchmarks.recorders import GcPauses, SyncCounter  # in the variants' processes (the launcher's path lacks it)

    class Clock(L.Callback):
        """Wall clock between the end of the warm-up and the end of the last step; the GPU is drained only there
        (a per-step sync would stall the next step's launch, which real training does not do)."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.profiler: Any = None
            self.syncs = SyncCounter(args.sync_debug)
            self.gc = GcPauses()
            self.timeline: Any = None
            self.timeline_summary: dict | None = None
            self.losses: list[float] = []
            self.counts: dict[str, int] = {}

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            if hasattr(pl_module, "chunks"):  # variant a: the whole model's counts (collective: every rank)
                self.counts = megatron_counts(list(pl_module.chunks))
            if args.host_timeline and hasattr(trainer.strategy, "megatron_optimizer"):
                from benchmarks import host_timeline

                strategy = trainer.strategy
                host_timeline.annotate_optimizer(strategy.megatron_optimizer, strategy._scheduler)
                host_timeline.annotate_chunks(strategy._run.ddp_chunks)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            loss = trainer.callback_metrics.get("train_loss")  # the strategy's: the same on every rank
            if loss is not None and trainer.global_step <= min(3, args.warmup):  # the warm-up's, off the clock
                self.losses.append(round(float(loss), 5))
            if args.host_timeline and trainer.global_step == args.warmup + args.steps + args.timeline_steps:
                from benchmarks import host_timeline

                self.timeline_summary = host_timeline.stop(self.timeline, timeline_path(args), args.timeline_steps)
            if trainer.global_step == args.warmup + args.steps:
                self.syncs.stop()
                self.gc.stop()
            if trainer.global_step in (args.warmup, args.warmup + args.steps):
                torch.cuda.synchronize()
                self.stamps.append(time.perf_counter())
            if trainer.global_step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
                if args.profile:
                    self.profiler = start_profiler()
                self.syncs.start()
                self.gc.start()
            if args.host_timeline and trainer.global_step == args.warmup + args.steps:
                from benchmarks import host_timeline

                self.timeline = host_timeline.start()

        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if self.profiler is not None:
                write_profile(self.profiler, f"{args.profile}.{args.variant}")

    return Clock()


def run_lightning(args: argparse.Namespace, module: Any, strategy: Any, data: torch.Tensor, dp: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    clock = make_clock(args)
    profiler = None
    if args.host_timeline:
        from benchmarks import host_timeline

        host_timeline.annotate_megatron()
        host_timeline.annotate_strategy()
        host_timeline.annotate_lightning_loop()
        profiler = host_timeline.lightning_profiler()
    trainer = L.Trainer(
        accelerator="gpu", devices=args.devices, precision="bf16-mixed", strategy=strategy, logger=False,
        max_steps=total_steps(args), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[clock, *ema_callbacks(args)], profiler=profiler,
    )  # fmt: skip
    batch = args.micro_batch_size * args.micro_batches
    trainer.fit(module, DataLoader(data, batch_size=batch, pin_memory=args.pin_memory))
    return {
        "elapsed": clock.stamps[1] - clock.stamps[0], "steps": args.steps, "syncs": clock.syncs.counts,
        "timeline": clock.timeline_summary, "first_losses": clock.losses, "gc": clock.gc.report(), **clock.counts,
    }  # fmt: skip


def ema_callbacks(args: argparse.Namespace) -> list[Any]:
    """``--ema DECAY`` (variant a): an EMA of the weights updated after every step (MegatronEMA)."""
    if not args.ema or args.variant != "a":
        return []
    from lightning_megatron import MegatronEMA

    return [MegatronEMA(decay=args.ema)]


def variant_a(args: argparse.Namespace) -> dict:
    from lightning_megatron import LoRAConfig, MegatronLMModule, MegatronStrategy

    config = model_config(args)
    dp = data_parallel(args)
    if not args.weight_cast_reuse:
        from lightning_megatron.kernels import fp8, linear

        linear.quantize_weight = lambda weight, dtype: fp8.quantize_pair(weight, dtype)  # every micro-batch casts
    lora = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
    module = MegatronLMModule(config, lr=1e-4, decay_steps=1000, lora=lora)
    strategy = MegatronStrategy(
        tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, sequence_parallel=args.sp,
        micro_batch_size=args.micro_batch_size, check_batches=args.check_batches,
    )  # fmt: skip
    result = run_lightning(args, module, strategy, dataset(args, dp), dp)
    return {**result, "fused_wgrad": module.fused_wgrad, "fp8": module.fp8, "moe_grouped_gemm": grouped_gemm(module)}


def grouped_gemm(module: Any) -> bool | None:
    """Whether the MoE experts ran grouped GEMMs (every expert linear's last choice), None for a dense model."""
    from lightning_megatron.kernels.experts import GroupedColumnLinear, GroupedRowLinear

    linears = [m for m in module.chunks.modules() if isinstance(m, GroupedColumnLinear | GroupedRowLinear)]
    return all(m.last_gemm == "grouped" for m in linears) if linears else None


def hf_llama_config(args: argparse.Namespace) -> Any:
    """The ``transformers`` Llama of the benchmark's shape (variants c and d)."""
    from transformers import LlamaConfig

    fields = shape(args)
    return LlamaConfig(
        hidden_size=fields["hidden_size"], intermediate_size=fields["ffn_hidden_size"],
        num_hidden_layers=fields["num_layers"], num_attention_heads=fields["num_attention_heads"],
        vocab_size=VOCAB, max_position_embeddings=args.seq_length, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip


def variant_c(args: argparse.Namespace) -> dict:
    import lightning as L
    from transformers import LlamaForCausalLM

    hf_config = hf_llama_config(args)

    class HFLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(hf_config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            # Clipped here: Lightning refuses gradient_clip_val with a fused optimizer under AMP.
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0, foreach=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)

    module = HFLlama()
    counts = hf_counts(module.model)
    return {**run_lightning(args, module, "auto", dataset(args, args.devices), args.devices), **counts}


def child(args: argparse.Namespace) -> None:
    if args.variant in ("b", "b0"):
        from benchmarks.raw_megatron import run

        result = run(args, model_config(args), dataset(args, data_parallel(args)), stock=args.variant == "b0")
    elif args.variant == "d":
        from benchmarks.hf_fsdp2 import run

        result = run(args, hf_llama_config(args), dataset(args, args.devices))
    else:
        result = {"a": variant_a, "c": variant_c}[args.variant](args)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    distributed = torch.distributed.is_initialized()  # not with Lightning's single-device strategy (c, 1 GPU)
    if distributed:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if distributed and torch.distributed.get_rank() != 0:
        return
    tokens = args.steps * args.micro_batch_size * args.micro_batches * args.seq_length
    tokens *= data_parallel(args)  # c and d run only where it is all the GPUs (main skips them under TP/PP/CP)
    tokens_per_s = tokens / result["elapsed"]
    fields = shape(args)
    flops_per_token = model_flops_per_token(
        result["flops_params"], result["flops_frozen"], fields["num_layers"], fields["hidden_size"], args.seq_length
    )
    kernels = {"a": args.kernels, "b": args.kernels, "b0": "megatron_local_spec"}.get(args.variant, "hf_sdpa")
    print(
        "RESULT " + json.dumps({
            "variant": VARIANTS[args.variant],
            "shape": args.shape, "num_layers": fields["num_layers"], "devices": args.devices, "tp": args.tp,
            "pp": args.pp, "vpp": args.vpp, "cp": args.cp, "ep": args.ep, "sp": args.sp, "kernels": kernels,
            "num_moe_experts": fields.get("num_moe_experts"), "moe_router_topk": fields.get("moe_router_topk"),
            "moe_grouped_gemm": result.get("moe_grouped_gemm"),
            "micro_batch": f"{args.micro_batch_size}x{args.micro_batches}", "seq": args.seq_length,
            "recompute": args.recompute, "params": result["params"], "frozen_params": result["frozen"],
            "flops_params": result["flops_params"], "flops_frozen_params": result["flops_frozen"],
            "lora_rank": args.lora_rank if args.variant == "a" else 0, "tokens_per_s": round(tokens_per_s),
            "ema": args.ema if args.variant == "a" else None,
            "step_time_s": round(result["elapsed"] / args.steps, 4),
            "mfu": round(tokens_per_s * flops_per_token / (PEAK_FLOPS * args.devices), 4),
            "peak_memory_gib": round(peak.item(), 2), "gpu": torch.cuda.get_device_name(), "commit": commit(),
            "pinned_batches": args.pin_memory, "fused_wgrad": result.get("fused_wgrad", False),
            "fp8": result.get("fp8", False), "fp8_format": args.fp8 if result.get("fp8") else None,
            "check_batches": args.check_batches if args.variant == "a" else None,
            "weight_cast_reuse": args.weight_cast_reuse, "cuda_graphs": args.cuda_graphs and args.variant in ("a", "b"),
            "first_losses": result.get("first_losses", []), "gc_in_timed_steps": result.get("gc"),
            **attention_fields(args, flops_per_token),
            **(sync_report(result["syncs"], args.steps) if args.sync_debug else {}),
        }),
        flush=True,
    )  # fmt: skip
    if result.get("timeline"):
        print("TIMELINE " + json.dumps({"variant": VARIANTS[args.variant], **result["timeline"]}), flush=True)


def attention_fields(args: argparse.Namespace, flops_per_token: int) -> dict[str, Any]:
    """The row's attention variants; with windows, the FLOPs per token they need (benchmarks/shapes.py)."""
    from lightning_megatron.gpt.attention_variants import window_layers

    fields = shape(args)
    windowed = window_layers(model_config(args)) if fields.get("window_size") is not None else ()
    return attention_row(fields, windowed, args.seq_length, flops_per_token)


def commit() -> str | None:
    """The checked-out commit (short hash, ``+uncommitted`` with local changes), or ``None`` outside a git tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def sync_report(counts: dict[str, int], steps: int) -> dict[str, Any]:
    per_step = {site: count / steps for site, count in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {"syncs_per_step": per_step, "timing": "not comparable: --sync-debug slows every synchronising call"}


def main() -> None:
    args = parse()
    if args.profile and args.host_timeline:
        raise SystemExit("--profile and --host-timeline each run torch.profiler: use one of them per run")
    if args.variant:
        child(args)
        return
    timelines = []
    for index, variant in enumerate(args.variants.split(",")):
        if variant in ("c", "d") and args.tp * args.pp * args.cp > 1:
            continue  # the HF model runs data-parallel only (DDP / FSDP2)
        if variant in ("b0", "c", "d") and window_fields(args):
            print(json.dumps({"variant": variant, "skipped": "--window: variants a and b only"}), flush=True)
            continue
        if variant != "a" and (is_moe(args) or args.ep > 1):
            print(json.dumps({"variant": variant, "skipped": "MoE shapes and --ep: variant a only"}), flush=True)
            continue
        if variant not in VARIANTS:
            print(json.dumps({"variant": variant, "error": f"unknown variant: one of {', '.join(VARIANTS)}"}))
            continue
        if (
            variant in ("b", "b0") and args.cp > 1
        ):  # Megatron-Core's context parallelism needs Transformer Engine's attention
            print(json.dumps({"variant": variant, "skipped": "--cp > 1: raw Megatron-Core's CP needs TE"}), flush=True)
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.devices}"]
        cmd += [__file__, *sys.argv[1:], "--variant", variant, "--run-index", str(index)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(json.dumps({"variant": variant, "error": (proc.stdout + proc.stderr)[-3000:]}), flush=True)
        else:
            print(lines[-1], flush=True)
        for line in proc.stdout.splitlines():
            if line.startswith("TIMELINE "):  # a JSON line too, marked as a host timeline
                timelines.append(json.loads(line[len("TIMELINE ") :]))
                print(json.dumps({"record": "host_timeline", **timelines[-1]}), flush=True)
    if timelines:  # the short form last, on stderr (stdout is JSON lines), where a truncated log still shows it
        from benchmarks.host_timeline import brief

        for summary in timelines:
            print(brief(summary), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
