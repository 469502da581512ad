"""Fine-tuning from a Hugging Face checkpoint, spelled as a class that LightningCLI configs can name
(:class:`MegatronLMFromHF`); the callback that writes the result back as an HF directory is
:class:`~lightning_megatron.SaveHF`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from lightning_megatron.gpt.hf.pretrained import open_hf
from lightning_megatron.gpt.lm import MegatronLMModule


class MegatronLMFromHF(MegatronLMModule):
    """:meth:`MegatronLMModule.from_hf` as a constructor: ``class_path: lightning_megatron.MegatronLMFromHF``.

    LightningCLI builds modules from ``class_path`` + ``init_args``, so a classmethod cannot be named in a YAML
    config; this subclass takes the HF directory instead of a ``ModelConfig`` and is otherwise the same module
    (every other argument is ``MegatronLMModule``'s). Only ``config.json`` and the safetensors headers are read
    here; each rank reads its shard of the weights when the strategy builds the model.

    Args:
        hf_path: a local HF model directory (config.json + safetensors): dense Llama, Mistral, Qwen2 or Qwen3;
            mixture of experts Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 or GLM-4.5.
        seq_length: longest sequence to train on; default ``max_position_embeddings`` (capped by a sliding window).
        config_overrides: other ``ModelConfig`` fields to change (dropout, recompute, ...); architecture fields
            must keep matching the weights.
        allow_pickle: read PyTorch pickle weights (``pytorch_model.bin``) when there are no safetensors; only for
            trusted directories (read with ``torch.load(weights_only=True)``).
        adapter: a PEFT LoRA adapter directory to start the adapters from (see ``MegatronLMModule.from_hf``).
        kwargs: ``MegatronLMModule``'s arguments (``lr``, ``warmup_steps``, ``clip_grad``, ``lora``, ...).
    """

    def __init__(
        self,
        hf_path: str,
        seq_length: int | None = None,
        config_overrides: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        adapter: str | None = None,
        **kwargs: Any,
    ) -> None:
        hf = open_hf(
            hf_path,
            seq_length=seq_length,
            config_overrides=config_overrides,
            allow_pickle=allow_pickle,
            adapter=adapter,
            lora=kwargs.get("lora"),
        )
        # Replaced in kwargs, not passed apart: LightningCLI then types ``lora`` from MegatronLMModule's signature.
        kwargs["lora"] = hf.lora
        super().__init__(hf.config, **kwargs)
        self.hf_checkpoint, self.hf_adapter = hf.checkpoint, hf.adapter

    @classmethod
    def init_args_from_checkpoint(cls, common: Mapping[str, Any]) -> dict[str, Any]:
        # The model comes from hf_path again (its weights are then replaced by the checkpoint's).
        return dict(common.get("hyper_parameters") or {})

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
        """The same as the constructor (the parent's classmethod would pass a ``ModelConfig`` as ``hf_path``): a
        module of any family ``MegatronLMModule.from_hf`` reads (dense Llama, Mistral, Qwen2, Qwen3; mixture of
        experts Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4.5)."""
        adapter = None if adapter is None else str(adapter)
        kwargs = {"seq_length": seq_length, "config_overrides": config_overrides, "allow_pickle": allow_pickle}
        return cls(str(path), adapter=adapter, **kwargs, **module_kwargs)
