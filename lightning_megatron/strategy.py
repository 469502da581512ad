"""MegatronStrategy: Megatron-Core's parallelism, schedules, optimizer and checkpoints behind Lightning's hooks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, override

import lightning as L
import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout

from lightning_megatron import cpu, schedule
from lightning_megatron.checkpointing import sharded
from lightning_megatron.checkpointing.resume import ResumableLoader
from lightning_megatron.checkpointing.writer import CheckpointWriter
from lightning_megatron.contract import ChunkSpec, MegatronRuntime, OptimizerSpec, StepStats
from lightning_megatron.modules.base import MegatronLightningModule
from lightning_megatron.parallel import ddp, state
from lightning_megatron.parallel import precision as mixed
from lightning_megatron.parallel.sizes import ParallelSizes
from lightning_megatron.training import clip_grads, guards, optim
from lightning_megatron.training import offload as offload_state
from lightning_megatron.training.optim import LightningOptimizerAdapter, build_scheduler
from lightning_megatron.validation import check_positive_int

if TYPE_CHECKING:
    from lightning.pytorch.strategies.launchers.launcher import _Launcher
    from megatron.core.distributed import DistributedDataParallelConfig


class MegatronStrategy(DDPStrategy, MegatronRuntime):
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
        use_distributed_optimizer: shard optimizer state across data-parallel ranks (ZeRO-1).
        ddp_config: Megatron's ``DistributedDataParallelConfig`` (``overlap_grad_reduce``, ``overlap_param_gather``,
            bucket size, ...), used as given (the default is ``grad_reduce_in_fp32=True``; Megatron's own default
            is False); ``use_distributed_optimizer`` above wins over its field of the same name. The overlap hooks
            are handed to Megatron's schedule as Megatron-LM does.
        seed: base seed of Megatron's model-parallel RNG; ``None`` takes Lightning's ``seed_everything`` seed
            (``PL_GLOBAL_SEED``) or 1234.
        timeout: timeout of every collective (Lightning's default group and Megatron's groups; sub-minute values
            work): a rank that stops answering makes the others fail with an error after this long.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on GPU by default.
        async_save: write checkpoints in background processes (Megatron's async dist-checkpointing); a checkpoint
            is published once every rank has written it, at the latest before the next save and at the end of
            training. Off by default.
        nonfinite: what a non-finite loss or gradient does: ``"error"`` (default) stops with an error naming the
            step, ``"skip"`` leaves the weights unchanged for that step and counts it in ``skipped_steps``.
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
        use_distributed_optimizer: bool = True,
        ddp_config: DistributedDataParallelConfig | None = None,
        seed: int | None = None,
        timeout: timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        async_save: bool = False,
        nonfinite: guards.NonFinite = "error",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._sizes = ParallelSizes(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
        check_positive_int("micro_batch_size", micro_batch_size)
        self.micro_batch_size = micro_batch_size
        self.use_distributed_optimizer = use_distributed_optimizer
        if ddp_config is not None and ddp_config.overlap_param_gather and not use_distributed_optimizer:
            raise ValueError(
                "ddp_config.overlap_param_gather=True needs use_distributed_optimizer=True (it overlaps the "
                "distributed optimizer's parameter all-gather); set overlap_param_gather=False or keep the default"
            )
        self._ddp_config = ddp_config
        self._seed = seed
        self._ddp_chunks: list[nn.Module] | None = None
        self._run_chunks: list[nn.Module] | None = None  # what the schedule runs: chunks, precision/DDP-wrapped
        self._megatron_optimizer: Any | None = None
        self._scheduler: Any | None = None
        self._last_step: StepStats | None = None
        self._offloaded: offload_state.Offloaded | None = None
        guards.check_policy(nonfinite)
        self._nonfinite = nonfinite
        self._skipped_steps = 0
        self._writer = CheckpointWriter(async_save)
        self._failed = False

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
        if self._last_step is None:
            raise RuntimeError("MegatronStrategy.last_step is only available after the first optimizer step")
        return self._last_step

    @property
    @override
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of a non-finite loss/gradient (or a Megatron overflow) by this strategy."""
        return self._skipped_steps

    @property
    def module(self) -> MegatronLightningModule:
        return _check_module(self.lightning_module)

    @override
    def chunk_specs(self) -> list[ChunkSpec]:
        """One spec per model chunk this rank holds (one per VPP stage)."""
        config = self.megatron_config_kwargs()
        stages = state.chunk_stages(self._sizes.num_chunks)
        vpp = self._sizes.vpp
        return [
            ChunkSpec(
                pre_process=first,
                post_process=last,
                vp_stage=i if vpp else None,
                parallel=config,
                device_type=self.root_device.type,
            )  # fmt: skip
            for i, (first, last) in enumerate(stages)
        ]

    @property
    @override
    def compute_dtype(self) -> torch.dtype:
        """Weights' and activations' dtype: bf16 (``"bf16-mixed"``), fp16 (``"16-mixed"``) or fp32 (``"32-true"``).

        The mixed precisions are Megatron's own: Float16Module, fp32 main weights in the optimizer, gradients
        reduced in fp32, dynamic loss scaling for fp16 -- no autocast.
        """
        return mixed.PRECISIONS[mixed.lightning_precision(self.precision_plugin)]

    def megatron_config_kwargs(self) -> dict[str, Any]:
        """``ModelParallelConfig`` fields the strategy decides: sizes, dtypes, p2p settings."""
        dtype = self.compute_dtype
        return {
            **self._sizes.megatron_kwargs(),
            **mixed.megatron_dtype_fields(dtype),
            "pipeline_dtype": dtype,
            # With pp=2 the next and the previous stage are the same peer. The interleaved schedule's batched
            # send/recv then posts [send_prev, recv_prev, send_next, recv_next] on both ranks, so an activation
            # is received as a gradient and vice versa (same shape: no error, silently wrong losses after the
            # warm-up; seen on gloo and NCCL). Unbatched p2p orders the ops so they match.
            "batch_p2p_comm": not (self._sizes.pp == 2 and self._sizes.vpp is not None),
        }

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor-, pipeline- and context-parallel peers must see the same samples.
        rank, size = state.data_parallel_rank_and_size()
        return {"num_replicas": size, "rank": rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        batch_size = getattr(dataloader, "batch_size", None)
        if isinstance(batch_size, int):
            schedule.check_micro_batch_size(batch_size, self.micro_batch_size)
        trainer = self.module.trainer
        if not trainer.training:
            return dataloader
        guards.check_dataloader(dataloader, "training")
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return ResumableLoader(dataloader, consumed=lambda: progress.current.ready)

    @property
    @override
    def launcher(self) -> _Launcher | None:
        # One process started by hand needs no launcher, and Lightning refuses its subprocess launcher in
        # interactive sessions: without this a one-device run in a notebook raises. Under torchrun (processes
        # created externally) the launcher stays: it checks the world size against the Trainer's.
        environment = self.cluster_environment
        if self.num_nodes * self.num_processes == 1 and not (environment and environment.creates_processes_externally):
            return None
        return super().launcher

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model and optimizer must exist to load sharded state into them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded together with the model in load_checkpoint

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True  # micro-batching is the accumulation

    # ------------------------------------------------------------------ setup
    @override
    def connect(self, model: L.LightningModule) -> None:
        module = _check_module(model)
        super().connect(model)
        guards.check_trainer(model.trainer)
        mixed.lightning_precision(self.precision_plugin)  # raises for precisions Megatron is not set up for here
        module.validate_parallel(self._sizes)

    @override
    def set_world_ranks(self) -> None:
        # Lightning calls this when the Trainer is built, before any process is started: the earliest point where
        # the world size is known, so an impossible layout fails right there.
        self._sizes.data_parallel_size(self.num_nodes * self.num_processes)
        super().set_world_ranks()

    @override
    def setup_environment(self) -> None:
        self._sizes.data_parallel_size(self.num_nodes * self.num_processes)  # raises before any group exists
        if self.root_device.type == "cpu":
            cpu.enable()
        super().setup_environment()  # default process group
        state.initialize(self._sizes, seed=state.resolve_seed(self._seed), timeout=self._timeout)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.module
        self.model_to_device()
        for chunk in module.chunks:
            # Loss functions return sums; Megatron then divides gradients by the global batch's token count.
            # Set here (not through ChunkSpec) because it is a TransformerConfig field that the schedule and DDP
            # read from any chunk config, a bare ModelParallelConfig included.
            chunk.config.calculate_per_token_loss = True
        self._run_chunks = mixed.wrap(list(module.chunks), self.compute_dtype)
        if trainer.state.fn == TrainerFn.FITTING:
            self._ddp_chunks = ddp.wrap(self._run_chunks, self._ddp_config, self.use_distributed_optimizer)
            self._run_chunks = self._ddp_chunks
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

        spec = self.module.configure_optimizers()
        if not isinstance(spec, OptimizerSpec):
            raise TypeError(
                f"{type(self.module).__name__}.configure_optimizers must return lightning_megatron.OptimizerSpec, "
                f"got {type(spec).__name__}"
            )
        opt_config = replace(
            spec.config,
            use_distributed_optimizer=self.use_distributed_optimizer,
            **mixed.megatron_dtype_fields(self.compute_dtype),
        )
        assert self._ddp_chunks is not None
        self._megatron_optimizer = get_megatron_optimizer(opt_config, self._ddp_chunks)
        optim.use_fused_adam(self._megatron_optimizer, fused=self.root_device.type == "cuda")
        clip_grads.use_foreach_clip_grads()
        self._scheduler = build_scheduler(self._megatron_optimizer, spec, trainer)
        # What Megatron's schedule calls around the step, read from the first chunk's config.
        config = self._ddp_chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self._megatron_optimizer.scale_loss
        ddp.set_overlap_hooks(config, self._ddp_chunks)
        self.optimizers = [
            LightningOptimizerAdapter(
                self._megatron_optimizer,
                self._scheduler,
                self._record_step,
                self._should_step if self._nonfinite == "skip" else None,
            )  # fmt: skip
        ]
        self.lr_scheduler_configs = []

    def _record_step(self, stats: StepStats) -> None:
        self._last_step = stats
        self._skipped_steps += int(stats.skipped)
        if self._nonfinite == "error":
            # Megatron's own gradient norm (reduced over all ranks, read on the host by its clipping anyway): no
            # extra synchronisation in the default policy. Raised before any callback could save this step.
            guards.check_grad_norm(stats.grad_norm, self.module.trainer.global_step)

    def _should_step(self, loss: Tensor | None) -> bool:
        # nonfinite="skip": decide before the update, which costs one GPU synchronisation per step.
        assert self._ddp_chunks is not None
        fp16 = self.compute_dtype == torch.float16  # loss-scaled gradients: Megatron's scaler handles overflow
        return guards.step_is_finite(loss, self._ddp_chunks, check_grads=not fp16)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:  # type: ignore[override]
        assert self._ddp_chunks is not None
        for chunk in self._ddp_chunks:
            chunk.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()
        records = schedule.run(
            self.module, self._ddp_chunks, schedule.as_batch(batch), micro_batch_size=self.micro_batch_size,
            forward_only=False,
        )  # fmt: skip
        loss, num_tokens = schedule.reduce_loss(records, self.root_device)
        return {"loss": loss, "num_tokens": num_tokens, "host_loss": schedule.HostScalar(loss)}

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss  # Megatron's schedule already ran the backward pass

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Lightning's "16-mixed" plugin would unscale and step through a torch GradScaler; Megatron's fp16
        # optimizer owns the loss scale (and skips steps whose gradients overflow), so run the plain precision
        # step: the closure, on_before_optimizer_step, then our optimizer's step.
        plugin = self.precision_plugin
        return Precision.optimizer_step(plugin, optimizer, model or self.lightning_module, closure, **kwargs)

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:  # type: ignore[override]
        records = self._forward_only(batch, predict=False)
        loss, num_tokens = schedule.reduce_loss(records, self.root_device)
        return {"loss": loss, "num_tokens": num_tokens}

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:  # type: ignore[override]
        return schedule.gather_predictions(self._forward_only(batch, predict=True), self.root_device)

    def _forward_only(self, batch: Any, *, predict: bool) -> list[dict[str, Any]]:
        chunks = self._run_chunks or list(self.module.chunks)
        with torch.no_grad():
            return schedule.run(
                self.module, chunks, schedule.as_batch(batch), micro_batch_size=self.micro_batch_size,
                forward_only=True, predict=predict,
            )  # fmt: skip

    @override
    def sync_params(self) -> None:
        """Finish a parameter all-gather that ``overlap_param_gather`` deferred to the next forward, so the chunks
        hold the last update (done for checkpoints, HF export and at the end of training; a no-op otherwise)."""
        ddp.sync_params(self._ddp_chunks or [])

    # ------------------------------------------------------------------ offload (GPU shared with inference)
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> int:
        """Release the accelerator memory of parameters, gradients and optimizer state (main params included).

        Parameters and optimizer state are copied to pinned host memory first; gradients are dropped and come
        back zeroed (offload between optimizer steps). Every tensor object stays valid, so :meth:`reload` makes
        training continue exactly as if nothing happened. Returns the number of bytes released.
        """
        if self._offloaded is not None:
            raise RuntimeError("MegatronStrategy.offload called twice without reload()")
        self._offloaded = offload_state.offload(
            self.module.chunks, self._megatron_optimizer, params=params, grads=grads, optimizer_state=optimizer
        )
        return self._offloaded.nbytes

    def reload(self) -> None:
        """Bring back what :meth:`offload` released."""
        if self._offloaded is None:
            raise RuntimeError("MegatronStrategy.reload called without a previous offload()")
        offload_state.reload(self._offloaded)
        self._offloaded = None

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved sharded in save_checkpoint

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Tensor]:
        return {}  # the optimizer is saved sharded in save_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"MegatronStrategy.save_checkpoint takes no storage_options, got {storage_options!r}")
        saved = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self._scheduler is not None:
            saved["megatron_lr_scheduler"] = self._scheduler.state_dict()
        # The unwrapped chunks: the DDP wrappers' state-dict keys carry a "module." prefix.
        saved[sharded.MODEL_CONFIG_KEY] = sharded.model_config_dict(self.module)
        self.sync_params()  # with overlapped param gather the last step's update may be pending
        saved.update(sharded.sharded_state_dict(list(self.module.chunks), self._megatron_optimizer))
        self._writer.save(saved, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._writer.finalize()  # a checkpoint still being written by this run is published first
        chunks = list(self.module.chunks)
        loaded = sharded.load(chunks, self._megatron_optimizer, checkpoint_path, sharded.model_config_dict(self.module))
        if self._megatron_optimizer is not None:  # the loaded param groups carry the writer's fused/foreach flags
            optim.use_fused_adam(self._megatron_optimizer, fused=self.root_device.type == "cuda")
        scheduler_state = loaded.pop("megatron_lr_scheduler", None)
        if self._scheduler is not None and scheduler_state is not None:
            try:
                self._scheduler.load_state_dict(scheduler_state)
            except AssertionError as error:  # Megatron asserts that the schedule settings match
                raise ValueError(
                    f"the LR schedule saved in {checkpoint_path} differs from this run's ({error}); keep lr, min_lr, "
                    "warmup_steps and decay_steps (or Trainer(max_steps) when decay_steps=None) as they were"
                ) from error
        loaded.setdefault("state_dict", {})
        return loaded

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self._writer.remove(filepath)  # waits for pending async saves: the last good checkpoint always stays

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._writer.poll()

    @override
    def on_train_end(self) -> None:
        self.sync_params()  # the final weights, for whatever runs after fit
        self._writer.finalize()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failed = True  # peers may be dead: teardown must not wait for them

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        if self._failed:
            self._writer.abort()
        else:
            self._writer.finalize()  # e.g. trainer.save_checkpoint after fit
        self._failed = False
        if self._offloaded is not None:  # never leave a module with released storages behind
            self.reload()
        self._last_step = None
        if self._ddp_chunks:
            ddp.clear_hooks(self._ddp_chunks[0].config)
        self._ddp_chunks = None
        self._run_chunks = None
        self._megatron_optimizer = None
        self._scheduler = None
        clip_grads.restore_clip_grads()
        super().teardown()
        if _distributed_is_initialized():
            state.destroy()
        cpu.disable()


def _check_module(module: object) -> MegatronLightningModule:
    if not isinstance(module, MegatronLightningModule):
        raise TypeError(
            "MegatronStrategy trains a lightning_megatron.MegatronLightningModule (e.g. MegatronLMModule), "
            f"got {type(module).__name__}"
        )
    return module
