"""Probe: how fast host buffers of a 1B model's optimizer state (fp32 main weights and two Adam moments, one buffer
per parameter and state: ~11.4 GB) can be allocated pinned, one thread against several, and what copying them to
the GPU then costs. Prints one JSON line per way."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def sizes() -> list[int]:
    hidden, ffn, vocab, layers = 2048, 5632, 32000, 16
    per_layer = [3 * hidden * hidden, hidden * hidden, 2 * ffn * hidden, ffn * hidden, hidden, hidden]
    return [vocab * hidden, vocab * hidden, hidden] + per_layer * layers


def release(buffers: list[torch.Tensor]) -> None:
    buffers.clear()
    torch._C._host_emptyCache()


def register(t: torch.Tensor, touch: bool = True) -> torch.Tensor:
    if touch:
        t.fill_(0)  # fault the pages in (ATen's threads)
    code = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
    assert int(code) == 0, code
    return t


def main() -> None:
    wanted = [n for n in sizes() for _ in range(3)]
    total = sum(wanted) * 4
    device = torch.empty(max(wanted), device="cuda")
    ways = {
        "pinned_1_thread": (1, lambda n: torch.empty(n, pin_memory=True)),
        "pinned_8_threads": (8, lambda n: torch.empty(n, pin_memory=True)),
        "pinned_16_threads": (16, lambda n: torch.empty(n, pin_memory=True)),
        "pageable_touched_8_threads": (8, lambda n: torch.empty(n).fill_(0)),
        "host_register_8_threads": (8, lambda n: register(torch.empty(n))),
        "host_register_1_thread": (1, lambda n: register(torch.empty(n))),
        "host_register_untouched_1_thread": (1, lambda n: register(torch.empty(n), touch=False)),
        "host_register_untouched_8_threads": (8, lambda n: register(torch.empty(n), touch=False)),
    }
    for way, (threads, allocate) in ways.items():
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            buffers = list(pool.map(allocate, wanted))
        allocated = time.perf_counter() - start
        torch.cuda.synchronize()
        start = time.perf_counter()
        for b in buffers:
            device[: b.numel()].copy_(b, non_blocking=True)
        torch.cuda.synchronize()
        copied = time.perf_counter() - start
        if way.startswith("host_register"):
            for b in buffers:
                torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
        release(buffers)
        row = dict(way=way, bytes=total, buffers=len(wanted), allocate_s=round(allocated, 3),
                   allocate_gb_s=round(total / allocated / 1e9, 2), h2d_s=round(copied, 3))  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
