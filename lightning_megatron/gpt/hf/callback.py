"""``SaveHF``: the trained model written as a Hugging Face directory when training ends."""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch

from lightning_megatron.gpt.lm import MegatronLMModule


class SaveHF(L.Callback):
    """Write the trained model as an HF directory when training ends (``MegatronLMModule.save_hf``, collective).

    For configs: ``callbacks: [{class_path: lightning_megatron.SaveHF, init_args: {path: out/hf}}]``.

    Args:
        path: the directory to write (config.json + safetensors; the source's tokenizer files when fine-tuned
            from an HF directory). A LoRA module's weights are written merged (base + adapters).
        dtype: dtype of the written tensors; ``None`` keeps the parameters' (bf16 under ``bf16-mixed``).
        adapter: write a LoRA module's adapters alone as a PEFT adapter directory (``adapter_config.json`` +
            ``adapter_model.safetensors``) instead.
    """

    def __init__(
        self, path: str, dtype: Literal["bfloat16", "float16", "float32"] | None = None, adapter: bool = False
    ) -> None:
        self.path = path
        self.dtype = getattr(torch, dtype) if dtype else None
        self.adapter = adapter

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.adapter and getattr(pl_module, "lora", None) is None:  # fail now, not after the whole run
            raise ValueError(
                "SaveHF(adapter=True) writes LoRA adapters, and this module has none: give it lora=LoRAConfig(...), "
                "or use SaveHF(path) for the whole model"
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, MegatronLMModule):
            raise TypeError(
                f"SaveHF saves a MegatronLMModule, got {type(pl_module).__name__}: a value model (scalar head) or "
                "another head has no Hugging Face causal-LM counterpart; save it with ModelCheckpoint"
            )
        pl_module.save_hf(self.path, dtype=self.dtype, adapter=self.adapter)  # every rank: gathers over TP and PP
