from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).parent / "layout_worker.py"


# What an in-process Trainer leaves in os.environ; a child inheriting MASTER_PORT would bind a port we hold.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    # One intra-op thread per rank: 2-4 ranks of a multi-process test share CI's 2 cores, and torch's default of
    # a thread per core in every rank oversubscribes them (gloo's own threads come on top).
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_forked(
    entry: str, args: dict, world: int, cwd: Path, env: dict[str, str], timeout: float = 600, expect: Path | None = None
) -> None:
    """Run ``entry`` (``"module:function"`` of a script in tests/, called with ``args``) as ``world`` ranks forked
    from the session's fork server (``tests/forked.py``); raise with the ranks' output if one fails, the run exceeds
    ``timeout`` seconds, or the file ``expect`` (the run's result) is missing afterwards. Lightning joins the ranks as
    it joins torchrun's; its own launcher is exercised by the DP=2 layout test, the examples and the CLI fit."""
    ranks, logs = start_forked(entry, args, world, cwd, env)
    try:
        failure = _wait(ranks, timeout)
    finally:  # survivors of a failure, or of an interrupt: no rank may outlive the test (pytest's exit waits for it)
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    if not failure and expect is not None and not expect.exists():
        failure = f"no result file {expect.name}"
    if failure:
        output = "\n".join(f"--- rank {r}:\n{log.read_text()[-4000:]}" for r, log in enumerate(logs) if log.exists())
        raise AssertionError(f"{failure} for {entry} {args}:\n{output}")


def start_forked(
    entry: str, args: dict, world: int, cwd: Path, env: dict[str, str]
) -> tuple[list[multiprocessing.process.BaseProcess], list[Path]]:
    """Start ``world`` ranks of ``entry`` forked from the session's fork server (see ``run_forked``); the processes
    (started: the caller must see that none outlives the test) and each rank's log file (its stdout and stderr)."""
    if str(WORKER.parent) not in sys.path:
        sys.path.insert(0, str(WORKER.parent))  # the fork server imports the workers as scripts import their helpers
    import forked

    context = fork_server()
    logs = [cwd / f"rank{rank}-{os.urandom(4).hex()}.log" for rank in range(world)]
    port = free_port()
    ranks = [
        context.Process(target=forked.rank_main, args=(entry, args, rank, world, port, str(cwd), str(log), env))
        for rank, log in enumerate(logs)
    ]
    started = []
    try:
        for process in ranks:
            process.start()
            started.append(process)
    except BaseException:
        for process in started:
            process.kill()
            process.join()
        raise
    return ranks, logs


def fork_server() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context whose processes are forked from the session's fork server, which has imported
    the stack once (torch, Lightning, Megatron, transformers: ~7 s of CPU that a fresh interpreter spends)."""
    context = multiprocessing.get_context("forkserver")
    # (Only installed packages: Python 3.12.1's fork server ignores the parent's sys.path while preloading; the
    # processes themselves get it, and import the scripts in tests/.)
    context.set_forkserver_preload(["lightning_megatron", "lightning.pytorch", "megatron.core", "transformers"])
    return context


def _wait(ranks: list, timeout: float) -> str:
    """Wait for the ranks. Once one has exited, its peers get a grace period (a failed rank's peers wait in a
    collective until their own timeout). Returns what went wrong (survivors, exit code None, are left to the caller to
    kill), or ``""``."""
    deadline, first_exit = time.monotonic() + timeout, None
    while any(p.is_alive() for p in ranks):
        now = time.monotonic()
        if first_exit is None and any(not p.is_alive() for p in ranks):
            first_exit = now
        if now > deadline or (first_exit is not None and now > first_exit + 60):
            what = f"over {timeout:.0f} s" if first_exit is None else "still running 60 s after a peer exited"
            return f"{what}, exit codes {[p.exitcode for p in ranks]}"
        time.sleep(0.1)
    codes = [p.exitcode for p in ranks]
    return "" if codes == [0] * len(ranks) else f"exit codes {codes}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_together(
    commands: list[tuple[list[str], dict[str, str], Path]], timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """Start every ``(command, env, cwd)`` at once (nodes that must meet, or independent launches side by side) and
    wait for all within one ``timeout``; their results in order, stdout and stderr apart.

    Output goes to files (no pipe fills up while another process is waited for). Each command gets a session of its
    own, killed with everything in it when the wait ends (a launcher's children: Lightning's extra ranks).
    """
    procs, logs = [], []
    for command, env, cwd in commands:
        log = cwd / f"out-{os.urandom(4).hex()}", cwd / f"err-{os.urandom(4).hex()}"
        with log[0].open("w") as out, log[1].open("w") as err:
            procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return [
        subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())
        for proc, (out, err) in zip(procs, logs, strict=True)
    ]


def run_worker(args: dict, tmp_path: Path, timeout: float = 600, launcher: str = "fork") -> dict:
    """Run ``tests/layout_worker.py`` with ``args["devices"]`` processes; return rank 0's result.

    ``launcher``: ``"fork"`` (CPU runs: the ranks are forked from the session's fork server, see
    ``tests/forked.py``; Lightning joins them), ``"lightning"`` (Lightning's own launcher starts the extra processes,
    as for a user's script; GPU runs always), or ``"torchrun"`` (torchrun starts them all and Lightning joins them
    through its TorchElastic cluster environment).
    """
    out = tmp_path / f"result-{os.urandom(4).hex()}.json"
    env = child_env()
    cpu = args.get("accelerator", "cpu") == "cpu"
    if cpu:  # CPU runs must not touch a GPU that happens to be there
        env["CUDA_VISIBLE_DEVICES"] = ""
    if cpu and launcher == "fork":
        world = args.get("devices", 1)
        run_forked("layout_worker:main", {**args, "out": str(out)}, world, tmp_path, env, timeout, expect=out)
        return json.loads(out.read_text())
    command = [sys.executable]
    if launcher == "torchrun":
        command += ["-m", "torch.distributed.run", "--nproc-per-node", str(args["devices"]), "--master-port", "29531"]
    proc = subprocess.run(
        [*command, str(WORKER), json.dumps({**args, "out": str(out)})],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"worker failed ({proc.returncode}) for {args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def run_here(args: dict, tmp_path: Path) -> dict:
    """``run_worker``'s one-process run inside this process: the same script and arguments, without starting an
    interpreter and importing torch, Lightning and Megatron again (~15 s of CPU per launch).

    For one-process reference runs on CPU. One intra-op thread, as ``child_env`` gives a launched worker, so that
    the run computes what a launch would.
    """
    assert args.get("devices", 1) == 1, args
    assert args.get("accelerator", "cpu") == "cpu", args
    if str(WORKER.parent) not in sys.path:
        sys.path.insert(0, str(WORKER.parent))  # the worker imports its helpers as a script does
    import layout_worker

    out = tmp_path / f"result-{os.urandom(4).hex()}.json"
    threads = torch_threads(1)
    try:
        with contextlib.chdir(tmp_path):
            layout_worker.main({**args, "out": str(out)})
    finally:
        torch_threads(threads)
    return json.loads(out.read_text())


def torch_threads(count: int) -> int:
    """Set torch's intra-op thread count; return the previous one."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    return previous


def assert_continues_at_tp2_with_sp(
    model: dict, tmp_path: Path, also: tuple[dict, ...] = (), data: dict | None = None
) -> None:
    """One process trains ``tiny_gpt(**model)`` 4 steps, checkpointing at step 2; TP=2 with sequence parallelism
    (and each two-process layout of ``also``, e.g. ``{"cp": 2}``, side by side) resumes that checkpoint and must
    follow the one-process curve (steps 3 and 4) and validation at step 4. ``data``: layout_worker's data options
    for every run, e.g. ``{"packed": True}``."""
    val = {"limit_val_batches": 2, "val_check_interval": 4, **(data or {})}
    saves = {"ckpt_dir": str(tmp_path / "ckpt"), "ckpt_every": 2}
    full = run_here({"model": model, "devices": 1, "max_steps": 4, **val, **saves}, tmp_path)
    resume = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    layouts = [{"tp": 2, "sp": True}, *also]
    runs = [{"model": model, "devices": 2, **layout, "max_steps": 4, "resume": resume, **val} for layout in layouts]
    assert full["train"]["3"] != full["train"]["4"]
    for layout, got in zip(layouts, run_workers(runs, tmp_path), strict=True):
        assert set(got["train"]) == {"3", "4"}, (layout, got["train"])
        for step in ("3", "4"):
            assert got["train"][step] == pytest.approx(full["train"][step], rel=2e-4), (layout, step)
        assert got["val"]["4"] == pytest.approx(full["val"]["4"], rel=2e-4), layout


def run_workers(runs: list[dict], tmp_path: Path, timeout: float = 600) -> list[dict]:
    """Several independent ``run_worker`` runs at once (each on its own free port); their results in order.

    Two runs side by side keep both of CI's cores busy where one run's ranks wait on each other.
    """
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run_worker, args, tmp_path, timeout) for args in runs]
        return [future.result() for future in futures]


def run_in_triton_interpreter(module: str, function: str) -> None:
    """Run ``module.function()`` (checks of Triton kernels on CPU tensors) in a fresh interpreter under
    ``TRITON_INTERPRET=1`` (read when the kernels are defined, so not in this process); fail with its stderr."""
    pytest.importorskip("triton")
    code = f"from {module} import {function} as checks; checks()"
    env = child_env(TRITON_INTERPRET="1")  # without the launch variables: its own MASTER_PORT if it needs one
    root = Path(__file__).parents[1]
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def one_process_trainer(max_steps: int, **kwargs: object) -> Any:
    """The one-process CPU Trainer of the Lightning-contract tests: ``MegatronStrategy(micro_batch_size=2)``, no
    logger, checkpointing, progress bar, summary or sanity check, and no injected sampler (every rank and epoch reads
    the rows in order); ``kwargs`` override."""
    import lightning as L

    from lightning_megatron import MegatronStrategy

    settings: dict = {
        "accelerator": "cpu", "devices": 1, "strategy": MegatronStrategy(micro_batch_size=2), "max_steps": max_steps,
        "logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0, "use_distributed_sampler": False, **kwargs,
    }  # fmt: skip
    return L.Trainer(**settings)


@contextlib.contextmanager
def one_process_megatron(port: int, cpu: bool = True) -> Iterator[None]:
    """Megatron's parallel state for this one process (gloo; in CPU mode unless ``cpu=False``, for GPU tests), for
    tests of modules outside a Trainer."""
    from lightning_megatron.parallel.state import one_process

    with one_process(port, cpu=cpu):
        yield


@pytest.fixture
def fresh_megatron_state() -> None:
    """For tests that check a failing run leaves no Megatron state: start as a fresh process would, without the
    groups that an earlier in-process run kept for a trainer.save_checkpoint after it (training/retained.py)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what the imports and the collection created (~600,000 objects: torch, Lightning, Megatron, transformers)
    out of the garbage collector's reach: every run's teardown makes a full collection (parallel/state.py:destroy),
    which otherwise walks all of them (~0.3 s of CPU each time; over the suite 277 s of this process's CPU, 57 s
    with them frozen). No run exists yet; the runs' own objects, created later, are collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def gpu_tests_run_outside_cpu_mode(request: pytest.FixtureRequest) -> None:
    """A ``gpu`` test inside CPU mode (a CPU test's module fixture still open) would silently run on the CPU, as the
    fp8 GPU test did until 2026-12-03: fail it instead."""
    if request.node.get_closest_marker("gpu") is None:
        return
    from lightning_megatron.compat import cpu as cpu_layer

    if cpu_layer.is_enabled():
        pytest.fail("a gpu test started inside CPU mode (a CPU test's fixture is open): run GPU tests with -m gpu")


class Payload:
    """Unpickling this runs code (it creates ``marker``): what a tampered checkpoint or weight file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def flip_bit(path: Path, fqn_prefix: str) -> str:
    """Flip one bit in the values of the first stored tensor of checkpoint ``path`` whose name starts with
    ``fqn_prefix`` (not in its ``torch.save`` container: the entry still loads, with a wrong value); its name."""
    import io

    import torch

    metadata = checkpoint_metadata(path)
    index, info = next((i, s) for i, s in sorted(metadata.storage_data.items(), key=lambda x: x[0].fqn)
                       if i.fqn.startswith(fqn_prefix))  # fmt: skip
    file = path / info.relative_path
    blob = bytearray(file.read_bytes())
    entry = bytes(blob[info.offset : info.offset + info.length])
    values = torch.load(io.BytesIO(entry), weights_only=True).contiguous().view(torch.uint8).numpy().tobytes()
    at = entry.find(values)
    assert at > 0, "the tensor's bytes in the entry"
    assert entry.find(values, at + 1) < 0, "once"
    blob[info.offset + at + len(values) // 2] ^= 0x40
    file.write_bytes(bytes(blob))
    return index.fqn


def checkpoint_metadata(path: Path) -> Any:
    """The torch DCP metadata of checkpoint ``path`` (where each stored entry is)."""
    from lightning_megatron.checkpointing.integrity.checks import read_metadata

    return read_metadata(path)


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process's checkpoints of the tiny GPT (``tests/tiny_gpt_runs.py``'s model and data), shared by the tests that
    damage or tamper with copies of them: a full checkpoint (step 2), a weights-only one, and an adapter-only one
    (LoRA on the full one's weights)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronLMModule
    from tests.tiny_gpt_runs import DATA, tiny_fit, tiny_trainer

    root = tmp_path_factory.mktemp("saved")
    tiny_fit(2, ModelCheckpoint(dirpath=root, filename="full", every_n_train_steps=2))
    trainer = tiny_trainer(1)
    module = MegatronLMModule.load_from_checkpoint(root / "full.ckpt")
    trainer.validate(module, DataLoader(DATA[:8], batch_size=8), verbose=False)
    trainer.save_checkpoint(root / "weights.ckpt", weights_only=True)
    lora = MegatronLMModule.load_from_checkpoint(root / "full.ckpt", lora={"rank": 2, "alpha": 4.0})
    saver = ModelCheckpoint(dirpath=root, filename="adapters", every_n_train_steps=1)
    tiny_trainer(1, callbacks=[saver], enable_checkpointing=True).fit(lora, DataLoader(DATA, batch_size=8))
    return {name: root / f"{name}.ckpt" for name in ("full", "weights", "adapters")}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny random HF dense checkpoints of ``tests/hf_dense_models.py`` (one per ``ARCHS`` entry), written once
    for the modules that read them."""
    from tests.hf_dense_models import ARCHS, make_hf_model

    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_tokens() -> Any:
    """The rows the HF tests (dense and MoE) predict and validate on (``tests/hf_moe_models.py``: ``make_tokens``)."""
    from tests.hf_moe_models import make_tokens

    return make_tokens()


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny random HF MoE checkpoints of ``tests/hf_moe_models.py`` (one per ``ARCHS`` entry), written once for
    the modules that read them."""
    from tests.hf_moe_models import ARCHS, make_hf_model

    root = tmp_path_factory.mktemp("hf_moe")
    return {arch: make_hf_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def moe_layouts(moe_models: dict[str, Path], hf_tokens: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shared two-process MoE launch: every job of ``tests/hf_moe_models.py``'s ``LAYOUTS`` through
    ``tests/hf_worker.py``, in two 2-process runs side by side, once per session; per job its ranks' results, logits
    and files (``layout_results``)."""
    from tests.hf_moe_models import layout_results, layout_runs

    tmp = tmp_path_factory.mktemp("hf_moe_layouts")
    runs, env = layout_runs(moe_models, hf_tokens, tmp), child_env(CUDA_VISIBLE_DEVICES="")
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:  # each run's ranks wait on each other
        list(pool.map(lambda args: run_forked("hf_worker:main", args, 2, tmp, env,
                                              expect=Path(f"{args['out']}.rank1.json")), runs))  # fmt: skip
    return layout_results(runs)


_OPENED: list[str] | None = None  # while recording_opens() runs: the paths Python opened


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def recording_opens() -> Iterator[list[str]]:
    """The paths this process opens through Python (``open``, ``os.open``: torch's checkpoint reader included; not
    native readers such as safetensors') inside the block. The audit hook is added once, idle outside the block."""
    global _OPENED
    if not getattr(recording_opens, "installed", False):
        sys.addaudithook(_audit)
        recording_opens.installed = True  # type: ignore[attr-defined]
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None
