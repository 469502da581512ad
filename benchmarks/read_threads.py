"""Reading a torch DCP checkpoint by one thread against several (``checkpointing/load/reading.py``), without a strategy:
48 fp32 tensors of 16-28 MB (1.4 GB) saved to ``--out``, then read back from the page cache ``--repeats`` times per
thread count, the counts alternated. Prints one JSON line per read.

    python benchmarks/read_threads.py --out /tmp/read_threads --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_megatron.checkpointing.load.reading import ThreadedReader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the checkpoint (replaced)")
    p.add_argument("--threads", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    state = {f"t{i}": torch.randn(2048, 2048 + 64 * i) for i in range(48)}
    dcp.save(state, storage_writer=FileSystemWriter(str(args.out)), no_dist=True)
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    size = sum(value.nbytes for value in state.values())
    dcp.load(target, storage_reader=FileSystemReader(str(args.out)), no_dist=True)  # warm-up: the page cache
    for _ in range(args.repeats):
        for threads in args.threads:
            start = time.perf_counter()
            dcp.load(target, storage_reader=ThreadedReader(str(args.out), threads), no_dist=True)
            seconds = time.perf_counter() - start
            rate = round(size / seconds / 1e9, 2)
            row = {"threads": threads, "bytes": size, "read_s": round(seconds, 3), "gb_s": rate,
                   "cpus": torch.get_num_threads()}  # fmt: skip
            print(json.dumps(row), flush=True)
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
