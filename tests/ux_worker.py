"""One run over a token file, launched by tests/test_multinode.py (Lightning's launcher, torchrun, two "nodes").

``python tests/ux_worker.py '{"devices": 2, "num_nodes": 2, "tp": 2, "tokens": "t.bin", "out": "dir", ...}'``
Every rank writes ``<out>/rank<global rank>.json``: its ranks (global, local, node, data-/tensor-parallel), device,
the per-step ``train_loss`` and a fingerprint of every sample it trained on; with ``"logs"`` the run also logs
through Lightning's CSVLogger and TensorBoardLogger into that directory.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_megatron import MegatronLMModule, MegatronStrategy, TokenFileDataModule, tiny_gpt


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.samples: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses[trainer.global_step] = float(outputs["loss"])
        self.samples[trainer.global_step] = [zlib.crc32(sample.numpy().tobytes()) for sample in batch]


def main(args: dict) -> None:
    from megatron.core import parallel_state

    L.seed_everything(7)
    record = Record()
    logs = args.get("logs")
    loggers = [CSVLogger(logs, name="csv"), TensorBoardLogger(logs, name="tb")] if logs else False
    trainer = L.Trainer(
        accelerator="cpu", devices=args["devices"], num_nodes=args.get("num_nodes", 1),
        strategy=MegatronStrategy(tp=args.get("tp", 1), pp=args.get("pp", 1), micro_batch_size=2),
        max_steps=args["max_steps"], logger=loggers, log_every_n_steps=1, callbacks=[record],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=args.get("limit_val_batches", 0),
        val_check_interval=args.get("val_check_interval"), check_val_every_n_epoch=None,
    )  # fmt: skip
    model = MegatronLMModule(tiny_gpt(num_layers=2), lr=3e-3, warmup_steps=1, decay_steps=16)
    data = TokenFileDataModule(args["tokens"], seq_length=32, batch_size=4, val_fraction=0.25)
    ranks = {}

    class Ranks(L.Callback):  # read while Megatron's groups exist
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            ranks["dp_rank"] = parallel_state.get_data_parallel_rank()
            ranks["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
            ranks["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()

    trainer.callbacks.append(Ranks())
    trainer.fit(model, datamodule=data)
    result = {
        "global_rank": trainer.global_rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
        "world_size": trainer.world_size, "device": str(trainer.strategy.root_device), **ranks,
        "train": record.losses, "samples": record.samples,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }  # fmt: skip
    Path(args["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
