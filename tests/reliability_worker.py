"""A 2-process TP=2 CPU run for the failure tests: a rank that SIGKILLs itself, one that stops answering, or SIGTERM.

``main({"max_steps": 8, "ckpt_dir": ..., "losses": ..., "kill_at": 6, ...})`` in each rank forked from the test
session's fork server (tests/conftest.py:start_forked; Lightning joins the ranks as it joins torchrun's), or
``python tests/reliability_worker.py '{...}'`` (Lightning's launcher starts rank 1 as a child of rank 0, this
process). Rank 0 appends ``{"step", "loss"}`` lines to ``losses`` as it trains, so the curve survives a crash.
``own_group`` (a file path): the ranks first form a process group of their own, led by rank 0, whose id it writes
there (forked ranks otherwise share the test process's group): ``term="group"`` signals the job's processes and
their checkpoint writers and nothing else, and the test kills whatever of the job is left when it ends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens


class Failures(L.Callback):
    """Records each optimizer step's loss on rank 0; makes rank 1 die (``kill_at``) or go silent (``hang_at``) before
    that step, or send SIGTERM (``term_at``, at the ``term_at_batch``-th batch of that step's accumulation window;
    ``term_after``: at the end of that step, before its checkpoint is saved) to the whole job (``term`` =
    ``"group"``: every rank and its checkpoint writers, as a scheduler does) or to rank 1 alone (``"self"``)."""

    def __init__(self, args: dict) -> None:
        self.args = args
        self.starts_at_term = 0  # batch starts seen at global step term_at (several inside an accumulation window)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_rank != 1:
            return
        if trainer.global_step == self.args.get("kill_at"):
            _stamp(self.args["stamp"])
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_step == self.args.get("term_at"):
            self.starts_at_term += 1
            if self.starts_at_term == self.args.get("term_at_batch", 1):  # e.g. 2: the window's second batch
                self._terminate()
        if trainer.global_step == self.args.get("hang_at"):
            _stamp(self.args["stamp"])
            time.sleep(self.args["hang_for"])  # alive but silent (the test ends it once rank 0 has exited)
            os._exit(3)

    def _terminate(self) -> None:
        _stamp(self.args["stamp"])
        if self.args["term"] == "group":
            group = os.getpgid(0)
            if self.args.get("own_group"):  # never the test process's group
                assert group == int(Path(self.args["own_group"]).read_text()) != os.getpgid(os.getppid()), group
            os.killpg(group, signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        # Before ModelCheckpoint's save of this step (Lightning runs checkpoint callbacks last).
        if trainer.global_rank == 1 and trainer.global_step == self.args.get("term_after"):
            self._terminate()
        if trainer.global_rank == 0 and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # a step's end
            loss = float(trainer.callback_metrics["train_loss"])  # of the step's batches, token-weighted
            with open(self.args["losses"], "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": loss}) + "\n")


def _stamp(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _own_process_group(path: Path) -> None:
    """Rank 0 leads a new process group and writes its id to ``path``; the other ranks join it."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        os.setpgid(0, 0)
        Path(f"{path}.tmp").write_text(str(os.getpgid(0)))
        os.replace(f"{path}.tmp", path)  # whole when it appears
        return
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 did not write {path}")
        time.sleep(0.01)
    os.setpgid(0, int(path.read_text()))


def main(args: dict) -> None:
    if args.get("own_group"):
        _own_process_group(Path(args["own_group"]))
    data = synthetic_tokens(64, 32, 256, seed=1)
    data[:, 16:] = data[:, :16]
    model = MegatronLMModule(tiny_gpt(), lr=3e-3, warmup_steps=1, decay_steps=16)
    callbacks: list = [Failures(args)]
    if args.get("ckpt_dir"):
        callbacks.append(
            ModelCheckpoint(dirpath=args["ckpt_dir"], every_n_train_steps=args["ckpt_every"], save_last=True)
        )
    if args.get("on_exception_dir"):
        callbacks.append(OnExceptionCheckpoint(args["on_exception_dir"]))
    devices = args.get("devices", 2)
    strategy = MegatronStrategy(
        tp=devices, micro_batch_size=2, async_save=args.get("async_save", False),
        timeout=timedelta(seconds=args["timeout"]),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=args["max_steps"], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(args.get("ckpt_dir")),
        callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0,
        accumulate_grad_batches=args.get("accumulate", 1),
    )  # fmt: skip
    try:
        trainer.fit(model, DataLoader(data, batch_size=8, drop_last=True), ckpt_path=args.get("resume"))
    except SystemExit as stop:  # SIGTERM: each rank says how it exits
        if args.get("exits"):
            Path(args["exits"], f"rank{trainer.global_rank}").write_text(str(stop.code))
        raise


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
