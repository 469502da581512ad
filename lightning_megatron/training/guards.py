"""Cheap guards against bad data, non-finite training steps, and Trainer settings or Lightning callbacks the strategy
cannot honour (:func:`check_trainer`, at ``connect``).

Batch checks run on the host, in ``on_before_batch_transfer`` (before the batch moves to the accelerator), so they
add no device synchronisation; tensors that already live on an accelerator are only checked for dtype and shape.
Non-finite steps: under the default ``nonfinite="error"`` the gradient norm Megatron's optimizer computes anyway is
checked without a synchronisation: its host copy is read at the next optimizer step, or before a checkpoint is
written or the fit ends if that comes first (:class:`StepGuard`); ``"skip"`` must decide before the update, so it
reads the reduced loss and scans the contiguous gradient buffers once, at the cost of one GPU synchronisation per
step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BatchSizeFinder,
    LearningRateFinder,
    ModelPruning,
    ThroughputMonitor,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_megatron.compat import lightning_internals
from lightning_megatron.contract import IGNORE_INDEX, StepStats
from lightning_megatron.training.host import HostScalar

NonFinite = Literal["error", "skip"]
NONFINITE_POLICIES: tuple[str, ...] = ("error", "skip")
_MASKS = ("labels", "attention_mask", "loss_mask", "position_ids")


def check_policy(nonfinite: str) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite={nonfinite!r} is not a policy for non-finite losses/gradients; use 'error' (stop, naming "
            "the step) or 'skip' (leave the weights unchanged for that step, count it in skipped_steps)"
        )


def check_token_batch(batch: Any, vocab_size: int, seq_length: int) -> None:
    """Raise ``TypeError``/``ValueError`` for token batches the model cannot train on, naming the field and value."""
    if isinstance(batch, Tensor):
        batch = {"input_ids": batch}
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        return  # schedule.as_batch reports malformed batches with the full picture
    ids = batch["input_ids"]
    _check_ids("input_ids", ids, vocab_size)
    if ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; batches of token ids must be [batch, sequence]")
    if ids.shape[1] > seq_length:
        raise ValueError(
            f"input_ids has sequences of length {ids.shape[1]}, longer than ModelConfig(seq_length={seq_length}); "
            f"truncate or pack the data to at most {seq_length} tokens, or build the model with a larger seq_length"
        )
    for name in _MASKS:
        if name in batch and tuple(batch[name].shape) != tuple(ids.shape):
            raise ValueError(f"{name} has shape {tuple(batch[name].shape)}, but input_ids has {tuple(ids.shape)}")
    if "labels" in batch:
        _check_ids("labels", batch["labels"], vocab_size, ignore=IGNORE_INDEX)
    if "position_ids" in batch:
        check_positions(batch["position_ids"])


def check_graphable_batch(batch: Any, seq_length: int) -> None:
    """Raise ``ValueError`` for a batch that CUDA graphs captured at ``seq_length`` cannot replay
    (``ModelConfig.cuda_graphs``): shorter rows, or packed rows (their document layout changes per batch)."""
    ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
    if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[1] != seq_length:
        raise ValueError(
            f"input_ids has sequences of length {ids.shape[1]}, and ModelConfig(cuda_graphs=True) replays graphs "
            f"captured for rows of seq_length={seq_length} tokens; pad every batch to {seq_length} (labels -100 "
            "where padded), or use cuda_graphs=False for variable lengths"
        )
    if isinstance(batch, Mapping) and "position_ids" in batch:
        raise ValueError(
            "the batch has packed position_ids, whose document layout changes from batch to batch, and "
            "ModelConfig(cuda_graphs=True) replays fixed graphs; use cuda_graphs=False with packed sequences"
        )


def check_positions(positions: Any) -> None:
    """Raise ``ValueError`` unless ``position_ids`` [B, S] follow the packed convention: each row starts a document
    at 0, and inside a document positions count up by one (a new document starts where they go back to 0)."""
    if not isinstance(positions, Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        what = f"a tensor of dtype {positions.dtype}" if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(f"position_ids is {what}; positions must be an integer tensor (torch.long)")
    if positions.device.type != "cpu" or positions.numel() == 0:
        return  # checking here would synchronise with the device every step
    if bool((positions[:, 0] != 0).any()):
        row = int((positions[:, 0] != 0).nonzero()[0])
        raise ValueError(
            f"position_ids of row {row} start at {int(positions[row, 0])}: in a packed batch every row starts a "
            "document at position 0 (Hugging Face's DataCollatorWithFlattening convention)"
        )
    step = positions[:, 1:] - positions[:, :-1]
    bad = (step != 1) & (positions[:, 1:] != 0)  # anything but +1 or a restart at 0 is no packed layout
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"position_ids of row {row} go from {int(positions[row, col])} to {int(positions[row, col + 1])} at "
            f"index {col + 1}: positions must restart at 0 where a document starts and count up by one inside it "
            "(left-padded generation batches: drop position_ids, the model counts positions itself)"
        )


def _check_ids(name: str, ids: Any, vocab_size: int, ignore: int | None = None) -> None:
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        what = f"a tensor of dtype {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"{name} is {what}; token ids must be an integer tensor (torch.long)")
    if ids.device.type != "cpu" or ids.numel() == 0:
        return  # a range check here would synchronise with the device every step
    valid = (ids >= 0) & (ids < vocab_size)
    if ignore is not None:
        valid |= ids == ignore
    if not bool(valid.all()):
        bad = ids[~valid]
        allowed = f"[0, {vocab_size})" + (f" or {ignore} (ignored)" if ignore is not None else "")
        raise ValueError(
            f"{name} holds {bad.numel()} value(s) outside {allowed}, e.g. {int(bad[0])} (ModelConfig(vocab_size="
            f"{vocab_size})); fix the tokenizer/data or build the model with a vocab_size above {int(bad.max())}"
        )


def check_dataloader(dataloader: object, name: str) -> None:
    """An empty DataLoader would make Lightning skip the stage silently; a long run must fail instead."""
    try:
        length = len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        return  # iterable-style: its length is unknown until it is exhausted
    if length == 0:
        batch_size = getattr(dataloader, "batch_size", None)
        dataset = getattr(dataloader, "dataset", None)
        size = len(dataset) if hasattr(dataset, "__len__") else "?"  # type: ignore[arg-type]
        raise ValueError(
            f"the {name} DataLoader has no batches on this rank (dataset of {size} samples, batch_size={batch_size}, "
            f"drop_last={getattr(dataloader, 'drop_last', None)}); provide more samples than batch_size x the "
            "data-parallel size or a smaller batch_size"
        )


def grads_finite(chunks: Sequence[nn.Module], device: torch.device) -> bool:
    """Whether every gradient of every rank is finite; identical on all ranks (one all-reduce of a flag).

    Reads Megatron DDP's contiguous gradient buffers (reduced or reduce-scattered already: a non-finite local
    gradient stays visible in its own rank's buffer either way).
    """
    bad = torch.zeros((), dtype=torch.float32, device=device)
    for chunk in chunks:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            if buffer.grad_data is not None:  # None while offloaded
                bad = bad + (~torch.isfinite(buffer.grad_data)).any().float()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return bool(bad == 0)


def check_grad_norm(grad_norm: float | None, step: int) -> None:
    """``nonfinite="error"``: raise ``FloatingPointError`` naming the step if Megatron's gradient norm is not finite
    (``None``: a step Megatron's fp16 loss scaler skipped itself)."""
    if grad_norm is None or math.isfinite(grad_norm):
        return
    raise FloatingPointError(
        f"non-finite gradient norm ({grad_norm}) at optimizer step {step} (trainer.global_step {step} during that "
        "step); the run stops before any checkpoint or export of this step is written. Look for bad data or a too "
        "high learning rate there and resume from the last checkpoint, or pass MegatronStrategy(nonfinite='skip') "
        "to skip such steps (weights unchanged) and count them in skipped_steps"
    )


class StepGuard:
    """The non-finite policy's bookkeeping after each optimizer step: skipped steps, and under ``"error"`` the
    gradient-norm check.

    The norm is a device tensor (Megatron's no-synchronisation clipping, ``patches.ForeachClipGrads``). Reading it in
    its own step would drain the GPU's queue before the next step is queued; its host copy is read instead at the
    next step's :meth:`record` (long finished by then), or in :meth:`check_pending` before anything reads the
    weights (the strategy's ``sync_params``: checkpoints, HF and weight-sync exports, the fit's end). So a
    non-finite step never reaches a checkpoint or an export, but the callbacks of that one step run before the
    error.
    """

    def __init__(self, policy: NonFinite) -> None:
        check_policy(policy)
        self.policy = policy
        self.skipped_steps = 0
        self.last_step: StepStats | None = None
        """LR and gradient norm of the last optimizer step (``None`` before the first, and after :meth:`forget`)."""
        self._warn_at = 1  # skipped-step counts that warn: 1, 2, 4, 8, ... (the metric has every step)
        self._pending: tuple[HostScalar, int] | None = None  # (the norm's host copy, its optimizer step)
        # A non-finite step found: every later check raises again (an on-exception save must not write it either).
        self._failed: tuple[float, int] | None = None

    def record(self, stats: StepStats, step: int) -> None:
        """After optimizer step ``step``: keep its stats, count a skipped step; under ``"error"`` check the previous
        step's norm and queue this one's host copy."""
        self.last_step = stats
        if stats.skipped:
            self._skipped(step)
        if self.policy != "error":
            return
        self.check_pending()
        if isinstance(stats.grad_norm, Tensor):
            self._pending = (HostScalar(stats.grad_norm), step)
        else:
            check_grad_norm(stats.grad_norm, step)

    def _skipped(self, step: int) -> None:
        self.skipped_steps += 1
        if self.skipped_steps < self._warn_at:
            return
        self._warn_at *= 2
        rank_zero_warn(
            f"optimizer step {step} was skipped: non-finite loss or gradients (with fp16, a loss-scale overflow); "
            f"{self.skipped_steps} step(s) skipped so far. Weights, optimizer state and LR schedule stay "
            f"as they were for a skipped step; the metric skipped_steps counts them, the next warning comes at "
            f"{self._warn_at} skipped steps"
        )

    def check_pending(self) -> None:
        """Raise ``FloatingPointError`` if the last recorded step's norm is not finite (waits for its copy only),
        and at every call after that until :meth:`forget`."""
        if self._pending is not None:
            (norm, step), self._pending = self._pending, None
            value = float(norm.get())
            if not math.isfinite(value):
                self._failed = (value, step)
        if self._failed is not None:
            check_grad_norm(*self._failed)

    def warn_if_failed(self, exception: BaseException) -> None:
        """While ``exception`` stops the run: warn if an unchecked norm whose copy has already arrived (nothing
        waits) is not finite -- e.g. the step after a non-finite one failed first, on its NaN weights."""
        if self._pending is None or not self._pending[0].ready():
            return
        try:
            self.check_pending()
        except FloatingPointError as error:
            rank_zero_warn(f"{error} (found while handling {type(exception).__name__}: {exception})")

    def forget(self) -> None:
        """Drop an unchecked norm, a found failure and the last step's stats (the run failed or ended)."""
        self._pending = self._failed = self.last_step = None


def step_is_finite(loss: Tensor | None, chunks: Sequence[nn.Module], check_grads: bool = True) -> bool:
    """``nonfinite="skip"``, before the optimizer step: ``True`` to step, ``False`` to skip it.

    The loss is identical on every rank (reduced by the strategy) and the gradient flag is all-reduced, so every
    rank takes the same decision. (``"error"`` checks Megatron's gradient norm after the step: :func:`check_grad_norm`.)
    """
    device = loss.device if loss is not None else torch.device("cpu")
    loss_ok = loss is None or bool(torch.isfinite(loss).all())
    # With fp16, gradients hold the loss-scaled values: an overflow there is the loss scaler's business (Megatron's
    # optimizer skips the step and lowers the scale), so only the loss is checked.
    grads_ok = grads_finite(chunks, device) if check_grads else True
    return loss_ok and grads_ok


def check_trainer(trainer: Any) -> None:
    """Raise ``ValueError``/``TypeError`` at ``connect``, before any process group or model exists, for Trainer
    settings and callbacks whose documented effect MegatronStrategy cannot give (docs/lightning.md, "Lightning's
    callbacks and Trainer arguments"); and run Lightning's validate/test/predict loops under ``torch.no_grad``."""
    if trainer.gradient_clip_val is not None:
        raise ValueError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) is not supported by MegatronStrategy: Megatron's "
            "optimizer clips gradients; set clip_grad in the OptimizerConfig your module's configure_optimizers "
            "returns (MegatronLMModule(clip_grad=...))"
        )
    strategy = trainer.strategy
    # Lightning converts BatchNorm layers in DDPStrategy.setup, which MegatronStrategy replaces; it keeps the
    # request only in a private attribute.
    if lightning_internals.syncs_batchnorm(strategy):
        raise ValueError(
            "Trainer(sync_batchnorm=True) is not supported by MegatronStrategy: Lightning converts BatchNorm layers in "
            "DDP's setup, which this strategy replaces, and would sync them over every rank rather than the "
            "data-parallel group; build torch.nn.SyncBatchNorm(process_group=megatron.core.parallel_state."
            "get_data_parallel_group()) into your chunks (build_chunk) instead"
        )
    if type(strategy.checkpoint_io) is not TorchCheckpointIO:
        raise ValueError(
            f"Trainer(plugins=[{type(strategy.checkpoint_io).__name__}(...)]) is not supported by MegatronStrategy: "
            "it saves and loads sharded checkpoints through Megatron's dist_checkpointing and never calls a "
            "CheckpointIO plugin; drop the plugin (for saves in the background: MegatronStrategy(async_save=True))"
        )
    check_callbacks(trainer.callbacks)  # again when the run starts, with the module's configure_callbacks
    evaluate_under_no_grad(trainer)


def evaluate_under_no_grad(trainer: Any) -> None:
    """Run ``trainer.validate/test/predict`` under ``torch.no_grad`` instead of ``torch.inference_mode`` (as Lightning
    itself does under FSDP, XLA and gloo): tensors made in inference mode and kept -- the attention's RoPE tables,
    the perplexity metric's states -- would make the next ``fit`` of the module fail ("Inference tensors cannot be
    saved for backward"). Results are the same; validation inside ``fit`` runs under ``no_grad`` already."""
    lightning_internals.evaluate_without_inference_mode(trainer)


# Lightning callbacks whose documented effect MegatronStrategy cannot give: why, and what to use instead.
_REFUSED_CALLBACKS: tuple[tuple[type, str], ...] = (
    (
        ThroughputMonitor,
        "it counts every rank as a data-parallel replica (the ranks of a tensor/pipeline/context-parallel model "
        "replica share their samples), needs the module's flops_per_batch and synchronises the GPU every step; use "
        "lightning_megatron.MegatronThroughput, which logs the same names (train/samples_per_sec, "
        "train/device/flops_per_sec, train/device/mfu, ...) computed from the parallel layout",
    ),
    (
        ModelPruning,
        "torch's pruning re-registers each weight as weight_orig plus a mask, which Megatron's gradient buffers, "
        "distributed optimizer and sharded checkpoints do not know (its default also finds no torch.nn.Linear in "
        "Megatron's parallel linears, and a global threshold would be per tensor-parallel shard); prune the "
        "trained model after export (save_hf) instead",
    ),
    (
        BaseFinetuning,
        "it freezes parameters in setup, before configure_model builds the chunks, and Megatron's optimizer and "
        "gradient buffers are built once from the parameters that require grad: a parameter frozen later is still "
        "updated (weight decay, Adam momentum), and one unfrozen later cannot join (the optimizer's param groups "
        "hold fp32 main-weight shards); freeze before the fit instead -- requires_grad=False when the chunks are "
        "built (build_chunk, or configure_model after super().configure_model()), or LoRA adapters "
        "(MegatronLMModule(..., lora=...)) -- and run one fit per stage, each starting from the last stage's "
        "weights (Module.load_from_checkpoint(path))",
    ),
    (
        BatchSizeFinder,
        "Lightning's batch-size finder (also what Tuner.scale_batch_size adds) refuses distributed strategies, and "
        "this strategy is one (it would fail after the process groups exist); choose the DataLoader's batch_size "
        "yourself: it is the per-data-parallel-rank batch of one optimizer step, run in micro-batches of "
        "MegatronStrategy(micro_batch_size=...), which sets the activation memory",
    ),
)


def check_callbacks(callbacks: Iterable[object]) -> None:
    """Raise ``ValueError``/``TypeError`` naming a Lightning callback (a subclass included) whose documented effect
    MegatronStrategy cannot give, and what to use instead."""
    for callback in callbacks:
        name = type(callback).__name__
        for refused, why in _REFUSED_CALLBACKS:
            if isinstance(callback, refused):
                kind = "" if type(callback) is refused else f" (a {refused.__name__})"
                raise ValueError(f"{name}{kind} is not supported by MegatronStrategy: {why}")
        # Tuner.lr_find adds its own LearningRateFinder, marked to end the fit after the search (private flag).
        if isinstance(callback, LearningRateFinder) and not lightning_internals.lr_finder_ends_the_fit(callback):
            raise ValueError(
                f"{name} inside trainer.fit is not supported by MegatronStrategy: after its search the model is put "
                "back but Megatron's LR schedule keeps the search's step count, and a suggestion cannot reach the "
                "schedule built at setup, so the rest of the fit would not train at the module's rate or the "
                "suggested one; run Tuner(trainer).lr_find(model, ...) before trainer.fit (its suggestion becomes "
                "the module's hparams.lr, which the fit's optimizer uses)"
            )
        own = getattr(callback, "__dict__", {})
        hooks = [hook for hook in ("on_before_backward", "on_after_backward") if hook in own]
        if hooks:  # LambdaCallback sets hooks on the instance (check_overrides sees those of a callback's class)
            raise TypeError(
                f"{name}({'=..., '.join(hooks)}=...): MegatronStrategy never calls {' or '.join(hooks)} (Megatron's "
                "schedule runs the backward pass per micro-batch inside the training step); read gradients in "
                "on_before_optimizer_step instead (trainer.strategy.grad_norms())"
            )


def check_module(module: nn.Module, fitting: bool) -> None:
    """When the strategy sets a run up: the chunks' loss convention (:func:`check_per_token_loss`) and, for a fit, no
    trainable parameter outside the chunks -- Megatron's optimizer holds the chunks' parameters only, so one beside
    them (a head built on the LightningModule) would never change, without a word."""
    chunks = module.chunks
    check_per_token_loss(chunks)  # type: ignore[arg-type]
    inside = {id(p) for p in chunks.parameters()}  # type: ignore[union-attr]
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if fitting and outside:
        raise ValueError(
            f"{type(module).__name__} has trainable parameters outside its Megatron chunks: {', '.join(outside[:5])}. "
            "MegatronStrategy's optimizer trains the chunks' parameters only (Megatron's DDP, gradient buffers and "
            "optimizer are built from them), so these would never change: build them into the chunks (build_chunk), "
            "or freeze them (requires_grad=False: saved and restored in checkpoints as they are)"
        )


def check_per_token_loss(chunks: Sequence[nn.Module]) -> None:
    """Every chunk's config must say ``calculate_per_token_loss=True`` (as ``ChunkSpec.parallel`` does): loss
    functions return sums and Megatron divides the gradients by the global batch's token count."""
    for index, chunk in enumerate(chunks):
        config = getattr(chunk, "config", None)
        if getattr(config, "calculate_per_token_loss", None) is not True:
            raise ValueError(
                f"model chunk {index} ({type(chunk).__name__}) has config.calculate_per_token_loss="
                f"{getattr(config, 'calculate_per_token_loss', 'missing')}; MegatronStrategy's loss functions return "
                "sums that Megatron divides by the global batch's token count, so it must be True: build the chunk's "
                "TransformerConfig with **spec.parallel (which sets it) and do not override it"
            )
