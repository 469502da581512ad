"""MegatronStrategy: Megatron-Core's parallelism, schedules, optimizer and checkpoints behind Lightning's hooks."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, override

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from lightning_megatron import schedule
from lightning_megatron.callbacks import adapt_callbacks
from lightning_megatron.checkpointing import prestage
from lightning_megatron.checkpointing.config import CheckpointConfig
from lightning_megatron.checkpointing.writer import CheckpointWriter
from lightning_megatron.compat import patches
from lightning_megatron.contract import ChunkSpec, MegatronRuntime, StepStats
from lightning_megatron.data import consistency
from lightning_megatron.micro_batches import micro_batching
from lightning_megatron.modules.base import MegatronLightningModule, check_overrides, megatron_module
from lightning_megatron.parallel import ddp, state
from lightning_megatron.parallel import precision as mixed
from lightning_megatron.parallel.metrics import bind_metrics, metric_process_group, unbind_metrics
from lightning_megatron.parallel.sizes import ParallelSizes
from lightning_megatron.runstate import RunState
from lightning_megatron.strategy_checkpoints import ShardedCheckpointHooks
from lightning_megatron.strategy_data import DataParallelHooks
from lightning_megatron.strategy_params import ParameterOps
from lightning_megatron.training import guards, optim
from lightning_megatron.training.accumulation import GradientAccumulation
from lightning_megatron.training.grad_norms import GradNormReads
from lightning_megatron.training.offload import Offloader
from lightning_megatron.training.preemption import Preempted, SigtermStop
from lightning_megatron.training.retained import Retained, keep_after_run, run_all, run_finished, run_started

if TYPE_CHECKING:
    from lightning.pytorch.strategies.launchers.launcher import _Launcher
    from megatron.core.distributed import DistributedDataParallelConfig


class MegatronStrategy(ShardedCheckpointHooks, DataParallelHooks, ParameterOps, DDPStrategy, MegatronRuntime):
    """Train a :class:`~lightning_megatron.MegatronLightningModule` with Megatron-Core.

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        vpp: virtual-pipeline chunks per pipeline rank (interleaved 1F1B); needs ``pp > 1``.
        cp: context-parallel size.
        ep: expert-parallel size (MoE).
        sequence_parallel: split norm/dropout activations along the sequence across TP ranks; needs ``tp > 1``.
        micro_batch_size: samples per micro-batch; each DataLoader batch is split into micro-batches of this
            size and run through Megatron's pipeline schedule as one optimizer step.
        max_tokens_per_micro_batch: instead of ``micro_batch_size``, group each batch's samples into micro-batches
            of at most this many tokens (each padded only to its own longest sample; balanced; Megatron's
            variable-length p2p between pipeline stages). Predictions keep fixed micro-batches.
        use_distributed_optimizer: shard optimizer state across data-parallel ranks (ZeRO-1).
        ddp_config: Megatron's ``DistributedDataParallelConfig`` (overlap, bucket size, ...), used as given (default:
            ``grad_reduce_in_fp32=True``; Megatron's is False); ``use_distributed_optimizer`` above wins over its
            field of the same name. The overlap hooks go to Megatron's schedule as Megatron-LM hands them.
        seed: base seed of Megatron's model-parallel RNG; ``None`` takes Lightning's ``seed_everything`` seed
            (``PL_GLOBAL_SEED``) or 1234.
        timeout: timeout of every collective (Lightning's default group and Megatron's groups; sub-minute values
            work): a rank that stops answering makes the others fail with an error after this long.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on GPU by default.
        async_save: ``CheckpointConfig.async_save`` (``None``: ``checkpoint``'s; the two differing: ``ValueError``).
        nonfinite: what a non-finite loss or gradient does: ``"error"`` (default) stops with an error naming the
            step, ``"skip"`` leaves the weights unchanged for that step and counts it in ``skipped_steps``.
        check_batches: compare a fingerprint of every batch over each model replica's ranks (tensor x pipeline x
            context parallel) before the step's first forward: ``ValueError`` when they differ.
        checkpoint: the checkpoint writer's settings: :class:`~lightning_megatron.CheckpointConfig`.
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        vpp: int | None = None,
        cp: int = 1,
        ep: int = 1,
        sequence_parallel: bool = False,
        micro_batch_size: int = 1,
        max_tokens_per_micro_batch: int | None = None,
        use_distributed_optimizer: bool = True,
        ddp_config: DistributedDataParallelConfig | None = None,
        seed: int | None = None,
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        async_save: bool | None = None,
        nonfinite: guards.NonFinite = "error",
        check_batches: bool = True,
        checkpoint: CheckpointConfig | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._sizes = ParallelSizes(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
        self.micro_batch_size = micro_batch_size
        self._batching = micro_batching(self._sizes, micro_batch_size, max_tokens_per_micro_batch)
        self.use_distributed_optimizer = use_distributed_optimizer
        ddp.check_config(ddp_config, use_distributed_optimizer)
        self._ddp_config, self._seed = ddp_config, seed
        self._run = RunState()  # what one run builds and undoes (runstate.py); idle between runs
        self._megatron_optimizer: Any | None = None
        self._scheduler: Any | None = None
        self._offload = Offloader()
        self._guard = guards.StepGuard(nonfinite)
        self._grad_reads = GradNormReads()  # warns once if on_before_optimizer_step hooks never read grad_norms()
        self.checkpoint_writer = CheckpointWriter(checkpoint, async_save)  # pending saves, buffers and plans they reuse
        self._collective_timeout = timeout
        self._groups: state.Groups | None = None  # Megatron's groups of this strategy's last run
        self._retained: Retained | None = None  # what a finished run keeps for trainer.save_checkpoint
        self._sigterm = SigtermStop(lambda: self._accumulation.open)  # all ranks stop at one step on SIGTERM
        self._batches = consistency.BatchCheck(check_batches)
        self._accumulation = GradientAccumulation()  # Trainer(accumulate_grad_batches) (training/accumulation.py)

    # ------------------------------------------------------------------ state
    @property
    def parallel(self) -> ParallelSizes:
        """The parallel layout (tp, pp, vpp, cp, ep, sequence_parallel)."""
        return self._sizes

    @property
    def megatron_optimizer(self) -> Any:
        """Megatron's optimizer, built in ``setup`` for fitting."""
        if self._megatron_optimizer is None:
            raise RuntimeError("MegatronStrategy.megatron_optimizer is only available after setup for trainer.fit")
        return self._megatron_optimizer

    @property
    @override
    def last_step(self) -> StepStats:
        """LR and gradient norm of the last optimizer step."""
        if self._guard.last_step is None:
            raise RuntimeError("MegatronStrategy.last_step is only available after the first optimizer step")
        return self._guard.last_step

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of a non-finite loss/gradient (or a Megatron overflow) by this strategy."""
        return self._guard.skipped_steps

    @property
    def module(self) -> MegatronLightningModule:
        return megatron_module(self.lightning_module)

    @override
    def chunk_specs(self) -> list[ChunkSpec]:
        # Micro-batches of different shapes between pipeline stages: Megatron's p2p then sends shapes first.
        variable = self._batching.max_tokens is not None and self._sizes.pp > 1
        return state.chunk_specs(self._sizes, self.compute_dtype, self.root_device.type, variable)

    @property
    @override
    def compute_dtype(self) -> torch.dtype:
        """Weights' and activations' dtype: bf16 (``"bf16-mixed"``), fp16 (``"16-mixed"``) or fp32 (``"32-true"``);
        Megatron's own mixed precision (Float16Module, fp32 main weights and gradient reduction, no autocast)."""
        return mixed.PRECISIONS[mixed.lightning_precision(self.precision_plugin)]

    @property
    @override
    def launcher(self) -> _Launcher | None:
        # One process started by hand needs none (Lightning's refuses notebooks); under torchrun it checks the world.
        environment = self.cluster_environment
        if self.num_nodes * self.num_processes == 1 and not (environment and environment.creates_processes_externally):
            return None
        return super().launcher

    @override
    def block_backward_sync(self) -> AbstractContextManager[None]:  # type: ignore[override]
        return self._accumulation.defer()  # Trainer(accumulate_grad_batches): this batch does not step

    # ------------------------------------------------------------------ setup
    @override
    def connect(self, model: L.LightningModule) -> None:
        module = megatron_module(model)
        super().connect(model)
        guards.check_trainer(model.trainer)
        mixed.lightning_precision(self.precision_plugin)  # raises for precisions Megatron is not set up for here
        check_overrides(module, model.trainer.callbacks)
        module.validate_parallel(self._sizes)

    @override
    def set_world_ranks(self) -> None:
        # Called when the Trainer is built, before any process starts: an impossible layout fails right there.
        self._sizes.data_parallel_size(self.num_nodes * self.num_processes)
        super().set_world_ranks()

    @override
    def setup_environment(self) -> None:
        self._sizes.data_parallel_size(self.num_nodes * self.num_processes)  # raises before any group exists
        adapt_callbacks(self.lightning_module.trainer)  # the module's configure_callbacks are attached by now
        self.checkpoint_writer.prepare(self.use_distributed_optimizer, processes_per_node=self.num_processes)
        run_started(self, self._sigterm)  # tears down runs Lightning left unfinished first (training/retained.py)
        self._run = RunState(hooks=self.module.model_hooks())
        self.checkpoint_writer.start(self.lightning_module.trainer.state.fn)  # while the model is built
        device = self.root_device.type  # quiet notices, CPU mode; then the model family's (e.g. MoE permutation)
        for patch in [*patches.run_patches(device), *self._run.hooks.run_patches(device)]:
            self._run.patches.install(patch)
        super().setup_environment()  # default process group
        if self._groups is None or not self._groups.alive():  # a later fit/validate/... of this strategy reuses them
            self._megatron_optimizer = self._scheduler = self._retained = None  # an earlier run's, for its groups
            self._groups = state.initialize(self._sizes, timeout=self._collective_timeout)
        self._run.rng = state.seed(state.resolve_seed(self._seed))

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        bind_metrics(self.module)  # torchmetrics sync over the data-parallel group, not all ranks (parallel/metrics.py)
        guards.check_module(self.module, fitting=trainer.state.fn == TrainerFn.FITTING)  # loss, trained parameters
        run = self._run
        run.run_chunks = mixed.wrap(list(self.module.chunks), self.compute_dtype)
        if trainer.state.fn == TrainerFn.FITTING:
            run.hooks.fit_starting(self.module.chunks)
            run.ddp_chunks = run.run_chunks = ddp.wrap(run.run_chunks, self._ddp_config, self.use_distributed_optimizer)
            self.setup_optimizers(trainer)
            prestage.prestage(self.checkpoint_writer, trainer, self.module, self._megatron_optimizer, self._scheduler)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        spec = optim.check_spec(self.module.configure_optimizers(), type(self.module).__name__)
        run = self._run
        assert run.ddp_chunks is not None
        if self._retained is not None:  # an earlier fit's optimizer, kept for save_checkpoint, is replaced
            self._retained.forget_optimizer()
        clip = run.patches.get(patches.ForeachClipGrads) or run.patches.install(patches.ForeachClipGrads())
        fused = self.root_device.type == "cuda"  # as after a load (strategy_checkpoints.py)
        setup = partial(optim.setup, dtype=self.compute_dtype, distributed=self.use_distributed_optimizer, fused=fused)
        built = setup(spec, run.ddp_chunks, trainer, self._guard, clip, after_update=run.hooks.weights_updated)
        self._megatron_optimizer, self._scheduler, adapter = built
        self.optimizers, self.lr_scheduler_configs = [adapter], []

    # ------------------------------------------------------------------ steps, parameters (offload: GPU shared)
    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:  # type: ignore[override]
        start = time.perf_counter()
        self._batches.verify(self._groups, "training", batch)
        run = self._run
        if self._accumulation.begin(batch_idx % self.module.trainer.accumulate_grad_batches == 0):
            ddp.zero_grads(run.ddp_chunks, self.megatron_optimizer)  # the first batch of an optimizer step
            run.step = schedule.TrainStep()
        with self.module.running_schedule(), self._accumulation.schedule_hooks(run.ddp_chunks):
            micro_batches = self._batching.split(schedule.as_batch(batch))
            loss = schedule.train(self.module, run.ddp_chunks, micro_batches, self.root_device, run.log_names)
        assert run.step is not None
        run.step = run.step.add(loss, schedule.global_batch_size(batch)[1], start, self._accumulation.deferring)
        return {"loss": loss.loss, "num_tokens": loss.num_tokens}

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss  # Megatron's schedule ran the backward pass

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Lightning's "16-mixed" plugin would step through a torch GradScaler; Megatron's fp16 optimizer owns the
        # loss scale, so run the plain precision step: the closure, on_before_optimizer_step, our optimizer's step.
        plugin = self.precision_plugin
        result = Precision.optimizer_step(plugin, optimizer, model or self.lightning_module, closure, **kwargs)
        self._grad_reads.after_hooks(self.module)  # after on_before_optimizer_step: were gradients read?
        # Logged here, before any callback's on_train_batch_end of this step reads trainer.callback_metrics.
        assert self._run.step is not None
        metrics = schedule.train_metrics(self._run.step, self.last_step, self.skipped_steps, self._run.log_names)
        self.module.log_train_step({**metrics, **self.module.step_metrics()})
        self._run.step = None  # grad_norms() outside a step raises instead of reading stale buffers
        self._accumulation.close()
        return result

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:  # type: ignore[override]
        return self._evaluation_step("val", batch, dataloader_idx)

    @override
    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:  # type: ignore[override]
        return self._evaluation_step("test", batch, dataloader_idx)

    def _evaluation_step(self, stage: str, batch: Any, dataloader_idx: int) -> dict[str, Tensor]:
        self._stop_if_signalled()
        self._batches.verify(self._groups, stage, batch)
        loss = self.forward_loss(batch)
        self.module.log_eval_step(stage, loss["loss"], loss["num_tokens"], loss["logs"], dataloader_idx=dataloader_idx)
        return {"loss": loss["loss"], "num_tokens": loss["num_tokens"]}

    def forward_loss(self, batch: Any) -> dict[str, Any]:
        """Collective: ``{"loss", "num_tokens", "logs"}`` of ``batch`` forward-only, as validation computes them
        (identical on every rank), without logging anything: for any hook while the strategy is set up."""
        return schedule.evaluation(self._forward_only(batch, predict=False), self.root_device, self._run.log_names)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:  # type: ignore[override]
        self._stop_if_signalled()
        self._batches.verify(self._groups, "predict", batch)
        return schedule.gather_predictions(self._forward_only(batch, predict=True), self.root_device)

    def _forward_only(self, batch: Any, *, predict: bool) -> list[dict[str, Any]]:
        chunks = self._run.run_chunks or list(self.module.chunks)
        with torch.no_grad(), self.module.running_schedule():
            micro_batches = self._batching.split(schedule.as_batch(batch), fixed=predict)
            return schedule.run(self.module, chunks, micro_batches, forward_only=True, predict=predict)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)`` and ``strategy.reduce`` reduce over the data-parallel group by default,
        as torchmetrics do: tensor-, pipeline- and context-parallel peers hold copies of values, not more samples."""
        return super().reduce(tensor, group=group or metric_process_group(), reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Decisions (ModelCheckpoint's "is this the best?", EarlyStopping) bind every rank: all of the world votes.
        votes = super().reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)

    # ------------------------------------------------------------------ SIGTERM: every rank stops at one step
    @override
    def barrier(self, name: str | None = None) -> None:
        self._sigterm.at_barrier(takeover=name == "run-stage")  # Lightning's handler is registered just before it
        super().barrier(name)

    @override
    def on_validation_end(self) -> None:
        self._stop_if_signalled()  # a signal in the stage's last step

    on_test_end = on_predict_end = on_validation_end

    def _stop_if_signalled(self) -> None:  # collective, at a step boundary
        self._sigterm.check(self._groups.control if self._groups else None, self.lightning_module.trainer.global_step)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._accumulation.follow_schedule(self.module.trainer)  # also in an epoch resumed mid-way
        self._stop_if_signalled()
        self.checkpoint_writer.poll()

    @override
    def on_train_end(self) -> None:
        self._stop_if_signalled()  # a signal in the last step or the last saves
        self.sync_params()  # the final weights, for whatever runs after fit
        self.checkpoint_writer.finalize()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._guard.warn_if_failed(exception)  # a non-finite step may be the root cause
        super().on_exception(exception)
        self._run.failed = not isinstance(exception, Preempted)  # peers may be dead: teardown must not wait for them

    @override
    def teardown(self) -> None:
        run_finished(self)
        run, self._run = self._run, RunState()
        run_all(  # each step runs even if one raises: no patch (patches.py), RNG state or graph outlives the run
            lambda: self.checkpoint_writer.close(run.failed),  # publish (e.g. save_checkpoint after fit) or abort
            lambda: self._offload.reload(strict=False),  # never leave released storages behind
            lambda: unbind_metrics(self.lightning_module),  # no metric keeps a finished run's group
            self._guard.forget,
            self._accumulation.close,
            run.release,  # Megatron's schedule hooks, the model family's per-run state (CUDA graphs, fp8 casts)
            super().teardown,
            lambda: self._keep_for_saving(run.failed),
            run.patches.remove,  # every patch, each removal run whatever the others do (patches.py)
            lambda: state.restore_rng(run.rng),
            lambda: self._sigterm.uninstall(redeliver=not run.failed),
            raise_errors=not run.failed,  # after a failure the user's exception is the one to see
        )

    def _keep_for_saving(self, failed: bool) -> None:  # kept for trainer.save_checkpoint (retained.py), unless failed
        groups, optimizer = None if failed else self._groups, self._megatron_optimizer
        self._retained = keep_after_run(self._retained, groups, self.root_device.type, self.module, optimizer)
        if self._retained is None:
            self._megatron_optimizer = self._scheduler = self._groups = None
