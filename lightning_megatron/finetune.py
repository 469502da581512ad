"""Fine-tuning from a Hugging Face checkpoint, spelled as classes that LightningCLI configs can name: the module
(:class:`MegatronLMFromHF`) and a callback that writes the result back as an HF directory (:class:`SaveHF`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

import lightning as L
import torch

from lightning_megatron.config import ModelConfig
from lightning_megatron.lm import MegatronLMModule


class MegatronLMFromHF(MegatronLMModule):
    """:meth:`MegatronLMModule.from_hf` as a constructor: ``class_path: lightning_megatron.MegatronLMFromHF``.

    LightningCLI builds modules from ``class_path`` + ``init_args``, so a classmethod cannot be named in a YAML
    config; this subclass takes the HF directory instead of a ``ModelConfig`` and is otherwise the same module
    (every other argument is ``MegatronLMModule``'s). Only ``config.json`` and the safetensors headers are read
    here; each rank reads its shard of the weights when the strategy builds the model.

    Args:
        hf_path: a local HF model directory (config.json + safetensors): Llama, Mistral, Qwen2 or Qwen3.
        seq_length: longest sequence to train on; default ``max_position_embeddings`` (capped by a sliding window).
        config_overrides: other ``ModelConfig`` fields to change (dropout, recompute, ...); architecture fields
            must keep matching the weights.
        kwargs: ``MegatronLMModule``'s arguments (``lr``, ``warmup_steps``, ``clip_grad``, ...).
    """

    def __init__(
        self, hf_path: str, seq_length: int | None = None, config_overrides: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        from lightning_megatron.hf import HFCheckpoint

        checkpoint = HFCheckpoint.open(hf_path)
        config = ModelConfig.from_hf(checkpoint.config, seq_length=seq_length, **(config_overrides or {}))
        checkpoint.check(config)
        super().__init__(config, **kwargs)
        self.hf_checkpoint = checkpoint

    @classmethod
    def from_hf(
        cls, path: str | Path, *, seq_length: int | None = None, config_overrides: dict[str, Any] | None = None,
        **module_kwargs: Any,
    ) -> Self:  # fmt: skip
        """The same as the constructor (the parent's classmethod would pass a ``ModelConfig`` as ``hf_path``)."""
        return cls(str(path), seq_length=seq_length, config_overrides=config_overrides, **module_kwargs)


class SaveHF(L.Callback):
    """Write the trained model as an HF directory when training ends (``MegatronLMModule.save_hf``, collective).

    For configs: ``callbacks: [{class_path: lightning_megatron.finetune.SaveHF, init_args: {path: out/hf}}]``.

    Args:
        path: the directory to write (config.json + safetensors; the source's tokenizer files when fine-tuned
            from an HF directory).
        dtype: dtype of the written tensors; ``None`` keeps the parameters' (bf16 under ``bf16-mixed``).
    """

    def __init__(self, path: str, dtype: Literal["bfloat16", "float16", "float32"] | None = None) -> None:
        self.path = path
        self.dtype = getattr(torch, dtype) if dtype else None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, MegatronLMModule):
            raise TypeError(f"SaveHF saves a MegatronLMModule, got {type(pl_module).__name__}")
        pl_module.save_hf(self.path, dtype=self.dtype)  # every rank: the export gathers over TP and PP
