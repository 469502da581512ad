"""Callbacks for Megatron training: :class:`MegatronThroughput` (tokens/s, TFLOP/s per GPU, MFU),
and :class:`MegatronModelSummary` (Lightning's
model summary counting the whole model, which the strategy puts in place of Lightning's own).

Lightning's own ``ThroughputMonitor`` counts every rank as a data-parallel replica (wrong under TP/PP, where the
ranks of a model replica see the same samples), needs a ``flops_per_batch`` and synchronises the GPU each step.
This callback logs the same metric names (``train/samples_per_sec``, ``train/items_per_sec`` (tokens),
``train/device/items_per_sec``, ``train/device/flops_per_sec``, ``train/device/mfu``, ``train/batches_per_sec``)
computed from the parallel layout, with the standard count of model FLOPs per token
(:func:`~lightning_megatron.parallel.counts.model_flops_per_token`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, override

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

from lightning_megatron.compat import lightning_internals
from lightning_megatron.contract import MegatronRuntime
from lightning_megatron.parallel.counts import flops_parameters, model_flops_per_token, whole_model_counts
from lightning_megatron.schedule import as_batch, global_batch_size
from lightning_megatron.training.guards import check_callbacks
from lightning_megatron.weight_averaging import adopt as adopt_weight_averaging


class MegatronThroughput(L.Callback):
    """Log training throughput over a sliding window of steps (rank 0, to every logger).

    MFU = tokens/s x (6 N + 6 layers hidden seq) / (peak FLOP/s x GPUs), ``N`` the parameters without the input
    embedding table (a tied embedding counted once, as the output head; a frozen parameter, LoRA's base, counts 4
    FLOPs instead of 6: no weight gradient; an MoE model's routed experts count ``moe_router_topk / num_moe_experts``
    of their parameters, the active ones), ``6 layers hidden seq`` the attention scores and values for causal
    attention, the whole model counted across tensor, pipeline and expert parallelism. NeMo/Megatron-Bridge count
    the same; torchtitan also leaves the embedding out of ``6 N`` but counts the full attention matrix
    (``12 layers hidden seq``), which gives a higher MFU for the same run.

    Args:
        window: steps the rates are averaged over (timings are host clocks between step ends; each step's
            logging waits for its loss, so the host runs at most about one step ahead of the GPUs).
        peak_flops: dense peak FLOP/s of one GPU at the training dtype; default: this module's table for H200,
            H100 and A100 SXM parts (989 TFLOP/s bf16 on an H100/H200), else Lightning's (``get_available_flops``).
            Needed for ``mfu``.
        log_every_n_steps: how often to log; default the Trainer's ``log_every_n_steps``.
    """

    def __init__(self, window: int = 10, peak_flops: float | None = None, log_every_n_steps: int | None = None) -> None:
        if window < 2:
            raise ValueError(f"window={window} must be >= 2 (rates are differences between step ends)")
        self.window = window
        self.peak_flops = peak_flops
        self.log_every_n_steps = log_every_n_steps
        self._ends: deque[float] = deque(maxlen=window)
        self._tokens: deque[int] = deque(maxlen=window)
        self._samples: deque[int] = deque(maxlen=window)
        self._params = (0, 0)  # trainable, frozen (flops_parameters)
        self._shape = (0, 0)  # layers, hidden
        self.last: dict[str, float] = {}
        """The metrics logged last."""

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        config = getattr(pl_module, "config", None)
        if not (hasattr(config, "num_layers") and hasattr(config, "hidden_size")):
            raise ValueError(
                f"MegatronThroughput needs a module with a ModelConfig `config` (num_layers, hidden_size) for the "
                f"FLOPs per token; {type(pl_module).__name__} has none"
            )
        self._shape = (config.num_layers, config.hidden_size)
        self._params = flops_parameters(list(pl_module.chunks))  # collective: every rank
        strategy = trainer.strategy
        if self.peak_flops is None and strategy.root_device.type == "cuda" and isinstance(strategy, MegatronRuntime):
            self.peak_flops = peak_flops(torch.cuda.get_device_name(strategy.root_device), strategy.compute_dtype)
            if self.peak_flops is None:
                self.peak_flops = get_available_flops(strategy.root_device, strategy.compute_dtype)
        self._ends.clear()
        self._tokens.clear()
        self._samples.clear()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        samples, tokens = global_batch_size(batch)
        self._ends.append(time.perf_counter())
        self._samples.append(samples)
        self._tokens.append(tokens)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if len(self._ends) < 2 or trainer.global_step % every != 0 or trainer.global_rank != 0:
            return
        self.last = self.compute(trainer.world_size, seq_length=as_batch(batch)["input_ids"].shape[1])
        for logger in trainer.loggers:
            logger.log_metrics(self.last, step=trainer.global_step)

    def compute(self, gpus: int, seq_length: int) -> dict[str, float]:
        """The rates over the window; ``gpus``: all ranks of the job."""
        elapsed = self._ends[-1] - self._ends[0]
        steps = len(self._ends) - 1
        tokens = sum(list(self._tokens)[1:])  # the steps that ended inside the window
        samples = sum(list(self._samples)[1:])
        layers, hidden = self._shape
        trainable, frozen = self._params
        flops_per_token = model_flops_per_token(trainable, frozen, layers, hidden, seq_length)
        device_flops = tokens * flops_per_token / elapsed / gpus
        metrics = {
            "train/batches_per_sec": steps / elapsed,
            "train/samples_per_sec": samples / elapsed,
            "train/items_per_sec": tokens / elapsed,
            "train/device/items_per_sec": tokens / elapsed / gpus,
            "train/device/flops_per_sec": device_flops,
        }
        if self.peak_flops:
            metrics["train/device/mfu"] = device_flops / self.peak_flops
        return metrics


# Dense peak FLOP/s from NVIDIA's datasheets for the names CUDA reports for SXM parts, which Lightning's table does
# not match (an H200 reports "NVIDIA H200"). "tf32" is fp32 with TF32 matmuls allowed.
_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "h100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of an H200/H100/A100 SXM GPU at ``dtype``; ``None`` for other names (PCIe and NVL parts
    included: Lightning's own table knows those)."""
    name = device_name.lower()
    if "pcie" in name or "nvl" in name:
        return None
    chip = next((chip for chip in _PEAK_FLOPS if chip in name), None)
    if chip is None or dtype not in _DTYPE_NAMES:
        return None
    key = _DTYPE_NAMES[dtype]
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    return _PEAK_FLOPS[chip][key]


class WholeModelSummary(Summary):
    """Lightning's ``ModelSummary`` of a module trained by MegatronStrategy, counting the whole model rather than this
    rank's shard: every tensor-parallel shard, pipeline stage and expert-parallel rank, a tied embedding once.

    Collective: build it on every rank. The totals (and the model size derived from them) and the top-level rows
    are of the whole model; rows below the top level describe the modules of this rank's pipeline stage (Megatron
    numbers layers per stage), each whole (all its tensor- and expert-parallel shards).
    """

    def __init__(self, model: L.LightningModule, max_depth: int = 1) -> None:
        super().__init__(model, max_depth)
        modules = dict(self.named_modules)
        params = list(model.parameters())
        sets = [list(modules[name].parameters()) for name in self.layer_names]
        sets += [params, [p for p in params if p.requires_grad]]
        every_stage = ["." not in name for name in self.layer_names] + [True, True]
        *self.whole_rows, self.whole_total, self.whole_trainable = whole_model_counts(sets, every_stage)

    @property
    @override
    def param_nums(self) -> list[int]:
        return list(self.whole_rows)

    @property
    @override
    def total_parameters(self) -> int:
        return self.whole_total

    @property
    @override
    def trainable_parameters(self) -> int:
        return self.whole_trainable


class MegatronModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` callback printing a :class:`WholeModelSummary` (its settings, its table).

    MegatronStrategy puts it in place of the Trainer's ``ModelSummary`` (the default one included) at ``connect``:
    Lightning's counts only the parameters of rank 0's shard. :attr:`summary` is the last fit's summary.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.max_depth = max_depth
        self.summarize_kwargs = summarize_kwargs
        self.summary: WholeModelSummary | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.max_depth:
            return
        self.summary = summary = WholeModelSummary(pl_module, max_depth=self.max_depth)  # collective: every rank
        if trainer.is_global_zero:
            self.summarize(
                lightning_internals.summary_table(summary),  # Lightning's own columns (as its on_fit_start has them)
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                total_flops=summary.total_flops,
                **self.summarize_kwargs,
            )


class MegatronRichModelSummary(MegatronModelSummary, RichModelSummary):
    """:class:`MegatronModelSummary` printed as Lightning's ``RichModelSummary`` prints."""


_WHOLE_MODEL: dict[type, type[MegatronModelSummary]] = {
    ModelSummary: MegatronModelSummary,
    RichModelSummary: MegatronRichModelSummary,
}


def adapt_callbacks(trainer: L.Trainer) -> None:
    """When a run starts, before any process group exists (the module's ``configure_callbacks`` attached): refuse
    the Lightning callbacks MegatronStrategy cannot serve (:func:`~lightning_megatron.training.guards.check_callbacks`),
    put whole-model summaries (:func:`count_whole_model`) and sharded weight averaging
    (:func:`~lightning_megatron.weight_averaging.adopt`) in place of Lightning's."""
    check_callbacks(trainer.callbacks)
    count_whole_model(trainer)
    adopt_weight_averaging(trainer)


def count_whole_model(trainer: L.Trainer) -> None:
    """Replace the Trainer's ``ModelSummary``/``RichModelSummary`` callbacks (the default one included) by
    :class:`MegatronModelSummary`/:class:`MegatronRichModelSummary` with the same settings; a user's subclass stays,
    made to count the whole model too (:func:`whole_model_summary`). Called by MegatronStrategy when a run starts."""
    for index, callback in enumerate(trainer.callbacks):
        whole = _WHOLE_MODEL.get(type(callback))
        if whole is not None:
            # Lightning keeps a summary callback's settings in private attributes (docs/lightning.md, "internals").
            max_depth, summarize_kwargs = lightning_internals.summary_settings(callback)
            trainer.callbacks[index] = whole(max_depth, **summarize_kwargs)
        elif isinstance(callback, ModelSummary) and not lightning_internals.builds_summary_itself(callback):
            # A user's subclass (without a summary builder of its own): this instance builds the whole model's
            # summary; under another strategy it returns Lightning's summary again, so it may stay.
            lightning_internals.build_summary_with(callback, whole_model_summary)


def whole_model_summary(callback: ModelSummary, trainer: L.Trainer, pl_module: L.LightningModule) -> Summary:
    """What a user's ``ModelSummary`` subclass summarises under MegatronStrategy: :class:`WholeModelSummary`."""
    if isinstance(trainer.strategy, MegatronRuntime):
        return WholeModelSummary(pl_module, max_depth=lightning_internals.summary_settings(callback)[0])
    return lightning_internals.lightning_summary(callback, trainer, pl_module)
