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

The strategy owns the step: ``strategy.training_step -> schedule.run -> module.forward_step``. Lightning's
``training_step``/``validation_step``/``predict_step`` of these modules are therefore never called.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor, nn

from lightning_megatron.contract import Batch, ChunkSpec, LossFn, MegatronRuntime, OptimizerSpec
from lightning_megatron.modules.metrics import TokenPerplexity
from lightning_megatron.schedule import global_batch_size

if TYPE_CHECKING:
    from lightning_megatron.parallel.sizes import ParallelSizes


class MegatronLightningModule(L.LightningModule):
    """Base class for LightningModules trained by :class:`~lightning_megatron.MegatronStrategy`.

    After ``configure_model`` the module holds this rank's model chunks in :attr:`chunks` (one per virtual
    pipeline stage). Logging of ``train_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``val_loss`` and ``val_ppl``
    (a torchmetrics ``Perplexity``) happens in the batch-end hooks below from what the strategy returns; subclasses
    overriding them should call ``super()``.
    """

    chunks: nn.ModuleList

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

    def validate_parallel(self, sizes: ParallelSizes) -> None:
        """Raise ``ValueError`` if this module cannot be split by ``sizes``. The strategy calls it in ``connect``,
        before any process group or model exists; the default accepts every layout."""

    def configure_model(self) -> None:
        """Build this rank's chunks once; the strategy says which stages they are."""
        if hasattr(self, "chunks"):
            return
        self.chunks = nn.ModuleList(self.build_chunk(spec) for spec in self._runtime().chunk_specs())

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

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self._not_called("validation_step")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._not_called("predict_step")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The strategy's outputs are identical on every rank, so no sync is needed (and none is done). The loss is
        # logged from its host copy: the progress bar reads it every step.
        self.log("train_loss", outputs["host_loss"].get(), prog_bar=True)
        runtime = self._runtime()
        stats = runtime.last_step
        self.log("lr", _host(stats.lr), prog_bar=True)
        if stats.grad_norm is not None:
            self.log("grad_norm", _host(stats.grad_norm))
        self.log("skipped_steps", _host(runtime.skipped_steps))
        # Input tokens of the global batch per second of this step (rank 0's clock). Counted on the host: reading
        # the loss's token count would wait for the GPU and stall the next step's launch.
        elapsed = time.perf_counter() - getattr(self, "_step_start", time.perf_counter())
        if elapsed > 0:
            _, tokens = global_batch_size(batch)
            self.log("tokens_per_s", _host(tokens / elapsed), prog_bar=True)

    def on_validation_epoch_start(self) -> None:
        if not hasattr(self, "val_perplexity"):  # a child module once created: moves with the LightningModule
            self.val_perplexity = TokenPerplexity().to(self.device)

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        # Weighting by tokens makes the epoch mean the token-weighted mean over the whole validation set.
        num_tokens = outputs["num_tokens"]
        self.log("val_loss", outputs["loss"], prog_bar=True, batch_size=int(num_tokens))
        # Perplexity of the whole validation set (exp of that same token-weighted mean); the outputs are already
        # global and identical on every rank, so the metric needs no sync. Lightning computes and resets it.
        self.val_perplexity.update(outputs["loss"] * num_tokens, num_tokens)
        # metric_attribute: Lightning would otherwise look the Metric up in a cache built before it existed.
        self.log("val_ppl", self.val_perplexity, on_step=False, on_epoch=True, metric_attribute="val_perplexity")


def _host(value: float) -> Tensor:
    """A host-side number as a CPU tensor for ``self.log``: Lightning would copy a bare float to the GPU, a
    synchronising copy that stops the host from queueing the next step while the optimizer's kernels run."""
    return torch.tensor(float(value), dtype=torch.float32)
