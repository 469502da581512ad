"""Fine-tuning from a Hugging Face checkpoint, spelled as a class so LightningCLI configs can name it."""

from __future__ import annotations

from typing import Any

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
