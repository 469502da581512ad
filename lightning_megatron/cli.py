"""``lightning-megatron`` / ``python -m lightning_megatron``: LightningCLI for Megatron modules and any data module.

lightning-megatron fit --config examples/configs/tiny_cpu.yaml
lightning-megatron fit --config examples/configs/tiny_cpu.yaml --trainer.strategy.tp 2 --trainer.devices 2
lightning-megatron fit --print_config
"""

from __future__ import annotations

import lightning as L
from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning_megatron.modules.base import MegatronLightningModule


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The CLI over ``args`` (default: ``sys.argv``); ``run=False`` only builds the Trainer, model and data."""
    # ModelConfig and the parallel sizes document each field in an attribute docstring; show them in --help.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # Base classes, so configs can name any module (MegatronLMModule, MegatronLMFromHF, MegatronValueModule, yours)
    # and any data module (ByteCorpusDataModule, TokenFileDataModule, yours) by class_path.
    return LightningCLI(
        MegatronLightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"strategy": {"class_path": "lightning_megatron.MegatronStrategy"}},
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the module returns Megatron's OptimizerSpec; no torch optimizer flags
    )


def main(args: ArgsType = None) -> None:
    build_cli(args)


if __name__ == "__main__":
    main()
