"""The resident memory of the async-save writer process once it serves (its imports done, no save yet).

    python benchmarks/writer_memory.py [--repeats 3] [--commit $(git rev-parse --short HEAD)]

Starts the writer process as an async save does (``python -P .../checkpointing/save/writer_main.py``, as
``WriterProcess`` runs it), waits until it idles (its CPU time unchanged for a second: the imports are done and it
waits for a message), reads its memory from ``/proc/<pid>/status`` and kills it. One JSON line per start:
``rss_gb`` (VmRSS: every resident page, the shared libraries' included), ``rss_anon_gb`` (its own heap),
``rss_file_gb`` (mapped files, shared with other processes that map them), ``start_s`` (from the start until it
idled). Linux only; no GPU needed (the writer uses none).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def memory(pid: int) -> dict[str, float]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            found[key] = int(value.split()[0]) * 1024 / 1e9  # kB
    names = {"VmRSS": "rss_gb", "RssAnon": "rss_anon_gb", "RssFile": "rss_file_gb", "RssShmem": "rss_shmem_gb"}
    return {name: round(found[key], 3) for key, name in names.items()}


def measure() -> dict[str, float]:
    """Start one writer process as ``WriterProcess`` does (its command, a socket pair, no GPU), measure it once it
    idles, and kill it (it has nothing to write)."""
    package = importlib.util.find_spec("lightning_megatron")  # found without running the package's __init__
    assert package is not None
    assert package.submodule_search_locations
    main = next(Path(next(iter(package.submodule_search_locations))).rglob("writer_main.py"))  # checkpointing/...
    ours, theirs = socket.socketpair()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    start = time.monotonic()
    command = [sys.executable, "-P", str(main), str(os.getpid()), str(theirs.fileno())]
    process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    try:
        last, still_since = cpu_seconds(process.pid), time.monotonic()
        while time.monotonic() - still_since < 1.0:
            time.sleep(0.1)
            if process.poll() is not None:
                raise RuntimeError(f"the writer process exited with code {process.returncode}")
            now = cpu_seconds(process.pid)
            if now - last > 0.02:  # an idle writer only checks on its parent once a second
                last, still_since = now, time.monotonic()
        return {**memory(process.pid), "start_s": round(still_since - start, 2)}
    finally:
        process.kill()
        process.wait()
        ours.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commit", default=None, help="the commit of the code measured, recorded in each row")
    args = parser.parse_args()
    import torch

    for _ in range(args.repeats):
        row = {"bench": "writer_memory", **measure(), "device": "cpu", "cpus": len(os.sched_getaffinity(0))}
        row["torch"] = torch.__version__
        row["megatron_core"] = importlib.metadata.version("megatron-core")
        row["python"] = platform.python_version()
        if args.commit:
            row["commit"] = args.commit
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
