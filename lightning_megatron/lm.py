"""MegatronLMModule: a Megatron-Core GPT with a causal-LM head, one model chunk per pipeline stage / VPP chunk."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_megatron.config import ModelConfig
from lightning_megatron.module import ChunkSpec, MegatronLightningModule, OptimizerSpec
from lightning_megatron.schedule import Batch, LossFn

IGNORE_INDEX = -100


def shift_labels(batch: Batch) -> tuple[Tensor, Tensor]:
    """HF causal-LM labels -> Megatron targets: position t predicts token t+1.

    ``labels`` (default: ``input_ids``) are unshifted, ``-100`` ignored; ``loss_mask`` and ``attention_mask``
    ([B, S], aligned with the tokens) drop positions too. Returns ``targets`` [B, S] (ignored positions hold
    0, a valid index for the vocab-parallel cross entropy) and the float ``mask`` [B, S].
    """
    labels = batch.get("labels", batch["input_ids"])
    keep = labels != IGNORE_INDEX
    for name in ("loss_mask", "attention_mask"):
        if name in batch:
            keep = keep & batch[name].bool()
    targets = torch.zeros_like(labels)
    mask = torch.zeros_like(labels, dtype=torch.float32)
    targets[:, :-1] = torch.where(keep[:, 1:], labels[:, 1:], 0)  # [B, S-1] shifted left by one
    mask[:, :-1] = keep[:, 1:].float()  # the last position has no next token
    return targets, mask


def position_ids(input_ids: Tensor) -> Tensor:
    batch, seq = input_ids.shape
    return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)


class MegatronLMModule(MegatronLightningModule):
    """A GPT (Megatron-Core ``GPTModel``, local layer spec) trained with the causal-LM loss.

    Batches are HF-style: ``input_ids`` [B, S], optional ``labels`` (unshifted, ``-100`` ignored),
    ``attention_mask`` and ``loss_mask``; a bare LongTensor is ``input_ids`` with ``labels = input_ids``. The
    loss is token-weighted across micro-batches and data-parallel ranks. ``trainer.predict`` returns full-vocab
    logits [B, S, V] on every rank.

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
    """

    def __init__(
        self,
        config: ModelConfig,
        lr: float = 3e-4,
        min_lr: float = 0.0,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        warmup_steps: int = 0,
        decay_steps: int | None = None,
        decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine",
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a lightning_megatron.ModelConfig, got {type(config).__name__}")
        if lr <= 0:
            raise ValueError(f"lr={lr} must be positive")
        if not 0 <= min_lr <= lr:
            raise ValueError(f"min_lr={min_lr} must be in [0, lr={lr}]")
        self.config = config
        self.save_hyperparameters(ignore=["config"])
        self.optimizer_settings: dict[str, Any] = {
            "lr": lr, "min_lr": min_lr, "weight_decay": weight_decay, "betas": betas, "eps": eps,
            "clip_grad": clip_grad, "warmup_steps": warmup_steps, "decay_steps": decay_steps,
            "decay_style": decay_style,
        }  # fmt: skip

    def build_chunk(self, spec: ChunkSpec) -> nn.Module:
        from megatron.core.models.gpt import GPTModel

        config = self.config.to_transformer_config(**spec.parallel)
        return GPTModel(
            config=config,
            transformer_layer_spec=self.config.block_spec(config, spec.vp_stage),
            pre_process=spec.pre_process,
            post_process=spec.post_process,
            vp_stage=spec.vp_stage,
            **self.config.gpt_model_kwargs(),
        )

    def forward_step(self, batch: Batch, model: nn.Module) -> tuple[Tensor, LossFn]:
        input_ids = batch["input_ids"]
        targets, mask = shift_labels(batch)
        # On the last stage GPTModel returns the per-token loss [B, S] (vocab-parallel cross entropy); on the
        # others, hidden states for the next stage.
        output = model(input_ids, position_ids(input_ids), None, labels=targets)

        def loss_fn(per_token_loss: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            return (per_token_loss.float() * mask).sum(), mask.sum().to(torch.int), {}

        return output, loss_fn

    def forward_predict(self, batch: Batch, model: nn.Module) -> Tensor:
        input_ids = batch["input_ids"]
        return model(input_ids, position_ids(input_ids), None)  # logits [B, S, V/tp] on the last stage

    def predict_output(self, batch: Batch, output: Tensor) -> Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(output)  # [B, S, V/tp] -> [B, S, V]

    def configure_optimizers(self) -> OptimizerSpec:  # type: ignore[override]
        from megatron.core.optimizer import OptimizerConfig

        s = self.optimizer_settings
        config = OptimizerConfig(
            optimizer="adam", lr=s["lr"], min_lr=s["min_lr"], weight_decay=s["weight_decay"],
            adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], adam_eps=s["eps"], clip_grad=s["clip_grad"],
        )  # fmt: skip
        return OptimizerSpec(
            config=config,
            lr_warmup_steps=s["warmup_steps"],
            lr_decay_steps=s["decay_steps"],
            lr_decay_style=s["decay_style"],
        )
