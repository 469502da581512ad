"""Where a LoRA module's frozen base weights come from, so that its checkpoints need hold only the adapters.

A module with adapters trains only them. Its base is an HF directory (``from_hf``) or a MegatronStrategy checkpoint
(``load_from_checkpoint(path, lora=...)`` of a checkpoint saved without adapters). :func:`base_source` names it for
the checkpoint (``checkpointing.sharded.FROZEN_BASE_KEY`` in the common state), and :func:`adopt_saved_base` reads it
back when such a checkpoint is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lightning_megatron.checkpointing import opening, sharded
from lightning_megatron.gpt.hf.load import HFCheckpoint
from lightning_megatron.gpt.lora.config import LoRAConfig

if TYPE_CHECKING:
    from lightning_megatron.gpt.config import ModelConfig


class LoRAModule(Protocol):
    """What these functions read and set of a GPT module."""

    config: ModelConfig
    lora: LoRAConfig | None
    hf_checkpoint: HFCheckpoint | None
    base_checkpoint: str | None
    weights_checkpoint: str | None


def base_source(
    lora: LoRAConfig | None, hf_checkpoint: HFCheckpoint | None, base_checkpoint: str | None
) -> dict[str, str] | None:
    """With LoRA, where the frozen base weights come from: the HF directory (and a fingerprint of its files, so a
    moved copy is recognised and other weights at the same path are not), or the checkpoint they were read from;
    ``None`` without LoRA (checkpoints then hold every weight) or without a known base."""
    if lora is None:
        return None
    if hf_checkpoint is not None:
        return {"hf": str(hf_checkpoint.path.resolve()), "fingerprint": hf_checkpoint.fingerprint}
    return None if base_checkpoint is None else {"checkpoint": str(Path(base_checkpoint).resolve())}


def adopt_saved_base(module: LoRAModule, checkpoint_path: str | Path, class_name: str) -> None:
    """Point ``module`` (with LoRA, just built by ``load_from_checkpoint``) at the frozen base the checkpoint names:
    its HF directory (checked against the module's config) or its base checkpoint. A checkpoint saved without
    adapters becomes the base itself, under new, seeded adapters."""
    common = opening.read_common_state(checkpoint_path)
    base = common.get(sharded.FROZEN_BASE_KEY)
    if base is not None and "hf" in base:
        try:
            module.hf_checkpoint = HFCheckpoint.open(base["hf"])
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"{checkpoint_path} holds LoRA adapters whose frozen base was {base['hf']}: {error}. With the base "
                f"elsewhere, build the module with {class_name}.from_hf(new_path, lora=...) and pass "
                "ckpt_path= to trainer.fit / validate / test / predict (the base's files are checked to match)"
            ) from error
        module.hf_checkpoint.check(module.config)
    elif base is not None:
        module.base_checkpoint = base["checkpoint"]
    elif not (common.get("hyper_parameters") or {}).get("lora"):  # saved without adapters: the new base
        module.base_checkpoint, module.weights_checkpoint = str(checkpoint_path), None
