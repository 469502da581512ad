"""The base LightningModule contract: what any module made of Megatron-Core parts implements to train under
:class:`~lightning_megatron.MegatronStrategy`.

A subclass implements three things:

* :meth:`MegatronLightningModule.build_chunk` -- build the model chunk for one pipeline stage / VPP chunk, given a
  :class:`ChunkSpec` (where the chunk sits and the parallel config fields the strategy decided);
* :meth:`MegatronLightningModule.forward_step` -- run one micro-batch through one chunk and return
  ``(output, loss_fn)`` with ``loss_fn(output) -> (loss_sum, num_tokens, logs)``, Megatron's forward-step
  contract; ``loss_fn`` is called on the last pipeline stage only;
* :meth:`MegatronLightningModule.configure_optimizers` -- return an :class:`OptimizerSpec` (Megatron's
  ``OptimizerConfig`` plus the LR schedule).

The strategy owns the step: ``strategy.training_step -> schedule.train -> module.forward_step`` (Megatron's schedule
in between). Lightning's ``training_step``/``validation_step``/``predict_step`` of these modules are therefore never
called.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, override

import lightning as L
from torch import Tensor, nn

from lightning_megatron.compat import lightning_internals
from lightning_megatron.contract import Batch, ChunkSpec, LossFn, MegatronRuntime, ModelHooks, OptimizerSpec
from lightning_megatron.modules.metrics import TokenPerplexity

if TYPE_CHECKING:
    from lightning_megatron.parallel.sizes import ParallelSizes
    from lightning_megatron.training.averaging import WeightAverage


class MegatronLightningModule(L.LightningModule):
    """Base class for LightningModules trained by :class:`~lightning_megatron.MegatronStrategy`.

    After ``configure_model`` the module holds this rank's model chunks in :attr:`chunks` (one per virtual
    pipeline stage). The strategy logs each step through :meth:`log_train_step` (``train_loss``, ``lr``,
    ``grad_norm``, ``skipped_steps``, ``tokens_per_s`` and the loss_fn logs, right after the optimizer step) and
    :meth:`log_eval_step` (``val_loss``/``test_loss``, ``val_ppl``/``test_ppl``, loss_fn logs).
    """

    chunks: nn.ModuleList
    weights_checkpoint: str | None = None
    """A MegatronStrategy checkpoint whose model weights are loaded into the chunks when they are built (once); set
    by :meth:`load_from_checkpoint`."""
    base_checkpoint: str | None = None
    """A MegatronStrategy checkpoint whose frozen weights (all but the trainable parameters, e.g. LoRA adapters) are
    loaded into the chunks when they are built, before :attr:`weights_checkpoint`."""
    weights_strict: bool = True
    """Whether :attr:`weights_checkpoint` must match the chunks exactly (``load_from_checkpoint(strict=...)``)."""
    weight_average: WeightAverage | None = None
    """The average of the chunks' weights a weight-averaging callback keeps
    (:class:`~lightning_megatron.MegatronWeightAveraging`); checkpoints save it, and a resume loads it."""
    _in_schedule: bool = False
    _built_for: list[ChunkSpec]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # nn.Module is no ABC, so @abstractmethod alone would let a module without forward_step be built and fail
        # deep inside Megatron's schedule; fail here, as Python does for ABCs.
        cls = type(self)
        missing = sorted(name for name in _ABSTRACT if getattr(getattr(cls, name), "__isabstractmethod__", False))
        if missing:
            raise TypeError(
                f"Can't instantiate {cls.__name__} without an implementation for abstract method(s) {missing} "
                "(see lightning_megatron.MegatronLightningModule)"
            )
        super().__init__(*args, **kwargs)

    @abstractmethod
    def build_chunk(self, spec: ChunkSpec) -> nn.Module:
        """Build the model chunk for ``spec``.

        Megatron's schedules need three things from every chunk: ``config`` (a ``TransformerConfig`` built with
        ``**spec.parallel``; the schedules read fields beyond ``ModelParallelConfig``), ``model_type``
        (``ModelType.encoder_or_decoder``) and ``set_input_tensor(tensor)`` (takes the previous pipeline stage's
        output; a no-op for single-stage models). Megatron-Core's models have all three.
        """

    @abstractmethod
    def forward_step(self, batch: Batch, model: nn.Module) -> tuple[Tensor, LossFn]:
        """Run one micro-batch through ``model`` (one chunk); return its output and the loss function."""

    @abstractmethod
    def configure_optimizers(self) -> OptimizerSpec:  # type: ignore[override]
        """Return the optimizer settings; the strategy builds Megatron's optimizer and LR schedule from them."""

    def forward_predict(self, batch: Batch, model: nn.Module) -> Tensor:
        """Run one micro-batch through ``model`` for ``trainer.predict``; defaults to ``forward_step``'s output."""
        return self.forward_step(batch, model)[0]

    def predict_output(self, batch: Batch, output: Tensor) -> Tensor:
        """Turn the last stage's output of one micro-batch into what ``trainer.predict`` returns (on every rank)."""
        return output

    def model_hooks(self) -> ModelHooks:
        """What the model family needs of the strategy around the step
        (:class:`~lightning_megatron.contract.ModelHooks`: process-wide patches, after each optimizer update, at fit
        start, on offload, at the run's end); asked once per run, in ``setup_environment``. Default: nothing."""
        return ModelHooks()

    def validate_parallel(self, sizes: ParallelSizes) -> None:
        """Raise ``ValueError`` if this module cannot be split by ``sizes``. The strategy calls it in ``connect``,
        before any process group or model exists; the default accepts every layout."""

    def configure_model(self) -> None:
        """Build this rank's chunks once (the strategy says which stages they are), then load
        :attr:`base_checkpoint` and :attr:`weights_checkpoint` into them if set. A module built for one layout
        refuses another."""
        specs = self._runtime().chunk_specs()
        if hasattr(self, "chunks"):
            if specs != self._built_for:
                raise ValueError(
                    f"{type(self).__name__}'s chunks were built for {_describe(self._built_for)}, and this Trainer "
                    f"runs {_describe(specs)}; a module's chunks cannot change layout or precision in place: save a "
                    "checkpoint (trainer.save_checkpoint), then build a new module with "
                    f"{type(self).__name__}.load_from_checkpoint(path), or resume with trainer.fit(ckpt_path=path)"
                )
            return
        self.chunks = nn.ModuleList(self.build_chunk(spec) for spec in specs)
        self._built_for = specs
        from lightning_megatron.checkpointing import sharded
        from lightning_megatron.checkpointing.format import module_state
        from lightning_megatron.checkpointing.load import loading

        config = sharded.model_config_dict(self)
        if self.base_checkpoint is not None:
            loading.load(list(self.chunks), None, self.base_checkpoint, config, weights="frozen")
        if self.weights_checkpoint is not None:
            path, frozen = self.weights_checkpoint, self.frozen_base()
            strict = self.weights_strict
            common = loading.load(list(self.chunks), None, path, config, frozen_base=frozen, strict=strict)
            module_state.restore(self, common.get("state_dict"), strict=strict)  # beside the chunks
            self.weights_checkpoint = None  # loaded once: a later fit continues from the trained weights

    def frozen_base(self) -> dict[str, str] | None:
        """Where the frozen weights can be read again -- ``{"hf": dir}`` or ``{"checkpoint": dir}`` -- when only the
        trainable parameters (LoRA adapters) need saving; ``None`` (the default): checkpoints hold every weight."""
        return None

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: str | Path, map_location: Any = None, hparams_file: str | Path | None = None,
        strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any,
    ) -> Self:  # fmt: skip
        """A new module from a MegatronStrategy checkpoint directory: built from its hyper-parameters (``kwargs``
        override them), its chunks get the checkpoint's weights when the strategy builds them -- to fine-tune from
        a checkpoint (also one saved with ``weights_only=True``) or to validate/test/predict with it. Resuming an
        interrupted run is ``trainer.fit(model, ckpt_path=path)`` instead.

        Lightning's arguments, with Lightning's meaning:

        * ``map_location``: ``None``, a device or a mapping of devices, all alike: nothing is read here, and each
          rank reads its shard straight onto the device of the Trainer that runs the module (as Lightning's Trainer
          moves a module loaded elsewhere to its device). A callable is refused: it cannot act on a sharded read.
        * ``hparams_file``: a ``.yaml``/``.yml``/``.csv`` file whose hyper-parameters replace the checkpoint's
          (``kwargs`` still override them).
        * ``strict``: whether the checkpoint's tensors must match the module's exactly (``None``: the module's
          ``strict_loading``, True by default). With ``False`` a tensor the checkpoint lacks keeps its initial
          value and one the module lacks is ignored, both named in a warning; another shape still raises.
        * ``weights_only``: checkpoints are always read weights-only; ``False`` is refused (allow a trusted class
          with ``torch.serialization.add_safe_globals``).
        """
        from lightning_megatron.checkpointing import opening
        from lightning_megatron.checkpointing.load import partial_load

        partial_load.check_load_arguments(map_location, weights_only, strict)
        common = opening.read_common_state(checkpoint_path)
        if hparams_file is not None:  # Lightning's: the file's hyper-parameters replace the checkpoint's
            common = {**common, "hyper_parameters": partial_load.hparams_from_file(hparams_file)}
        module = cls(**{**cls.init_args_from_checkpoint(common), **kwargs})
        module.weights_checkpoint = str(checkpoint_path)
        module.weights_strict = module.strict_loading if strict is None else strict
        return module

    @classmethod
    def init_args_from_checkpoint(cls, common: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor arguments :meth:`load_from_checkpoint` passes, from a checkpoint's non-tensor entries:
        the saved hyper-parameters (``save_hyperparameters``)."""
        return dict(common.get("hyper_parameters") or {})

    def _runtime(self) -> MegatronRuntime:
        strategy = self.trainer.strategy
        if not isinstance(strategy, MegatronRuntime):
            raise TypeError(
                f"{type(self).__name__} must be trained with MegatronStrategy, got strategy={type(strategy).__name__}"
            )
        return strategy

    def _not_called(self, hook: str) -> Any:
        raise RuntimeError(
            f"{type(self).__name__}.{hook} is run by MegatronStrategy through Megatron's pipeline schedule; "
            f"use Trainer(strategy=MegatronStrategy(...)), not {type(self.trainer.strategy).__name__}"
        )

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._not_called("training_step")

    # dataloader_idx: Lightning checks the module's step signature before it runs several val/test loaders.
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._not_called("validation_step")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._not_called("test_step")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._not_called("predict_step")

    @contextmanager
    def running_schedule(self) -> Iterator[None]:
        """Entered by the strategy while Megatron's schedule runs :meth:`forward_step` and its ``loss_fn``.

        ``self.log`` raises in there: it would run once per micro-batch and only on the last pipeline stage (a
        ``sync_dist`` collective there deadlocks the other stages). A ``loss_fn`` returns its logs instead.
        """
        previous, self._in_schedule = self._in_schedule, True
        try:
            yield
        finally:
            self._in_schedule = previous

    @override
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self._in_schedule:
            raise RuntimeError(
                f"self.log({name!r}, ...) inside forward_step/loss_fn runs once per micro-batch and only on the last "
                "pipeline stage; return it in loss_fn's logs instead -- loss_fn(output) -> (loss_sum, num_tokens, "
                f"{{{name!r}: value}}) -- which MegatronStrategy reduces over micro-batches and data-parallel ranks "
                "and logs on every rank once per step"
            )
        super().log(name, value, *args, **kwargs)

    def step_metrics(self) -> Mapping[str, Tensor]:
        """More metrics of the training step just run, logged with the strategy's (:meth:`log_train_step`), e.g. an
        MoE model's router losses. Collective: the strategy calls it on every rank after the optimizer step; the
        values must be identical on every rank. Default: none."""
        return {}

    def log_train_step(self, metrics: Mapping[str, Tensor]) -> None:
        """Log one training step's metrics; called by the strategy right after the optimizer step, before any
        callback's ``on_train_batch_end``, all identical on every rank but ``tokens_per_s`` (each rank's clock). They
        are host tensors (logging them costs no GPU synchronisation) but for ``grad_norm`` and those of
        :meth:`step_metrics` (``moe_aux_loss``, ``moe_z_loss``), device tensors that Lightning reads only when a
        logger writes: keep them off the progress bar, where every step would wait for the GPU. Override to change
        what is logged (a local operation: no collective runs here)."""
        if self.trainer.barebones:  # Trainer(barebones=True) turns self.log off (it would warn every run)
            return
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name in _PROGRESS_BAR)

    def log_eval_step(
        self, stage: str, loss: Tensor, num_tokens: Tensor, logs: Mapping[str, Tensor], dataloader_idx: int = 0
    ) -> None:
        """Log one validation/test batch (``stage`` is ``"val"`` or ``"test"``): ``{stage}_loss``, the loss_fn logs
        as ``{stage}_{name}``, and ``{stage}_ppl`` at the epoch's end; with several loaders Lightning appends
        ``/dataloader_idx_N`` to each name, and each loader (``dataloader_idx``) has its own perplexity. Called by the
        strategy in its step."""
        if self.trainer.barebones:  # Trainer(barebones=True) turns self.log off
            return
        # Weighting by tokens makes the epoch mean the token-weighted mean over the whole set.
        # sync_dist: the values are identical on every rank already; the mean over the data-parallel group at the
        # epoch's end changes nothing and keeps Lightning's reminder to sync epoch-level values quiet.
        weight = int(num_tokens)
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=weight, sync_dist=True)
        for name, value in logs.items():  # host values; the epoch-end sync wants them where the loss is
            self.log(f"{stage}_{name}", value.to(loss.device), batch_size=weight, sync_dist=True)
        # Perplexity of the whole set (exp of that same token-weighted mean); the values are already global and
        # identical on every rank, so the metric needs no sync. Lightning computes and resets it. One metric per
        # loader: a shared one would mix the loaders' tokens into every loader's value.
        attribute = f"{stage}_perplexity" + (f"_{dataloader_idx}" if dataloader_idx else "")
        if not hasattr(self, attribute):  # a child module once created: moves with the LightningModule
            setattr(self, attribute, TokenPerplexity().to(loss.device))
        metric = getattr(self, attribute)
        metric.update(loss * num_tokens, num_tokens)
        # metric_attribute: Lightning would otherwise look the Metric up in a cache built before it existed.
        self.log(f"{stage}_ppl", metric, on_step=False, on_epoch=True, metric_attribute=attribute)


def _describe(specs: list[ChunkSpec]) -> str:
    p = specs[0].parallel if specs else {}
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
    tp, pp, vpp = (p.get(key) for key in keys)
    cp, ep = p.get("context_parallel_size"), p.get("expert_model_parallel_size")
    device = specs[0].device_type if specs else "?"
    return (
        f"tp={tp}, pp={pp}, vpp={vpp}, cp={cp}, ep={ep}, sequence_parallel={p.get('sequence_parallel')}, "
        f"params_dtype={p.get('params_dtype')} on {device}"
    )


_PROGRESS_BAR = ("train_loss", "lr", "tokens_per_s")
_ABSTRACT = ("build_chunk", "forward_step", "configure_optimizers")
_BACKWARD = "Megatron's schedule runs the backward pass per micro-batch"
_READ_GRADS = "read gradients in on_before_optimizer_step (MegatronStrategy.grad_norms())"
# LightningModule hooks the strategy's step makes impossible, and what to use instead.
UNSUPPORTED_HOOKS: dict[str, str] = {
    "training_step": "forward_step (the strategy runs the step through Megatron's schedule, per micro-batch)",
    "validation_step": "forward_step (validation runs it forward-only) and loss_fn's logs",
    "test_step": "forward_step (test runs it forward-only) and loss_fn's logs",
    "predict_step": "forward_predict and predict_output",
    "backward": f"{_BACKWARD}; override forward_step/loss_fn",
    "on_before_backward": f"{_BACKWARD}; {_READ_GRADS}",
    "on_after_backward": f"{_BACKWARD}; {_READ_GRADS}",
    "optimizer_zero_grad": "nothing: the strategy zeroes Megatron's gradient buffers before every step",
    "configure_gradient_clipping": "clip_grad in the OptimizerSpec's OptimizerConfig (MegatronLMModule(clip_grad=...))",
    "lr_scheduler_step": "lr_warmup_steps/lr_decay_steps/lr_decay_style of the OptimizerSpec (Megatron's schedule)",
}


def megatron_module(module: object) -> MegatronLightningModule:
    """``module`` itself if it is a :class:`MegatronLightningModule`; ``TypeError`` otherwise."""
    if not isinstance(module, MegatronLightningModule):
        raise TypeError(
            "MegatronStrategy trains a lightning_megatron.MegatronLightningModule (e.g. MegatronLMModule), "
            f"got {type(module).__name__}"
        )
    return module


def check_overrides(module: MegatronLightningModule, callbacks: Iterable[L.Callback] = ()) -> None:
    """Raise ``TypeError`` naming each hook in :data:`UNSUPPORTED_HOOKS` that ``module``'s class overrides, or a
    callback's backward hook (Lightning would call it at the wrong time or not at all), or manual optimization, or
    ``torch.compile(module)``."""
    check_not_compiled(module)
    cls, base = type(module), MegatronLightningModule
    overridden = [name for name in UNSUPPORTED_HOOKS if getattr(cls, name) is not getattr(base, name)]
    for callback in callbacks:
        for name in ("on_before_backward", "on_after_backward"):
            if getattr(type(callback), name) is not getattr(L.Callback, name):
                overridden.append(f"{type(callback).__name__}.{name}")
    if overridden:
        instead = {name: UNSUPPORTED_HOOKS[name.rpartition(".")[2]] for name in overridden}
        raise TypeError(
            f"{cls.__name__} (or a callback) overrides {', '.join(overridden)}, which MegatronStrategy never calls at "
            "that point: " + "; ".join(f"instead of {name} use {use}" for name, use in instead.items())
        )
    if not module.automatic_optimization:
        raise TypeError(
            f"{cls.__name__}.automatic_optimization=False: manual optimization is not supported by MegatronStrategy "
            "(Megatron's schedule runs forward and backward, its optimizer steps); leave it True"
        )


def check_not_compiled(module: MegatronLightningModule) -> None:
    """Raise ``TypeError`` for ``trainer.fit(torch.compile(module))``: Lightning unwraps the compiled module and
    compiles its ``forward`` and ``*_step`` methods, which MegatronStrategy never calls (Megatron's schedule runs the
    chunks through ``forward_step``), so the run would be eager without a word."""
    if not lightning_internals.compiled_by_lightning(module):  # Lightning's own marker (its utilities.compile)
        return
    name = type(module).__name__
    raise TypeError(
        f"trainer.fit(torch.compile({name}(...))): Lightning compiles only the module's forward and *_step methods, "
        "which MegatronStrategy never calls (Megatron's schedule runs the model chunks), so nothing would be "
        f"compiled; pass the {name} itself, uncompiled (the object torch.compile was given: Lightning marked it as "
        "compiled; lightning.pytorch.utilities.compile.to_uncompiled(module) unmarks it), and choose compiled "
        "kernels in its ModelConfig: "
        "kernels='torch' (compiled RoPE attention, cross entropy, SwiGLU and bias-dropout-add fusions on GPU; what "
        "kernels='auto' picks on a GPU without Transformer Engine) and cuda_graphs=True for small models whose steps "
        "wait on the host"
    )
