"""GPTModule: the shared base of the GPT family's LightningModules, one model chunk per pipeline stage / VPP chunk."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_megatron.checkpointing.sharded import MODEL_CONFIG_KEY
from lightning_megatron.compat import lightning_internals
from lightning_megatron.contract import Batch, ChunkSpec, ModelHooks, OptimizerSpec
from lightning_megatron.gpt import specs
from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.gpt.lora.config import LoRAConfig, check_lora, check_lora_parallel
from lightning_megatron.gpt.lora.frozen_base import adopt_saved_base, base_source
from lightning_megatron.gpt.moe import routing
from lightning_megatron.gpt.moe.router import router_losses
from lightning_megatron.gpt.optim import DEFAULT_OPTIMIZER, DecayStyle, OptimizerSettings
from lightning_megatron.gpt.plan import KernelPlan, Resolved
from lightning_megatron.gpt.sequences import RankTokens, rank_tokens, without_default_positions
from lightning_megatron.modules.base import MegatronLightningModule
from lightning_megatron.parallel import state
from lightning_megatron.training import guards

if TYPE_CHECKING:
    from lightning_megatron.gpt.hf.load import HFCheckpoint
    from lightning_megatron.parallel.sizes import ParallelSizes


class GPTModule(MegatronLightningModule):
    """What every LightningModule on a Megatron-Core ``GPTModel`` shares: the model (:class:`ModelConfig`, its
    kernel plan, LoRA, weights from Hugging Face), this rank's tokens of a batch (packed documents, the CP slice),
    MoE routing replay and the optimizer. Subclasses add the head's objective: :class:`MegatronLMModule` (the
    causal-LM head) and :class:`~lightning_megatron.MegatronValueModule` (a scalar head); they take these arguments
    through ``**kwargs``. The optimizer arguments (``lr`` to ``override_lr_schedule``) are kept as one
    :class:`~lightning_megatron.gpt.optim.OptimizerSettings` (:attr:`optimizer_settings`), which checks them.

    Args:
        config: the model.
        lr: peak learning rate.
        min_lr: learning rate at the end of the decay.
        weight_decay: AdamW weight decay.
        betas: Adam betas.
        eps: Adam epsilon.
        clip_grad: global gradient-norm clip (0 disables); done by Megatron's optimizer.
        warmup_steps: linear LR warm-up steps.
        decay_steps: LR decay steps; ``None`` decays over the Trainer's total steps.
        decay_style: LR decay shape.
        override_lr_schedule: on resume, follow this module's LR schedule (train longer, another warm-up or decay)
            from the checkpoint's step instead of raising when it differs from the saved one
            (:attr:`OptimizerSpec.override_lr_schedule`); a switch for that resume, not saved with the model.
        lora: low-rank adapters (:class:`~lightning_megatron.LoRAConfig`, or its fields as a dict) on the chosen
            linears of every transformer layer; everything else is frozen (a value module's new head excepted).
    """

    hf_checkpoint: HFCheckpoint | None = None
    """The HF model directory :meth:`from_hf` read; ``build_chunk`` loads this rank's shard of it into each chunk."""
    hf_adapter: HFCheckpoint | None = None
    """The PEFT adapter directory :meth:`from_hf` was given; ``build_chunk`` loads it into the LoRA factors."""
    plan: KernelPlan | None = None
    """How the chunks are built on this rank's device (:class:`~lightning_megatron.gpt.plan.KernelPlan`), resolved
    once when the first chunk is built."""

    @classmethod
    def from_hf(
        cls,
        path: str | Path,
        *,
        seq_length: int | None = None,
        config_overrides: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        adapter: str | Path | None = None,
        **module_kwargs: Any,
    ) -> Self:
        """A module initialised from a local HF directory (config.json + safetensors, one file or sharded).

        Causal LMs of the families in ``gpt/hf/families/``: dense Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3
        (text); mixture of experts Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 (Multi-Latent Attention), GLM-4.5 and
        GPT-OSS. Only
        config.json and the safetensors headers are read here (names and shapes are checked now, before any process
        starts); the weights are read when the strategy builds the model, each rank reading only the slices of its
        tensor-/pipeline-/expert-parallel shard.

        Args:
            path: the model directory.
            seq_length: longest sequence to train on; default ``max_position_embeddings`` (capped by a sliding
                attention window).
            config_overrides: other :class:`~lightning_megatron.ModelConfig` fields to change (dropout,
                recompute, ...); architecture fields must keep matching the weights.
            allow_pickle: read PyTorch pickle weights (``pytorch_model.bin``) when there are no safetensors; only
                for trusted directories (read with ``torch.load(weights_only=True)``). Off: such weights raise.
            adapter: a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, e.g.
                from ``PeftModel.save_pretrained`` or ``save_hf(adapter=True)``) to start the adapters from; its
                rank, alpha and targets become the module's ``lora`` (a ``lora=`` given too must match them).
            module_kwargs: the module's arguments (``lr``, ``warmup_steps``, ``lora``, ...).
        """
        from lightning_megatron.gpt.hf.pretrained import open_hf

        lora = module_kwargs.pop("lora", None)  # an adapter's settings replace it
        hf = open_hf(
            path,
            seq_length=seq_length,
            config_overrides=config_overrides,
            allow_pickle=allow_pickle,
            adapter=adapter,
            lora=lora,
        )
        module = cls(hf.config, lora=hf.lora, **module_kwargs)
        module.hf_checkpoint, module.hf_adapter = hf.checkpoint, hf.adapter
        return module

    def __init__(
        self,
        config: ModelConfig,
        lr: float = DEFAULT_OPTIMIZER.lr,
        min_lr: float = DEFAULT_OPTIMIZER.min_lr,
        weight_decay: float = DEFAULT_OPTIMIZER.weight_decay,
        betas: tuple[float, float] = DEFAULT_OPTIMIZER.betas,
        eps: float = DEFAULT_OPTIMIZER.eps,
        clip_grad: float = DEFAULT_OPTIMIZER.clip_grad,
        warmup_steps: int = DEFAULT_OPTIMIZER.warmup_steps,
        decay_steps: int | None = DEFAULT_OPTIMIZER.decay_steps,
        decay_style: DecayStyle = DEFAULT_OPTIMIZER.decay_style,
        override_lr_schedule: bool = DEFAULT_OPTIMIZER.override_lr_schedule,
        lora: LoRAConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._routing_record: dict[int, list] | None = None  # set while record_routing runs
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a lightning_megatron.ModelConfig, got {type(config).__name__}")
        self.optimizer_settings = OptimizerSettings(
            lr=lr,
            min_lr=min_lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            clip_grad=clip_grad,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            decay_style=decay_style,
            override_lr_schedule=override_lr_schedule,
        )
        self.config = config
        self.lora = LoRAConfig(**lora) if isinstance(lora, dict) else lora
        if self.lora is not None:
            check_lora(self.lora, config)
        # override_lr_schedule is not saved: a module loaded from a checkpoint resumes strictly again.
        self.save_hyperparameters(ignore=["config", "lora", "override_lr_schedule"])
        if self.lora is not None:  # a plain dict: checkpoints unpickle only tensors, containers and numbers
            self.hparams["lora"] = dataclasses.asdict(self.lora)

    @property
    def kernels(self) -> Resolved:
        """The kernel set the chunks were built with (``ModelConfig.kernels`` resolved for the device)."""
        return "local" if self.plan is None else self.plan.kernels

    @property
    def fused_wgrad(self) -> bool:
        """Whether the chunks' parallel linears accumulate weight gradients into ``main_grad`` in the GEMM."""
        return self.plan is not None and self.plan.fused_wgrad

    @property
    def fp8(self) -> bool:
        """Whether the chunks' transformer layers run their linears' GEMMs in fp8 (``ModelConfig.fp8``)."""
        return self.plan is not None and self.plan.fp8

    def validate_parallel(self, sizes: ParallelSizes) -> None:
        self.config.validate_parallel(sizes)
        if self.lora is not None:
            check_lora_parallel(self.lora, self.config, sizes.tp)
        trainer = lightning_internals.attached_trainer(self)  # connect may run before the module is attached
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and self.config.num_moe_experts is not None and sizes.tp > 1 and not sizes.sequence_parallel:
            # Megatron's MoE layer refuses to train so (its dispatcher would gather every token on every TP rank).
            replay = " (routing replay refuses sequence parallelism: use tp=1)"
            replay = replay if self.config.moe_enable_routing_replay else ""
            raise ValueError(
                f"training an MoE model at tp={sizes.tp} needs MegatronStrategy(sequence_parallel=True): Megatron's "
                "MoE layer refuses tensor parallelism without it in training (validate/predict run either way); set "
                f"sequence_parallel=True, or split the experts with ep instead of tp{replay}"
            )

    def model_hooks(self) -> ModelHooks:
        from lightning_megatron.gpt.hooks import GPTHooks

        return GPTHooks(self.config)  # MoE permutation, fp8 weight casts, CUDA graphs (gpt/hooks.py)

    def step_metrics(self) -> Mapping[str, Tensor]:
        """The routers' losses of an MoE model (``moe_aux_loss``, ``moe_z_loss``:
        :mod:`lightning_megatron.gpt.moe.router`)."""
        return router_losses(self.config, self.chunks)

    def configure_model(self) -> None:
        super().configure_model()
        assert self.plan is not None  # build_chunk resolved it
        rank_zero_info(f"lightning_megatron: {self.plan.describe(self.config.fp8)}")

    @classmethod
    def init_args_from_checkpoint(cls, common: Mapping[str, Any]) -> dict[str, Any]:
        # The ModelConfig is saved on its own (not among the hyper-parameters).
        return {**super().init_args_from_checkpoint(common), "config": ModelConfig(**common[MODEL_CONFIG_KEY])}

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str | Path,
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """As :meth:`MegatronLightningModule.load_from_checkpoint` (Lightning's arguments included); with LoRA, also
        from a checkpoint holding only adapters (its frozen base is read from where the checkpoint says: an HF
        directory or another checkpoint), and, with ``lora=`` given, from a checkpoint without adapters: its weights
        become the frozen base of new, seeded adapters."""
        lightning = {"map_location": map_location, "hparams_file": hparams_file, "strict": strict}
        module = super().load_from_checkpoint(checkpoint_path, weights_only=weights_only, **lightning, **kwargs)
        if module.lora is not None and module.hf_checkpoint is None:  # MegatronLMFromHF: the base is its hf_path
            adopt_saved_base(module, checkpoint_path, cls.__name__)
        return module

    def frozen_base(self) -> dict[str, str] | None:
        """With LoRA, where the frozen base weights come from (so checkpoints hold only the adapters): the HF
        directory of :meth:`from_hf` or the checkpoint :meth:`load_from_checkpoint` took them from
        (:func:`lightning_megatron.gpt.lora.frozen_base.base_source`)."""
        return base_source(self.lora, self.hf_checkpoint, self.base_checkpoint)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # On the host, before the batch reaches the accelerator: bad token ids fail here with the field and
        # value named, not as an index error inside an embedding kernel (or silently, on some devices).
        guards.check_token_batch(batch, self.config.vocab_size, self.config.seq_length)
        return without_default_positions(batch)

    def build_chunk(self, spec: ChunkSpec) -> nn.Module:
        from megatron.core.models.gpt import GPTModel

        if self.plan is None:  # resolved once, for the first chunk; every chunk of a rank shares the device
            self.plan = KernelPlan.resolve(
                self.config, spec.device_type, hf_weights=self.hf_checkpoint is not None, lora=self.lora is not None
            )
            if self.plan.cuda_graphs:
                state.graph_safe_rng()  # before the layers are built: Megatron checks the tracker there
        plan = self.plan
        config = self.config.to_transformer_config(
            kernels=plan.kernels, compile_fusions=spec.device_type == "cuda", **spec.parallel
        )
        layers = specs.block_spec(
            self.config, config, spec.vp_stage, plan.kernels, plan.fused_wgrad, plan.fp8, lora=self.lora
        )
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layers,
            pre_process=spec.pre_process,
            post_process=spec.post_process,
            vp_stage=spec.vp_stage,
            **self.config.gpt_model_kwargs(plan.kernels),
        )
        if self.config.scale_embeddings and spec.pre_process:
            from lightning_megatron.gpt.gemma_layers import scale_embeddings

            scale_embeddings(chunk)
        if self.config.final_logit_softcapping is not None and spec.post_process:
            from lightning_megatron.gpt.gemma_layers import softcap_logits

            softcap_logits(chunk, self.config.final_logit_softcapping)
        if plan.fused_wgrad and spec.post_process:
            from lightning_megatron.kernels.linear import fuse_lm_head

            fuse_lm_head(chunk.output_layer)
        if self.hf_checkpoint is not None:
            from lightning_megatron.gpt.hf.load import load_chunk

            load_chunk(chunk, self.hf_checkpoint, self.config, spec.vp_stage)
        if self.lora is not None:
            from lightning_megatron.gpt.lora.layers import init_adapters

            init_adapters(chunk, self.lora)  # also freezes everything but the adapters
            if self.hf_adapter is not None:
                from lightning_megatron.gpt.hf.load import load_adapter_chunk

                load_adapter_chunk(chunk, self.hf_adapter, self.config, self.lora, spec.vp_stage)
        return chunk

    def forward_predict(self, batch: Batch, model: nn.Module) -> Tensor:
        return self._routed_forward(self.rank_tokens(batch), batch, model)  # logits [B, S, V/tp] on the last stage

    def rank_tokens(self, batch: Batch) -> RankTokens:
        """This rank's tokens of a micro-batch: packed documents (``position_ids``) and the CP slice."""
        if self.config.cuda_graphs:  # every micro-batch, training and inference alike: shapes only, no sync
            guards.check_graphable_batch(batch, self.config.seq_length)
        tokens = rank_tokens(batch)
        if tokens.layout is not None and self.kernels != "torch" and "position_ids" in batch:
            raise ValueError(
                f"a packed batch (position_ids) needs attention that stays inside each document; the chunks were "
                f"built with kernels={self.kernels!r} (Megatron's {'reference' if self.kernels == 'local' else 'TE'} "
                "attention, no document masks); use ModelConfig(kernels='torch')"
            )
        return tokens

    def _routed_forward(self, tokens: RankTokens, batch: Batch, model: nn.Module) -> Tensor:
        """One chunk's forward, with MoE routing replayed from ``batch["routing"]`` or recorded when asked."""
        # SDPAttention takes the layout; TE's attention splits CP sequences itself from the sliced tokens.
        layout = tokens.layout if self.kernels == "torch" else None
        if not self.config.moe_enable_routing_replay:
            return model(tokens.input_ids, tokens.position_ids, None, packed_seq_params=layout)
        input_ids = tokens.input_ids
        if "routing" in batch:
            routing.replay(model, batch["routing"])
        elif self._routing_record is not None:
            routing.start_recording(model)
        else:
            routing.route_normally(model)
        output = model(input_ids, tokens.position_ids, None, packed_seq_params=layout)
        if self._routing_record is not None and "routing" not in batch:
            # Micro-batches reach each chunk in order: the n-th call of a chunk is the n-th micro-batch.
            calls = self._routing_record.setdefault(id(model), [])
            start = len(calls) * input_ids.shape[0]
            calls.append((start, routing.recorded(model, input_ids.shape[0], input_ids.shape[1])))
        return output

    def record_routing(self, batch: Batch | Tensor) -> Tensor:
        """The expert routing of a forward pass over ``batch``: LongTensor [B, num_layers, S, topk] on every rank.

        Collective, forward-only (like :meth:`compute_logprobs`). Put the result into a training batch as
        ``batch["routing"]`` (split into micro-batches with the rest) to make that step route exactly so; routing
        recorded elsewhere (an inference engine) in the same layout works too. Needs
        ``ModelConfig(moe_enable_routing_replay=True)``.
        """
        if not self.config.moe_enable_routing_replay:
            raise ValueError("record_routing needs ModelConfig(moe_enable_routing_replay=True) on an MoE model")
        tokens = batch if isinstance(batch, Tensor) else batch["input_ids"]
        self._routing_record = {}
        try:
            self.trainer.strategy.predict_step(batch, 0)
            parts = [part for calls in self._routing_record.values() for part in calls]
        finally:
            self._routing_record = None
        c = self.config
        return routing.assemble(parts, tokens.shape[0], c.num_layers, tokens.shape[1], c.moe_router_topk, tokens.device)

    def configure_optimizers(self) -> OptimizerSpec:  # type: ignore[override]
        # hparams win: Lightning's Tuner.lr_find (update_attr=True) writes its suggestion into hparams.lr.
        return self.optimizer_settings.updated(self.hparams).spec()
