"""``lightning-megatron`` / ``python -m lightning_megatron``: LightningCLI for MegatronLMModule.

lightning-megatron fit --config examples/configs/tiny_cpu.yaml
lightning-megatron fit --config examples/configs/tiny_cpu.yaml --trainer.strategy.tp 2 --trainer.devices 2
lightning-megatron fit --print_config
"""

from __future__ import annotations

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from lightning_megatron.datamodule import ByteCorpusDataModule
from lightning_megatron.lm import MegatronLMModule


def main(args: list[str] | None = None) -> None:
    # ModelConfig and the parallel sizes document each field in an attribute docstring; show them in --help.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    LightningCLI(
        MegatronLMModule,
        ByteCorpusDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"strategy": {"class_path": "lightning_megatron.MegatronStrategy"}},
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the module returns Megatron's OptimizerSpec; no torch optimizer flags
    )


if __name__ == "__main__":
    main()
