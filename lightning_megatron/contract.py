"""The contract between MegatronStrategy, Megatron's schedule and the LightningModules, as types.

A leaf module (no imports from this package): the strategy, the schedule, the modules, the training and
checkpointing code all read these, so none of them needs another's file to know the shapes it exchanges.

* :data:`Batch` and :data:`LossFn` -- what one micro-batch is and what a module's loss function returns;
* :class:`StepModule` -- what the schedule calls on a module (``forward_step`` and the predict pair);
* :class:`ChunkSpec` -- where one model chunk sits, handed to ``build_chunk``;
* :class:`OptimizerSpec` -- what ``configure_optimizers`` returns;
* :class:`StepStats` -- what one optimizer step reported;
* :class:`MegatronRuntime` -- what a module or callback may ask of the strategy that runs it;
* :class:`ModelHooks` -- what a model family needs of the strategy around the step (and :class:`RunPatch`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig

IGNORE_INDEX = -100
"""The label that excludes a position from the loss (Hugging Face's convention)."""

Batch = dict[str, Tensor]
"""One (micro-)batch: HF-style tensors keyed by name, ``input_ids`` [B, S] always present."""

LossFn = Callable[[Tensor], tuple[Tensor, Tensor, dict[str, Tensor]]]
"""``loss_fn(output) -> (loss_sum, num_tokens, logs)``: the summed loss of a micro-batch, its token count
(an integer tensor) and extra tensors to log. Called on the last pipeline stage only."""


class StepModule(Protocol):
    """What the schedule needs from a LightningModule (see :class:`~lightning_megatron.MegatronLightningModule`)."""

    def forward_step(self, batch: Batch, model: nn.Module) -> tuple[Tensor, LossFn]: ...

    def forward_predict(self, batch: Batch, model: nn.Module) -> Tensor: ...

    def predict_output(self, batch: Batch, output: Tensor) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class ChunkSpec:
    """Where one model chunk sits in the pipeline, and the Megatron config fields the strategy decided."""

    pre_process: bool
    """The chunk holds the input embedding (first pipeline stage, first virtual chunk)."""
    post_process: bool
    """The chunk holds the output head and computes the loss (last stage, last virtual chunk)."""
    vp_stage: int | None
    """Index of the chunk among this rank's virtual-pipeline chunks; ``None`` without VPP."""
    parallel: dict[str, Any] = field(default_factory=dict)
    """``ModelParallelConfig`` fields to pass into the chunk's ``TransformerConfig``/``ModelParallelConfig``:
    parallel sizes, ``sequence_parallel``, dtypes and p2p settings."""
    device_type: str = "cpu"
    """Where the chunk will run (``"cuda"`` or ``"cpu"``): decides which kernels are worth building."""


@dataclass(kw_only=True)
class OptimizerSpec:
    """Megatron's optimizer config plus the LR schedule (Megatron's ``OptimizerParamScheduler``)."""

    config: OptimizerConfig
    """Megatron's ``OptimizerConfig`` (optimizer, lr, min_lr, weight_decay, betas, clip_grad, ...). The strategy
    sets its precision fields and ``use_distributed_optimizer``."""
    lr_warmup_steps: int = 0
    """Linear warm-up from 0 to ``config.lr`` over this many optimizer steps."""
    lr_decay_steps: int | None = None
    """Steps over which the LR decays to ``config.min_lr``; ``None`` means the Trainer's total steps
    (``trainer.estimated_stepping_batches``)."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine"
    """Shape of the decay."""
    override_lr_schedule: bool = False
    """On resume (``trainer.fit(ckpt_path=...)``): ``False`` raises if the checkpoint's schedule (lr, min_lr,
    warm-up, decay steps and style, weight decay) differs from this one; ``True`` follows this spec's schedule,
    continuing from the checkpoint's step count -- to train longer or change the warm-up or decay (Megatron's
    ``override_opt_param_scheduler``). Weights and optimizer state resume as saved either way."""


@dataclass(frozen=True)
class StepStats:
    """What the last optimizer step reported."""

    lr: float
    """The learning rate the step used."""
    grad_norm: Tensor | float | None
    """Megatron's global gradient norm (before clipping): a 0-dim device tensor, left where the optimizer computed
    it (reading it on the host waits for the optimizer step); a float where Megatron read it itself (MoE runs
    whose expert and dense gradients reduce over different groups); ``None`` for a skipped step."""
    skipped: bool
    """The weights were left unchanged (non-finite policy ``"skip"``, or an fp16 overflow)."""


class MegatronRuntime(ABC):
    """What a module or callback may ask of the strategy that runs it (``MegatronStrategy`` implements it).

    Modules check ``isinstance(trainer.strategy, MegatronRuntime)`` instead of importing the strategy: the
    strategy sits above the modules, and this keeps imports pointing one way.
    """

    @abstractmethod
    def chunk_specs(self) -> list[ChunkSpec]:
        """One spec per model chunk this rank holds (one per VPP stage); needs Megatron's parallel state."""

    @abstractmethod
    def sync_params(self) -> None:
        """Make the chunks hold the last update (finish a deferred parameter all-gather)."""

    @property
    @abstractmethod
    def params_deferred(self) -> bool:
        """Whether an update's parameter all-gather waits for the next forward (``overlap_param_gather``): until
        :meth:`sync_params`, each rank's chunks hold the last update in their own shard only."""

    @property
    @abstractmethod
    def last_step(self) -> StepStats:
        """What the last optimizer step reported."""

    @property
    @abstractmethod
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far in this run."""

    @property
    @abstractmethod
    def compute_dtype(self) -> torch.dtype:
        """The dtype of weights and activations (bf16, fp16 or fp32)."""


class RunPatch(Protocol):
    """A process-wide replacement of third-party code for one run (``lightning_megatron.compat.patches.Patch``)."""

    installed: bool

    def install(self) -> None: ...

    def remove(self) -> None: ...


class ModelHooks:
    """What a model family needs of the strategy around Megatron's step, beyond building chunks and running
    micro-batches: a module returns its family's from ``MegatronLightningModule.model_hooks()``, once per run.

    The strategy calls each at one fixed point and knows nothing else of the family (its kernels, its caches, its
    process-wide state). Every default does nothing, so a module made of plain Megatron-Core parts needs none.
    """

    def run_patches(self, device_type: str) -> list[RunPatch]:
        """Process-wide patches the run needs (installed in ``setup_environment``, before the chunks are built, and
        removed at teardown, failed or not), for chunks on ``device_type``."""
        return []

    def fit_starting(self, chunks: Sequence[nn.Module]) -> None:
        """A fit is about to train ``chunks`` (built, not yet wrapped for data parallelism): e.g. fresh per-run
        state such as CUDA graphs to capture."""

    def weights_updated(self) -> None:
        """An optimizer step changed the weights (called right after every update; not for a skipped step, which
        leaves them as they were): e.g. mark cached weight casts stale."""

    def weights_released(self, chunks: Sequence[nn.Module]) -> None:
        """The weights of ``chunks`` left the device (``MegatronStrategy.offload``): drop what was derived from them."""

    def run_ended(self, chunks: Sequence[nn.Module]) -> None:
        """The run that used ``chunks`` ended (teardown, also after a failure): release its per-run state."""
