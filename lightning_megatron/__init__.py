"""lightning_megatron: Megatron-Core training (TP/PP/VPP/CP/EP/SP, pipeline schedules, distributed optimizer,
sharded checkpoints) inside Lightning's ``Trainer``."""

from lightning_megatron.compat import quiet

with quiet.importing():  # megatron-core's import-time notices about Transformer Engine/apex (see quiet.py)
    from lightning_megatron import presets  # noqa: F401  (registers Trainer(strategy="megatron") & co.)
    from lightning_megatron.callbacks import MegatronThroughput
    from lightning_megatron.checkpointing.config import CheckpointConfig
    from lightning_megatron.contract import ChunkSpec, OptimizerSpec, StepStats
    from lightning_megatron.data.modules import ByteCorpusDataModule, TokenFileDataModule
    from lightning_megatron.data.packing import pack_sequences
    from lightning_megatron.data.sharding import DataParallelShard
    from lightning_megatron.gpt.config import ModelConfig, tiny_gpt
    from lightning_megatron.gpt.hf.callback import SaveHF
    from lightning_megatron.gpt.hf.finetune import MegatronLMFromHF
    from lightning_megatron.gpt.lm import MegatronLMModule
    from lightning_megatron.gpt.lora.config import LoRAConfig
    from lightning_megatron.modules.base import MegatronLightningModule
    from lightning_megatron.parallel.sizes import ParallelSizes
    from lightning_megatron.rl.value import MegatronValueModule
    from lightning_megatron.strategy import MegatronStrategy
    from lightning_megatron.training.preemption import Preempted
    from lightning_megatron.weight_averaging import MegatronEMA, MegatronWeightAveraging

__all__ = [
    "ByteCorpusDataModule",
    "CheckpointConfig",
    "ChunkSpec",
    "DataParallelShard",
    "LoRAConfig",
    "MegatronEMA",
    "MegatronLMFromHF",
    "MegatronLMModule",
    "MegatronLightningModule",
    "MegatronStrategy",
    "MegatronThroughput",
    "MegatronValueModule",
    "MegatronWeightAveraging",
    "ModelConfig",
    "OptimizerSpec",
    "ParallelSizes",
    "Preempted",
    "SaveHF",
    "StepStats",
    "TokenFileDataModule",
    "pack_sequences",
    "tiny_gpt",
]
