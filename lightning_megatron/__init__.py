"""lightning_megatron: Megatron-Core training (TP/PP/VPP/CP/EP/SP, pipeline schedules, distributed optimizer,
sharded checkpoints) inside Lightning's ``Trainer``."""

from lightning_megatron import presets  # noqa: F401  (registers Trainer(strategy="megatron_tp2") & co.)
from lightning_megatron.config import ModelConfig, tiny_gpt
from lightning_megatron.finetune import MegatronLMFromHF
from lightning_megatron.lm import MegatronLMModule
from lightning_megatron.module import ChunkSpec, MegatronLightningModule, OptimizerSpec
from lightning_megatron.strategy import MegatronStrategy, StepStats
from lightning_megatron.throughput import MegatronThroughput
from lightning_megatron.value import MegatronValueModule

__all__ = [
    "ChunkSpec",
    "MegatronLMFromHF",
    "MegatronLMModule",
    "MegatronLightningModule",
    "MegatronStrategy",
    "MegatronThroughput",
    "MegatronValueModule",
    "ModelConfig",
    "OptimizerSpec",
    "StepStats",
    "tiny_gpt",
]
