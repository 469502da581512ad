"""Cost of the per-step batch check (``MegatronStrategy(check_batches=True)``): the host fingerprint of one
DataLoader batch and the all-reduce of two integers over a model replica's gloo group, timed alone.

    torchrun --nproc-per-node 2 benchmarks/batch_check.py --seq-length 2048 --batch 8

Prints one JSON row (rank 0): microseconds per fingerprint and per all-reduce (median of ``--repeats``), for a batch
of ``--batch`` rows of ``--seq-length`` token ids plus labels (int64, pinned like a DataLoader's pinned batches). The
step-level effect is measured by ``benchmarks/throughput.py`` with and without ``--no-check-batches``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="rows per DataLoader batch (micro-batch size x count)")
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    from lightning_megatron.data.consistency import fingerprint

    torch.distributed.init_process_group("gloo")
    ids = torch.randint(0, 32000, (args.batch, args.seq_length))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if torch.cuda.is_available():
        batch = {k: v.pin_memory() for k, v in batch.items()}
    hashing, reducing = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        value = fingerprint(batch)
        hashing.append(time.perf_counter() - start)
        both = torch.tensor([value, -value], dtype=torch.int64)
        torch.distributed.barrier()
        start = time.perf_counter()
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        reducing.append(time.perf_counter() - start)
    if torch.distributed.get_rank() == 0:
        row = {
            "benchmark": "batch_check", "world": torch.distributed.get_world_size(), "batch": args.batch,
            "seq": args.seq_length, "batch_bytes": sum(v.numel() * v.element_size() for v in batch.values()),
            "fingerprint_us": round(statistics.median(hashing) * 1e6, 1),
            "allreduce_us": round(statistics.median(reducing) * 1e6, 1),
            "cpu": torch.get_num_threads(),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
