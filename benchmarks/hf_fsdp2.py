"""Variant d of benchmarks/throughput.py: ``transformers`` Llama trained the way a strong user would without us.

FSDP2 ``fully_shard`` per decoder block and at the root with fp32 parameters (the master weights), bf16 compute
and fp32 gradient reduction (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), ``torch.compile``
per block, fused AdamW, gradient clipping 1.0, and the step's micro-batches accumulated (gradient sync on the
last one only). Run under torchrun (one process per GPU), launched by throughput.py.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def run(args: Any, hf_config: Any, data: torch.Tensor) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    from benchmarks.recorders import GcPauses, SyncCounter, hf_counts, start_profiler, write_profile

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).cuda()  # fp32 parameters: FSDP2 keeps them as the master copy
    counts = hf_counts(model)  # before sharding: whether the head is tied is a question about plain parameters
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)

    if args.pin_memory:
        data = data.pin_memory()
    batch, rank, world = args.micro_batch_size * args.micro_batches, dist.get_rank(), dist.get_world_size()
    syncs = SyncCounter(args.sync_debug)
    pauses = GcPauses()
    stamps: list[float] = []
    profiler = None
    total = args.warmup + args.steps
    for step in range(total):
        start = (step * world + rank) * batch
        micro = data[start : start + batch].split(args.micro_batch_size)
        for i, tokens in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            tokens = tokens.cuda(non_blocking=True)
            (model(input_ids=tokens, labels=tokens).loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == total - 1:
            syncs.stop()
            pauses.stop()
        if step in (args.warmup - 1, total - 1):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
        if step == args.warmup - 1:
            syncs.start()
            torch.cuda.reset_peak_memory_stats()
            if args.profile:
                profiler = start_profiler()
            pauses.start()  # after the profiler's start, as in variant a
    if profiler is not None:
        write_profile(profiler, f"{args.profile}.d")
    return {
        "elapsed": stamps[1] - stamps[0], "steps": args.steps, "syncs": syncs.counts, "gc": pauses.report(), **counts,
    }  # fmt: skip
