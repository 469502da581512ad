"""Variants (b) and (b0) of benchmarks/throughput.py: a plain Megatron-Core training loop, no Lightning.

(b): the same model (``ModelConfig`` -> the same TransformerConfig and layer spec as MegatronLMModule builds, the
project's torch-native kernels included), the same bf16 + fp32-main-weights setup (Float16Module, Megatron DDP with
fp32 grad reduce, distributed Adam), the same micro-batching and loss, driven by Megatron's
``get_forward_backward_func`` directly. (b0), "stock": the same loop and model shape built from Megatron-Core alone:
its local layer spec (``get_gpt_layer_local_spec``: ``DotProductAttention``, Megatron's norms) and final norm, its
own loss (``GPTModel(..., labels=...)``: Megatron's vocab-parallel cross entropy) and its optimizer as it builds it
without Transformer Engine or apex (torch's AdamW, foreach; Megatron's gradient clipping), no torch.compile'd
fusions; only the TransformerConfig flags that select the local implementations (``gpt/transformer.py:LOCAL_BACKEND``)
come from the project. Run under torchrun.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def stock_layer_spec(config: Any) -> Any:
    """Variant (b0)'s layer spec: Megatron-Core's own local spec for ``config``, unmodified."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )  # fmt: skip


def build_chunk(config: Any, tc: Any, first: bool, last: bool, vp: int | None, kernels: str, stock: bool) -> Any:
    """One model chunk: (b)'s as MegatronLMModule builds it, or (b0)'s from Megatron-Core's local spec alone."""
    from megatron.core.models.gpt import GPTModel

    from lightning_megatron.gpt.specs import block_spec

    spec = stock_layer_spec(config) if stock else block_spec(config, tc, vp, kernels)
    return GPTModel(
        config=tc, transformer_layer_spec=spec, pre_process=first, post_process=last, vp_stage=vp,
        **config.gpt_model_kwargs("local" if stock else kernels),
    )  # fmt: skip


def run(args: Any, config: Any, data: torch.Tensor, stock: bool = False) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from lightning_megatron.gpt.plan import resolve
    from lightning_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy
    from lightning_megatron.parallel.sizes import ParallelSizes
    from lightning_megatron.parallel.state import chunk_stages, graph_safe_rng, initialize, seed

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    sizes = ParallelSizes(tp=args.tp, pp=args.pp, vpp=args.vpp, sequence_parallel=args.sp)
    initialize(sizes)
    seed(1234)
    if config.cuda_graphs:
        graph_safe_rng()  # as MegatronLMModule does: Megatron's graphs need a graph-safe RNG tracker
    kernels = "local" if stock else resolve(config.kernels, "cuda")
    p2p = {"batch_p2p_comm": not (args.pp == 2 and args.vpp is not None)}  # see MegatronStrategy
    chunks = []
    for vp_stage, (first, last) in enumerate(chunk_stages(sizes.num_chunks)):
        vp = vp_stage if args.vpp else None
        tc = config.to_transformer_config(
            kernels=kernels, compile_fusions=not stock, bf16=True, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16, **sizes.megatron_kwargs(), **p2p,
        )  # fmt: skip
        tc.calculate_per_token_loss = True
        model = build_chunk(config, tc, first, last, vp, kernels, stock).cuda()
        chunks.append(Float16Module(tc, model))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunks = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-4, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(opt_config, chunks)
    from lightning_megatron.compat.patches import ForeachClipGrads
    from lightning_megatron.training.optim import use_fused_adam

    if not stock:  # What MegatronStrategy does on GPU: torch's fused AdamW kernel, multi-tensor gradient-norm kernels.
        use_fused_adam(optimizer, fused=args.fused_adam)
        ForeachClipGrads().install()
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    chunks[0].config.grad_scale_func = optimizer.scale_loss

    dp_rank = parallel_state.get_data_parallel_rank()
    batch = args.micro_batch_size * args.micro_batches
    forward_backward = get_forward_backward_func()

    def forward_step(iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        tokens = next(iterator).cuda(non_blocking=True)
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        targets = torch.roll(tokens, -1, dims=1)
        mask = torch.ones_like(tokens, dtype=torch.float32)
        mask[:, -1] = 0
        # (b0): Megatron's own loss, the last stage returns the per-token cross entropy; (b): the logits.
        output = model(tokens, positions, None, labels=targets) if stock else model(tokens, positions, None)

        def loss_fn(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            per_token = output if stock else vocab_parallel_cross_entropy(output, targets)
            loss = (per_token.float() * mask).sum()
            return loss, mask.sum().to(torch.int), {"loss": loss.detach()}

        return output, loss_fn

    from benchmarks.recorders import GcPauses, SyncCounter, timeline_path, total_steps

    timeline = None
    if args.host_timeline:
        from benchmarks import host_timeline

        host_timeline.annotate_megatron()
        host_timeline.annotate_optimizer(optimizer)
        host_timeline.annotate_chunks(chunks)
        forward_backward = _ranged(forward_backward, "raw.forward_backward")

    if args.pin_memory:
        data = data.pin_memory()  # as DataLoader(pin_memory=True) in variants a and c: slices stay pinned
    syncs = SyncCounter(args.sync_debug)
    pauses = GcPauses()
    stamps: list[float] = []  # wall clock at the end of the warm-up and of the last step, the GPU drained
    total = args.warmup + args.steps
    summary = None
    for step in range(total_steps(args)):
        start = (step * parallel_state.get_data_parallel_world_size() + dp_rank) * batch
        micro = list(data[start : start + batch].split(args.micro_batch_size))
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks, num_microbatches=len(micro), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False,
        )  # fmt: skip
        optimizer.step()
        if step == total - 1:
            syncs.stop()
            pauses.stop()
        if step in (args.warmup - 1, total - 1):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
        if timeline is not None and step == total + args.timeline_steps - 1:
            summary = host_timeline.stop(timeline, timeline_path(args), args.timeline_steps)
        if args.host_timeline and step == total - 1:
            timeline = host_timeline.start()
        if step == args.warmup - 1:
            syncs.start()
            torch.cuda.reset_peak_memory_stats()
            if args.profile:
                from benchmarks.recorders import start_profiler

                profiler = start_profiler()
            pauses.start()  # after the profiler's start, as in variant a
    if args.profile:
        from benchmarks.recorders import write_profile

        write_profile(profiler, f"{args.profile}.{args.variant}")
    from benchmarks.recorders import megatron_counts

    return {
        "elapsed": stamps[1] - stamps[0], "steps": args.steps, "syncs": syncs.counts, "timeline": summary,
        "gc": pauses.report(), **megatron_counts(chunks),
    }  # fmt: skip


def _ranged(fn: Any, label: str) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.autograd.profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        with torch.autograd.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapped
