"""HF import/export jobs at several layouts in one set of processes, launched by tests/test_hf_layouts.py and by
tests/conftest.py's ``moe_layouts`` (the MoE jobs of tests/hf_moe_models.py).

``python tests/hf_worker.py '{"devices": 2, "tokens": "t.pt", "out": "r.json", "jobs": [...]}'``; each job is
``{"model": DIR, "tp": 2, "pp": 1, "vpp": null, "ep": 1, "save": DIR?, "train_steps": 0, "logprobs": false,
"grad_norms": false}`` (optional: ``"overrides"``, ModelConfig fields; ``"optim"``, the module's optimizer arguments;
``"sampler": false``, training rows in order without Lightning's distributed sampler; ``"reference": DIR``, the float
checkpoint the untrained export is compared with, by default the model).
Per job every rank runs ``predict`` (with ``logprobs``: also the log-probs of the tokens) and ``validate`` on the
tokens (after ``train_steps`` steps of ``fit`` when > 0, saving with
``save_hf`` at the end of training), exports the HF weights during validation and compares them with the source
files, and counts the tensor elements it read from the safetensors files. Lightning's launcher re-runs this
command once per extra process; every rank writes ``out.rank{N}.json`` and its logits ``out.job{i}.rank{N}.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from safe_open_reads import RecordingSafeOpen  # tests/ is this script's directory
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy
from lightning_megatron.gpt.hf import load as hf_load

hf_load.safe_open = RecordingSafeOpen  # type: ignore[assignment,misc]


class ExportCheck(L.Callback):
    """During validation: export the HF weights and compare them with the untrained source files."""

    def __init__(self, source: Path | None) -> None:
        self.source = load_file(source / "model.safetensors") if source is not None else None
        self.shapes: dict[str, list[int]] = {}
        self.max_diff = 0.0

    def on_validation_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        for name, tensor in module.export_hf_weights():
            self.shapes[name] = list(tensor.shape)
            if self.source is not None and name in self.source:
                self.max_diff = max(self.max_diff, float((tensor - self.source[name]).abs().max()))


class SaveAtEnd(L.Callback):
    """save_hf (merged weights with LoRA) and, with LoRA unless ``peft=False``, the PEFT adapter; buckets checked
    against the per-tensor export (one gather / broadcast per bucket)."""

    def __init__(self, path: str, peft: bool = True) -> None:
        self.path, self.peft = path, peft
        self.buckets: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        module.save_hf(self.path, max_shard_size=64 * 1024)  # small shards: the index path is exercised too
        if module.lora is not None and self.peft:
            module.save_hf(f"{self.path}-adapter", adapter=True)
        tensors = dict(module.export_hf_weights())
        buckets = list(module.export_hf_weights(bucket_bytes=100_000))
        flat = [pair for bucket in buckets for pair in bucket]
        self.buckets = {
            "count": len(buckets), "tensors": len(tensors),
            "equal": [n for n, _ in flat] == list(tensors) and all(torch.equal(t, tensors[n]) for n, t in flat),
            "bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets if len(b) > 1],
        }  # fmt: skip


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.values.append(float(outputs["loss"]))


class GradNorms(L.Callback):
    """Every parameter's gradient norm at each step on this rank (``MegatronStrategy.grad_norms()``: a split
    parameter's over its shards, a replicated one's from this rank's copy)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.steps.append({name: float(norm) for name, norm in trainer.strategy.grad_norms().items()})


def _trainer(devices: int, job: dict, **kwargs: Any) -> L.Trainer:
    sizes = {"tp": job.get("tp", 1), "pp": job.get("pp", 1), "vpp": job.get("vpp"), "cp": job.get("cp", 1),
             "ep": job.get("ep", 1)}  # fmt: skip
    strategy = MegatronStrategy(**sizes, sequence_parallel=job.get("sp", False), micro_batch_size=2)
    defaults = {"enable_checkpointing": False}
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **{**defaults, **kwargs},
    )  # fmt: skip


def run_job(devices: int, job: dict, tokens: torch.Tensor, packed: list) -> tuple[dict, torch.Tensor]:
    RecordingSafeOpen.reads = []
    overrides = {"kernels": "torch"} if job.get("packed") else {}  # packed rows need SDPAttention on CPU
    overrides = {**overrides, **job.get("overrides", {})} or None  # ModelConfig fields a job sets
    lora = job.get("lora")  # LoRAConfig fields: adapters trained on the frozen HF weights
    settings = {"lr": 1e-2, "warmup_steps": 0, **job.get("optim", {})}  # the module's optimizer arguments
    module = MegatronLMModule.from_hf(
        job["model"], seq_length=tokens.shape[1], config_overrides=overrides, lora=lora, adapter=job.get("adapter"),
        **settings,
    )  # fmt: skip
    result: dict[str, Any] = {}
    loader = DataLoader(tokens, batch_size=tokens.shape[0])
    trained = job.get("train_steps", 0) > 0
    if trained:
        # The same samples on every rank (tensor-parallel peers must see the same batch).
        generator = torch.Generator().manual_seed(0)
        samples = torch.randint(0, 128, (4 * job["train_steps"], tokens.shape[1]), generator=generator)
        data = DataLoader(samples, batch_size=job.get("batch_size", 4))  # per data-parallel rank
        losses = Losses()
        save = SaveAtEnd(job["save"], peft=job.get("peft", True))
        norms = GradNorms()
        callbacks: list[L.Callback] = [losses, save, *([norms] if job.get("grad_norms") else [])]
        if job.get("ckpt"):  # checkpoints every 2 steps (with LoRA: the adapters and their optimizer state)
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(dirpath=job["ckpt"], every_n_train_steps=2, save_top_k=-1))
        trainer = _trainer(
            devices, job, max_steps=job["train_steps"], callbacks=callbacks, enable_checkpointing=bool(job.get("ckpt")),
            use_distributed_sampler=job.get("sampler", True),  # False: the rows in order (DP=1 only)
        )  # fmt: skip
        trainer.fit(module, data, ckpt_path=job.get("resume"))
        result["train_losses"], result["buckets"], result["grad_norms"] = losses.values, save.buckets, norms.steps
        result["trainable"] = sorted({n.split(".")[-2] for n, p in module.named_parameters() if p.requires_grad})
    check = ExportCheck(None if trained else Path(job.get("reference", job["model"])))
    callbacks = [] if module.lora else [check]  # adapters: the export is not the source's
    result["val_loss"] = _trainer(devices, job, callbacks=callbacks).validate(module, loader)[0]["val_loss"]
    result["elements_read"] = RecordingSafeOpen.elements()  # the model was built by the first Trainer call
    result["export_shapes"], result["export_max_diff"] = check.shapes, check.max_diff
    logits = torch.cat(_trainer(devices, job).predict(module, loader))
    if job.get("logprobs"):
        module.prediction = "logprobs"
        result["logprobs"] = torch.cat([p["logprobs"] for p in _trainer(devices, job).predict(module, loader)]).tolist()
        module.prediction = "logits"
    if job.get("packed"):  # packed rows of documents (tests/hf_moe_models.py: PACKED_LENGTHS)
        rows = DataLoader(packed, batch_size=len(packed))
        result["packed_val_loss"] = _trainer(devices, job).validate(module, rows)[0]["val_loss"]
        module.prediction = "logprobs"
        result["packed_logprobs"] = torch.cat([p["logprobs"] for p in _trainer(devices, job).predict(module, rows)])
        result["packed_logprobs"] = result["packed_logprobs"].tolist()
    return result, logits


def main(args: dict) -> None:
    tokens, packed = torch.load(args["tokens"]), torch.load(args["packed"])
    results, rank = [], 0
    for i, job in enumerate(args["jobs"]):
        result, logits = run_job(args["devices"], job, tokens, packed)
        rank = torch.distributed.get_rank()
        torch.save(logits, f"{args['out']}.job{i}.rank{rank}.pt")
        results.append(result)
    Path(f"{args['out']}.rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
