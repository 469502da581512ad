"""One training/validation run at a given layout, launched by the multi-process tests (and usable by hand).

``python tests/layout_worker.py '{"devices": 2, "tp": 2, "max_steps": 4, "out": "/tmp/r.json", ...}'``
Lightning's launcher re-runs this command once per extra process; rank 0 writes the JSON result.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from logged_module import Logged, Metered  # tests/ is this script's directory
from torch.utils.data import DataLoader

from lightning_megatron import (
    CheckpointConfig,
    MegatronEMA,
    MegatronLMModule,
    MegatronStrategy,
    MegatronValueModule,
    pack_sequences,
    tiny_gpt,
)
from lightning_megatron.data.corpus import synthetic_tokens

GLOBAL_BATCH = 8


class Recorder(L.Callback):
    def __init__(self, logs: bool = False) -> None:
        self.train: dict[int, float] = {}
        self.val: dict[int, float] = {}
        self.logs = logs
        self.contract: dict[int, dict[str, float]] = {}  # with logs: what callbacks see of the step
        self._norm = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        if self.logs:
            self._norm = float(trainer.strategy.grad_norms()["grad_2.0_norm_total"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.train[trainer.global_step] = float(outputs["loss"])
        if self.logs:
            metrics = trainer.callback_metrics
            seen = {name: float(metrics[name]) for name in ("train_loss", "mean_loss", "ones", "grad_norm")}
            self.contract[trainer.global_step] = {**seen, "norm_total": self._norm}

    def on_validation_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        key = -1 if trainer.sanity_checking else trainer.global_step
        self.val[key] = float(trainer.callback_metrics["val_loss"])


def value_items(tokens: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": t, "returns": (t % 7).float() / 7, "loss_mask": (t % 5 != 0).long()} for t in tokens]


def packed_rows(tokens: torch.Tensor, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` packed rows of 32 tokens: documents of 3-20 tokens cut from ``tokens``, packed first-fit."""
    generator = torch.Generator().manual_seed(seed)
    flat, documents, start = tokens.flatten(), [], 0
    while start < len(flat) - 20:
        length = int(torch.randint(3, 21, (), generator=generator))
        documents.append(flat[start : start + length])
        start += length
    rows = pack_sequences(documents, 32)
    assert len(rows) >= count, len(rows)
    return rows[:count]


def varlen_items(tokens: torch.Tensor, seed: int) -> list[dict[str, torch.Tensor]]:
    lengths = torch.randint(4, 33, (len(tokens),), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(tokens.shape[1])
    return [{"input_ids": t, "attention_mask": (positions < n).long()} for t, n in zip(tokens, lengths, strict=True)]


def _save_predictions(preds: list, path: str, rank: int) -> None:
    if isinstance(preds[0], dict):
        joined = {key: torch.cat([p[key] for p in preds]) for key in preds[0]}
        torch.save(joined, f"{path}.rank{rank}.pt")
    else:
        torch.save(torch.cat(preds), f"{path}.rank{rank}.pt")


class Printed(logging.Handler):
    """The lines a logger printed."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class OwnState(L.Callback):
    """Gives the module state beside its chunks -- a step counter buffer and a small head -- changed at every
    training batch's start (before that step's checkpoint); records it when training starts (after a resume) and
    ends. ``per_rank``: the counter starts at the rank, so that a model replica's ranks disagree."""

    def __init__(self, per_rank: bool = False) -> None:
        self.per_rank = per_rank
        self.at_start: dict[str, list] = {}
        self.at_end: dict[str, list] = {}

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        start = trainer.global_rank if self.per_rank else 0
        pl_module.register_buffer("steps_seen", torch.tensor(start, dtype=torch.long))
        pl_module.head = torch.nn.Linear(2, 2).requires_grad_(False)  # (trainable, it would be refused at setup)
        with torch.no_grad():
            pl_module.head.weight.copy_(torch.arange(4.0).reshape(2, 2))
            pl_module.head.bias.zero_()

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.at_start = _own_state(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        pl_module.steps_seen += 1
        with torch.no_grad():
            pl_module.head.weight.add_(0.5)

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.at_end = _own_state(pl_module)


def _own_state(module: L.LightningModule) -> dict[str, list]:
    return {name: value.tolist() for name, value in module.state_dict().items() if not name.startswith("chunks.")}


class UserSummary(ModelSummary):
    """A user's own summary callback (a subclass the strategy does not replace)."""


def _summary(trainer: L.Trainer) -> dict:
    """What the Trainer's model summary counted in this fit: its class, totals and rows."""
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    if isinstance(callback, UserSummary):  # what it printed is what counts
        return {"class": type(callback).__name__}
    summary = callback.summary
    rows = dict(zip(summary.layer_names, summary.param_nums, strict=True))
    return {"class": type(callback).__name__, "total": summary.total_parameters, "rows": rows,
            "trainable": summary.trainable_parameters, "size_mb": summary.model_size}  # fmt: skip


class SaveProbe(L.Callback):
    """What each save reused (host buffers, plans), and, before the first save, how the optimizer state a save
    writes compares with Megatron's own ``sharded_state_dict`` of it."""

    def __init__(self) -> None:
        self.saves: list[dict] = []
        self.optimizer_state_differs: dict[str, list[str]] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        writer = trainer.strategy.checkpoint_writer
        if trainer.global_step > 0:  # after the previous step's save
            params = list(pl_module.parameters())  # this rank's: at most its weights and their fp32 Adam state
            bound = sum(p.numel() * (p.element_size() + 12) for p in params)
            # (an async save's timeline gains its write and publish in place, when it is published)
            self.saves.append({"allocations": writer.buffers.allocations, "plans": writer.plans.made,
                               "host_bytes": writer.buffers.bytes, "host_bytes_bound": bound,
                               "shared": writer.buffers.shared is not None,
                               "timeline": writer.last_save, "prestaged": writer.prestaged})  # fmt: skip
            background = writer.background
            if background is not None and background.writer is not None:  # async: the writer process
                self.saves[-1] |= {"writers_started": background.writers_started, "pid": background.writer.process.pid,
                                   "segments_sent": background.writer.segments_sent}  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.optimizer_state_differs is None:
            trainer.strategy.sync_params()  # the weights of the step just taken (a deferred all-gather)
            self.optimizer_state_differs = optimizer_state_differences(pl_module, trainer.strategy.megatron_optimizer)

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.on_train_batch_start(trainer, pl_module, None, 0)
        self.saves[-1]["plan_reused"] = trainer.strategy.checkpoint_writer.plans.reused()


def optimizer_state_differences(module: L.LightningModule, optimizer: object) -> dict[str, list[str]]:
    """How the optimizer state :mod:`lightning_megatron.checkpointing.format.optimizer_state` builds compares with
    Megatron's ``optimizer.sharded_state_dict(..., fully_reshardable)``: ``structure`` (keys, replica ids, shapes:
    must agree), ``ours_wrong`` (our fp32 ``param`` entries against the model's weights, equal in fp32 training),
    ``values`` (moments and weights where Megatron's ``param`` entry is the weight), and ``megatron_misaligned``
    (Megatron's ``param`` entries that are not the weight: it slices its gathered state by offsets that count the
    padding at the end of earlier gradient buckets, which it leaves out of the gathered state)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from lightning_megatron.checkpointing import sharded
    from lightning_megatron.checkpointing.format.optimizer_state import optimizer_state
    from lightning_megatron.checkpointing.save.staging import HostBuffers

    def tensors(state: dict) -> dict:
        apply_factories(state)
        return {(i.key, tuple(i.global_offset)): i for i in nested_values(state) if isinstance(i, ShardedTensor)}

    chunks = list(module.chunks)
    weights = {key: item.data.detach() for key, item in tensors(sharded.sharded_state_dict(chunks)).items()}
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    buffers = HostBuffers()
    buffers.begin()
    ours = optimizer_state(optimizer, sharded.sharded_state_dict(chunks), metadata, buffers)
    theirs = optimizer.sharded_state_dict(sharded.sharded_state_dict(chunks), metadata=metadata)
    # A chained optimizer (MoE at EP > 1): one entry per member optimizer.
    our_parts, their_parts = ([o] if "param_state" in o else list(o.values()) for o in (ours, theirs))
    mine, megatron = {}, {}
    for part in our_parts:
        mine |= tensors(part["param_state"])
    for part in their_parts:
        megatron |= tensors(part["param_state"])
    found: dict[str, list[str]] = {"structure": [], "ours_wrong": [], "values": [], "megatron_misaligned": []}
    if set(mine) != set(megatron) or not mine:
        found["structure"].append(f"keys differ: {sorted(set(mine) ^ set(megatron))[:5]}")
    for a, b in zip(our_parts, their_parts, strict=True):
        if {k: v for k, v in a.items() if k != "param_state"} != {k: v for k, v in b.items() if k != "param_state"}:
            found["structure"].append("the optimizer's other entries differ")
    for name in sorted(set(mine) & set(megatron)):
        a, b = mine[name], megatron[name]
        if (a.replica_id, a.global_shape, a.local_shape) != (b.replica_id, b.global_shape, b.local_shape):
            found["structure"].append(f"{name}: {a.replica_id, a.global_shape} != {b.replica_id, b.global_shape}")
        weight_key = (name[0].replace("optimizer.state.param.", "", 1), name[1])
        if not name[0].startswith("optimizer.state.param."):
            continue
        if not torch.equal(a.data, weights[weight_key]):
            found["ours_wrong"].append(str(name))
        if not torch.equal(b.data.cpu(), weights[weight_key].cpu()):
            found["megatron_misaligned"].append(str(name))
            continue
        for key in [k for k in mine if k[1] == name[1] and k[0].endswith("." + weight_key[0])]:
            if not torch.equal(mine[key].data, megatron[key].data.cpu()):
                found["values"].append(str(key))
    return found


def main(args: dict) -> None:
    devices = args.get("devices", 1)
    tp, pp, vpp, cp = args.get("tp", 1), args.get("pp", 1), args.get("vpp"), args.get("cp", 1)
    dp = devices // (tp * pp * cp)
    accelerator = args.get("accelerator", "cpu")
    data = synthetic_tokens(64, 32, 256, seed=1)
    # Learnable structure (each sequence repeats one random half), so a falling loss is visible.
    data[:, 16:] = data[:, :16]
    val = synthetic_tokens(16, 32, 256, seed=2)
    if args.get("packed"):  # documents of 3-20 tokens packed into rows of 32 (attention and loss per document)
        data, val = packed_rows(data, 64, seed=3), packed_rows(val, 16, seed=4)
    if args.get("varlen"):  # samples of 4-32 tokens, right-padded to 32 (attention_mask)
        data, val = varlen_items(data, seed=5), varlen_items(val, seed=6)
    config = tiny_gpt(**args.get("model", {}))
    if args.get("module") == "value":
        module_cls: type = MegatronValueModule
    elif args.get("metrics"):  # torchmetrics metrics of the validation batches (and Logged's logs)
        module_cls = Metered
    else:
        module_cls = Logged if args.get("logs") else MegatronLMModule
    extra = {"prediction": args["prediction"]} if "prediction" in args else {}
    if "lora" in args:  # LoRAConfig fields
        extra["lora"] = args["lora"]
    model = module_cls(config, lr=args.get("lr", 3e-3), warmup_steps=1, decay_steps=16, **extra)
    if args.get("module") == "value":  # per-token value targets derived from the tokens
        data, val = value_items(data), value_items(val)
    shapes: list[list[int]] = []  # with a token budget: the training micro-batches' shapes
    if args.get("max_tokens"):
        forward_step = model.forward_step

        def recording(batch: dict, chunk: torch.nn.Module) -> tuple:
            if model.trainer.training:
                shapes.append(list(batch["input_ids"].shape))
            return forward_step(batch, chunk)

        model.forward_step = recording  # type: ignore[method-assign]
    recorder = Recorder(logs=bool(args.get("logs")))
    probe, own_state = SaveProbe(), OwnState(per_rank=args.get("own_state") == "per_rank")
    callbacks: list = [recorder] + ([probe] if args.get("save_probe") else [])
    callbacks += [own_state] if args.get("own_state") else []
    callbacks += [MegatronEMA(decay=args["ema"])] if args.get("ema") else []  # validation runs on the average
    if args.get("ckpt_dir"):
        callbacks.append(
            ModelCheckpoint(dirpath=args["ckpt_dir"], every_n_train_steps=args.get("ckpt_every", 2), save_top_k=-1)
        )
    printed, summary_log = Printed(), logging.getLogger("lightning.pytorch.callbacks.model_summary")
    if args.get("summary"):  # the strategy puts a whole-model summary in its place (callbacks.MegatronModelSummary)
        callbacks.append(UserSummary(max_depth=2) if args["summary"] == "subclass" else ModelSummary(max_depth=2))
        summary_log.addHandler(printed)  # its table (rank 0); removed after fit (run_here runs in the test process)
    ddp_config = None
    if args.get("overlap"):  # grad reduce and param gather overlapped with compute (distributed optimizer)
        from megatron.core.distributed import DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=4096
        )
    strategy = MegatronStrategy(
        ddp_config=ddp_config,
        tp=tp,
        pp=pp,
        vpp=vpp,
        cp=cp,
        ep=args.get("ep", 1),
        sequence_parallel=args.get("sp", False),
        micro_batch_size=args.get("micro_batch_size", 2),
        max_tokens_per_micro_batch=args.get("max_tokens"),
        checkpoint=CheckpointConfig(
            async_save=args.get("async_save", False),
            save_model_weights=not args.get("lean", False),  # lean: weights as main weights only
            read_threads=args.get("read_threads"),
        ),
    )
    if args.get("writer_dies_on_rank") == int(os.environ.get("LOCAL_RANK", 0)):  # at step=4.ckpt (SIGKILL)
        from lightning_megatron.checkpointing.save import write_process

        write_process.COMMAND = [sys.executable, str(Path(__file__).with_name("full_disk_writer.py")), "--die"]
    if args.get("checksums_fail_on_rank") == int(os.environ.get("LOCAL_RANK", 0)):  # step=4's, as on a full disk
        import errno

        from lightning_megatron.checkpointing.integrity import checksums

        exit_recorder = checksums.Recorder.__exit__

        def full_disk(self, *exc: object) -> None:  # noqa: ANN001
            exit_recorder(self, *exc)
            if "step=4" in self.directory.name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / "checksums.json"))

        checksums.Recorder.__exit__ = full_disk
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        precision=args.get("precision", "32-true"),
        strategy=strategy,
        max_steps=args.get("max_steps", 4),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.get("ckpt_dir")),
        callbacks=callbacks,
        num_sanity_val_steps=args.get("sanity", 0),
        limit_val_batches=args.get("limit_val_batches", 0),
        val_check_interval=args.get("val_check_interval"),
        check_val_every_n_epoch=None if args.get("val_check_interval") else 1,
    )
    batch = GLOBAL_BATCH // dp
    train_loader = DataLoader(data, batch_size=batch, drop_last=True)
    val_loader = DataLoader(val, batch_size=batch, drop_last=True)
    result: dict = {}
    mode = args.get("mode", "fit")
    if mode == "fit":
        try:
            trainer.fit(model, train_loader, val_loader, ckpt_path=args.get("resume"))
        except OSError as error:  # a failed save, expected by the test that asked for one
            if "writer_dies_on_rank" not in args and "checksums_fail_on_rank" not in args:
                raise
            result["error"] = str(error)
        except ValueError as error:  # a refused load or save, expected by the test that asked for one
            if not (args.get("expect_load_error") or args.get("own_state") == "per_rank"):
                raise
            result["error"] = str(error)
        finally:
            summary_log.removeHandler(printed)
        result["train"] = recorder.train
        result["val"] = recorder.val
        result["contract"] = recorder.contract
        result["shapes"] = shapes
        result["saves"], result["optimizer_state_differs"] = probe.saves, probe.optimizer_state_differs
        result["callback_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        result["last_load"] = strategy.checkpoint_writer.last_load
        result["row_sums"] = getattr(model, "row_sums", None)  # Metered: the CatMetric of the last validation
        result["own_state"] = {"at_start": own_state.at_start, "at_end": own_state.at_end}
        if args.get("summary"):
            result["summary"] = {**_summary(trainer), "printed": "\n".join(printed.lines)}
    elif mode in ("validate", "validate+predict"):
        out = trainer.validate(model, val_loader, ckpt_path=args.get("resume"))
        result["val"] = out[0]["val_loss"]
    if mode == "fit" and args.get("save_to"):  # a save after fit (synchronous), e.g. of what a resume loaded
        trainer.save_checkpoint(args["save_to"])
    if mode == "validate+predict" or (mode == "fit" and args.get("pred_out")):  # predict with the weights now held
        _save_predictions(trainer.predict(model, val_loader), args["pred_out"], trainer.global_rank)
    if mode == "routing" or (mode == "fit" and args.get("routing_out")):
        # MoE routing of the validation data: after loading the checkpoint, or with the weights fit just trained.
        recorded: dict = {}

        class RecordRouting(L.Callback):
            def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
                from megatron.core import parallel_state

                recorded["routing"] = pl_module.record_routing(val[:8])
                recorded["sizes"] = {  # the layout the routing was recorded at
                    "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                    "ep": parallel_state.get_expert_model_parallel_world_size(),
                }

        trainer.callbacks.append(RecordRouting())
        trainer.validate(model, val_loader, ckpt_path=args.get("resume") if mode == "routing" else None)
        out = args["pred_out"] if mode == "routing" else args["routing_out"]
        torch.save(recorded["routing"], f"{out}.rank{trainer.global_rank}.pt")
        result["routing_sizes"] = recorded["sizes"]
    if mode == "predict":
        _save_predictions(
            trainer.predict(model, val_loader, ckpt_path=args.get("resume")), args["pred_out"], trainer.global_rank
        )
    result["rank"] = trainer.global_rank
    dispatchers = {type(m.token_dispatcher).__name__ for m in model.chunks.modules() if hasattr(m, "token_dispatcher")}
    result["dispatchers"] = sorted(dispatchers)  # MoE: Megatron's token dispatcher classes of this rank's layers
    out_path = args["out"] if trainer.global_rank == 0 else args["out"] + f".rank{trainer.global_rank}"
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
