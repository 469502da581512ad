"""Collective bandwidth between the GPUs of one host, at the sizes tensor parallelism moves.

    torchrun --standalone --nproc-per-node 2 benchmarks/nccl_bandwidth.py

Prints one JSON line per collective and size: time per call and bus bandwidth (nccl-tests' definition:
all-gather/reduce-scatter (n-1)/n x full size / time, all-reduce 2(n-1)/n x size / time). With sequence
parallelism every transformer layer all-gathers and reduce-scatters [seq, micro_batch, hidden] activations:
2048 x 4 x 2048 bf16 = 32 MiB for the 1.0B shape of benchmarks/throughput.py. Run with NCCL_DEBUG=INFO to see
which transport (P2P/NVLink, SHM through host memory) NCCL picked.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int = 20) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    n = dist.get_world_size()
    for mib in (4, 32, 256):
        full = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        shard = torch.empty(full.numel() // n, dtype=torch.bfloat16, device="cuda")
        cases = {
            "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (n - 1) / n),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
            "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n),
        }
        for name, (fn, factor) in cases.items():
            seconds = timed(fn)
            if dist.get_rank() == 0:
                line = {"collective": name, "size_mib": mib, "ranks": n, "time_us": round(seconds * 1e6, 1)}
                line["bus_gb_per_s"] = round(factor * full.numel() * 2 / seconds / 1e9, 1)
                print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
