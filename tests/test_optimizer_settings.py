"""The GPT modules' optimizer settings (``gpt/optim.py``): one dataclass, checked once, behind the flat keyword
arguments users pass (``MegatronLMModule(config, lr=1e-3)``, ``lr:`` in a LightningCLI YAML)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_megatron import MegatronLMModule, MegatronValueModule, tiny_gpt
from lightning_megatron.gpt.model import GPTModule
from lightning_megatron.gpt.optim import DEFAULT_OPTIMIZER, OptimizerSettings


def test_the_module_arguments_are_the_dataclass_fields_with_its_defaults() -> None:
    parameters = inspect.signature(GPTModule.__init__).parameters
    fields = dataclasses.fields(OptimizerSettings)
    assert [name for name in parameters if name not in ("self", "config", "lora")] == [f.name for f in fields]
    for field in fields:
        assert parameters[field.name].default == getattr(DEFAULT_OPTIMIZER, field.name), field.name


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"lr": 0}, r"lr=0 must be positive"),
        ({"lr": float("nan")}, r"lr=nan must be a finite number"),
        ({"lr": True}, r"lr=True must be a finite number"),
        ({"min_lr": 1e-2}, r"min_lr=0.01 must be in \[0, lr=0.0003\]"),
        ({"min_lr": -1.0}, r"min_lr=-1.0 must be in \[0, lr=0.0003\]"),
        ({"weight_decay": -0.1}, r"weight_decay=-0.1 must be >= 0"),
        ({"betas": (0.9,)}, r"betas=\(0.9,\) must be two numbers"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]=1.0 must be in \[0, 1\)"),
        ({"eps": 0.0}, r"eps=0.0 must be positive"),
        ({"clip_grad": -1.0}, r"clip_grad=-1.0 must be >= 0"),
        ({"warmup_steps": -1}, r"warmup_steps=-1 must be an integer >= 0"),
        ({"warmup_steps": 2.5}, r"warmup_steps=2.5 must be an integer >= 0"),
        ({"decay_steps": 0}, r"decay_steps=0 must be a positive integer"),
        ({"decay_style": "step"}, r"decay_style='step' is not supported"),
    ],
)
def test_bad_settings_are_named_with_their_value(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerSettings(**overrides)
    with pytest.raises(ValueError, match=match):  # the modules check them as they are built
        MegatronLMModule(tiny_gpt(), **overrides)


def test_settings_from_a_hparams_file_and_their_spec() -> None:
    settings = OptimizerSettings(betas=[0.8, 0.99])  # type: ignore[arg-type]  (YAML gives a list)
    assert settings.betas == (0.8, 0.99)
    whole = OptimizerSettings(warmup_steps=100.0, decay_steps=1e3)  # type: ignore[arg-type]  (YAML's 1e3: a float)
    assert (whole.warmup_steps, whole.decay_steps) == (100, 1000)
    assert type(whole.warmup_steps) is int
    assert settings["betas"] == (0.8, 0.99)  # read as the dict the settings were
    with pytest.raises(KeyError, match="'learning_rate' is no optimizer setting"):
        settings["learning_rate"]
    assert settings == OptimizerSettings(betas=(0.8, 0.99))
    updated = settings.updated({"lr": 1e-3, "prediction": "logits", "lora": None})  # other hparams are ignored
    assert (updated.lr, updated.betas) == (1e-3, (0.8, 0.99))
    with pytest.raises(ValueError, match=r"lr=-1.0 must be positive"):
        settings.updated({"lr": -1.0})
    spec = OptimizerSettings(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=9, decay_style="linear").spec()
    assert (spec.config.optimizer, spec.config.lr, spec.config.min_lr) == ("adam", 1e-3, 1e-4)
    assert (spec.config.adam_beta1, spec.config.adam_beta2, spec.config.adam_eps) == (0.9, 0.95, 1e-8)
    assert (spec.config.weight_decay, spec.config.clip_grad) == (0.01, 1.0)
    assert (spec.lr_warmup_steps, spec.lr_decay_steps, spec.lr_decay_style) == (2, 9, "linear")
    assert not spec.override_lr_schedule


def test_every_gpt_module_keeps_the_flat_arguments() -> None:
    config = tiny_gpt(share_embeddings_and_output_weights=False)
    lm = MegatronLMModule(config, 1e-3, warmup_steps=4, prediction="logprobs")  # lr positional, as before
    value = MegatronValueModule(config, lr=2e-3, clip_range=0.2, override_lr_schedule=True)
    assert lm.optimizer_settings == OptimizerSettings(lr=1e-3, warmup_steps=4)
    assert value.optimizer_settings == OptimizerSettings(lr=2e-3, override_lr_schedule=True)
    # The saved hyper-parameters stay flat (what load_from_checkpoint and Tuner.lr_find read); the resume switch
    # is not saved.
    assert (lm.hparams.lr, lm.hparams.warmup_steps, lm.hparams.prediction) == (1e-3, 4, "logprobs")
    assert "override_lr_schedule" not in value.hparams
    assert value.hparams.clip_range == 0.2
    lm.hparams.lr = 5e-4  # Tuner.lr_find's suggestion
    assert lm.configure_optimizers().config.lr == 5e-4
    assert value.configure_optimizers().override_lr_schedule
