"""What a module built from a Hugging Face directory reads before it exists: the model directory and its
:class:`~lightning_megatron.ModelConfig`, and an optional PEFT LoRA adapter (``GPTModule.from_hf`` and
``MegatronLMFromHF`` both start here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.gpt.hf.load import HFCheckpoint, open_pretrained
from lightning_megatron.gpt.hf.peft import with_adapter
from lightning_megatron.gpt.lora.config import LoRAConfig


@dataclass(frozen=True)
class Pretrained:
    """An HF model directory opened for a module, checked against its config (and the adapter against both)."""

    config: ModelConfig
    """The module's model, from config.json (and the overrides)."""
    checkpoint: HFCheckpoint
    """The model directory; each rank reads its shard of the weights when the strategy builds the chunks."""
    adapter: HFCheckpoint | None
    """The PEFT adapter directory, if one was given."""
    lora: LoRAConfig | dict[str, Any] | None
    """The module's ``lora``: the adapter's rank, alpha and targets when there is one, else what was passed."""


def open_hf(
    path: str | Path,
    *,
    seq_length: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    adapter: str | Path | None = None,
    lora: LoRAConfig | dict[str, Any] | None = None,
) -> Pretrained:
    """Open the model directory ``path`` and the ``adapter`` directory (see ``GPTModule.from_hf`` for the
    arguments); ``lora`` is the module's, which an adapter's settings must match."""
    checkpoint, config = open_pretrained(
        path, seq_length=seq_length, config_overrides=config_overrides, allow_pickle=allow_pickle
    )
    hf_adapter, lora = with_adapter(adapter, config, lora)
    return Pretrained(config=config, checkpoint=checkpoint, adapter=hf_adapter, lora=lora)
