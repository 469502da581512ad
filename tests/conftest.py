from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "layout_worker.py"


def run_worker(args: dict, tmp_path: Path, timeout: float = 600) -> dict:
    """Run ``tests/layout_worker.py`` (Lightning launches the extra processes); return rank 0's result."""
    out = tmp_path / f"result-{os.urandom(4).hex()}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    if args.get("accelerator", "cpu") == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps({**args, "out": str(out)})],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"worker failed ({proc.returncode}) for {args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = cuda_devices()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            need = marker.kwargs.get("devices", 1)
            if have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {have}"))
