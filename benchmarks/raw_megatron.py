"""Variant (b) of benchmarks/throughput.py: a plain Megatron-Core training loop, no Lightning.

The same model (``ModelConfig`` -> the same TransformerConfig and layer spec as MegatronLMModule builds), the same
bf16 + fp32-main-weights setup (Float16Module, Megatron DDP with fp32 grad reduce, distributed Adam), the same
micro-batching and loss, driven by Megatron's ``get_forward_backward_func`` directly. Run under torchrun.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def run(args: Any, config: Any, data: torch.Tensor) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from lightning_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy
    from lightning_megatron.kernels.resolve import resolve
    from lightning_megatron.kernels.specs import block_spec
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
    kernels = resolve(config.kernels, "cuda")
    p2p = {"batch_p2p_comm": not (args.pp == 2 and args.vpp is not None)}  # see MegatronStrategy
    chunks = []
    for vp_stage, (first, last) in enumerate(chunk_stages(sizes.num_chunks)):
        vp = vp_stage if args.vpp else None
        tc = config.to_transformer_config(
            kernels=kernels, compile_fusions=True, bf16=True, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16, **sizes.megatron_kwargs(), **p2p,
        )  # fmt: skip
        tc.calculate_per_token_loss = True
        model = GPTModel(
            config=tc, transformer_layer_spec=block_spec(config, tc, vp, kernels), pre_process=first,
            post_process=last, vp_stage=vp, **config.gpt_model_kwargs(kernels),
        ).cuda()  # fmt: skip
        chunks.append(Float16Module(tc, model))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunks = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-4, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(opt_config, chunks)
    from lightning_megatron.training.clip_grads import use_foreach_clip_grads
    from lightning_megatron.training.optim import use_fused_adam

    # What MegatronStrategy does on GPU: torch's fused AdamW kernel, multi-tensor gradient-norm kernels.
    use_fused_adam(optimizer, fused=args.fused_adam)
    use_foreach_clip_grads()
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
        output = model(tokens, positions, None)

        def loss_fn(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss = (vocab_parallel_cross_entropy(logits, targets).float() * mask).sum()
            return loss, mask.sum().to(torch.int), {"loss": loss.detach()}

        return output, loss_fn

    from benchmarks.recorders import GcPauses, SyncCounter
    from benchmarks.throughput import timeline_path, total_steps

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
                from benchmarks.throughput import start_profiler

                profiler = start_profiler()
            pauses.start()  # after the profiler's start, as in variant a
    if args.profile:
        from benchmarks.throughput import write_profile

        write_profile(profiler, f"{args.profile}.b")
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return {
        "elapsed": stamps[1] - stamps[0], "steps": args.steps, "params": params, "syncs": syncs.counts,
        "timeline": summary, "gc": pauses.report(),
    }  # fmt: skip


def _ranged(fn: Any, label: str) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.autograd.profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        with torch.autograd.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapped
