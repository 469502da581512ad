"""Lightning habits at PP=2 (2 processes, CPU): run by tests/test_lightning_contract_pp.py.

``python tests/contract_worker.py '{"out": "dir", "steps": 4}'``. Rank 0 holds the first pipeline stage, which
computes no loss. The run logs to a CSVLogger, ranks steps with ModelCheckpoint(monitor="train_loss"), returns
loss_fn logs, logs with sync_dist, reads grad norms, saves after fit, tests, and resumes from the after-fit save and
from the last step's checkpoint. Every rank writes ``<out>/rank<global rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from logged_module import Logged  # tests/ is this script's directory
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens


class LogRank(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        # Reduced over the data-parallel group (size 1 here): each rank keeps its own value. Over the world it
        # would be the mean 0.5 on both.
        pl_module.log("rank_value", torch.tensor(float(trainer.global_rank)), sync_dist=True)


class Record(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.norms.append(float(trainer.strategy.grad_norms()["grad_2.0_norm_total"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        names = ("train_loss", "grad_norm", "mean_loss", "ones", "rank_value")
        row = {name: float(trainer.callback_metrics[name]) for name in names}
        self.steps.append({"step": trainer.global_step, "loss": float(outputs["loss"]), **row})


def _trainer(out: Path, max_steps: int, callbacks: list, logger: object = False) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=MegatronStrategy(pp=2, micro_batch_size=2), max_steps=max_steps,
        logger=logger, log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=True,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the same batch every step, whatever the position in the data
        default_root_dir=out,
    )  # fmt: skip


def main(args: dict) -> None:
    out, steps = Path(args["out"]), args["steps"]
    L.seed_everything(3)
    data = synthetic_tokens(4, 32, 256, seed=2)
    train = DataLoader(data.repeat(4 * steps, 1), batch_size=4)
    val = DataLoader(synthetic_tokens(8, 32, 256, seed=9), batch_size=4)
    record = Record()
    best = ModelCheckpoint(dirpath=out / "best", monitor="train_loss", every_n_train_steps=1, filename="{step}")
    # Only the last step's checkpoint is resumed below: saving it alone spares PP=2 saves nobody reads.
    every = ModelCheckpoint(dirpath=out / "every", every_n_train_steps=steps, save_top_k=-1, filename="{step}")
    trainer = _trainer(out, steps, [LogRank(), record, best, every], CSVLogger(out, name="csv"))
    model = Logged(tiny_gpt(num_layers=2), lr=3e-3, warmup_steps=1, decay_steps=16)
    trainer.fit(model, train)
    trainer.save_checkpoint(out / "final.ckpt")  # after fit
    val_loss = trainer.validate(model, val)[0]["val_loss"]
    test_loss = trainer.test(model, val)[0]["test_loss"]
    resumed = {}
    for name, path in (("final", out / "final.ckpt"), ("every", out / "every" / f"step={steps}.ckpt")):
        again = Record()
        _trainer(out, steps + 2, [LogRank(), again]).fit(
            Logged(tiny_gpt(num_layers=2), lr=3e-3, warmup_steps=1, decay_steps=16), train, ckpt_path=path
        )
        resumed[name] = [row["loss"] for row in again.steps]
    result = {
        "steps": record.steps, "norms": record.norms, "val_loss": val_loss, "test_loss": test_loss,
        "best_score": float(best.best_model_score), "best_path": Path(best.best_model_path).name, "resumed": resumed,
    }  # fmt: skip
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
