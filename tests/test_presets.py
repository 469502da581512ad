"""Strategy names in Lightning's registry, the one-process launcher rule, and the perplexity metric."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torchmetrics.text import Perplexity

from lightning_megatron import MegatronStrategy
from lightning_megatron.modules.metrics import TokenPerplexity
from lightning_megatron.presets import PRESETS


@pytest.mark.parametrize(
    ("name", "devices", "layout"),
    [
        ("megatron", 2, {"tp": 1, "pp": 1}),
        ("megatron_tp2", 2, {"tp": 2, "pp": 1}),
        ("megatron_pp2", 2, {"tp": 1, "pp": 2}),
        ("megatron_tp2_pp2", 4, {"tp": 2, "pp": 2}),
        ("megatron_tp2_sp", 2, {"tp": 2, "sequence_parallel": True}),
    ],
)
def test_registry_names_build_the_layout(name: str, devices: int, layout: dict) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False)
    assert isinstance(trainer.strategy, MegatronStrategy)
    for key, value in layout.items():
        assert getattr(trainer.strategy.parallel, key) == value
    assert trainer.world_size == devices
    assert StrategyRegistry[name]["description"]


def test_every_preset_is_registered_and_checked_against_the_world() -> None:
    assert set(PRESETS) <= set(StrategyRegistry.available_strategies())
    # A preset is an ordinary MegatronStrategy: an impossible world fails when the Trainer is built.
    with pytest.raises(ValueError, match=r"world size 2 .* not divisible by tp\*pp\*cp = 2\*2\*1 = 4"):
        L.Trainer(strategy="megatron_tp2_pp2", accelerator="cpu", devices=2, logger=False)


def test_one_process_needs_no_launcher() -> None:
    # Lightning refuses a subprocess launcher in notebooks; a one-process run has nothing to launch.
    one = L.Trainer(strategy="megatron", accelerator="cpu", devices=1, logger=False)
    assert one.strategy.launcher is None
    two = L.Trainer(strategy="megatron", accelerator="cpu", devices=2, logger=False)
    assert two.strategy.launcher is not None


def test_token_perplexity_is_torchmetrics_perplexity_of_the_logits() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, 7, 11), torch.randint(0, 11, (2, 3, 7))
    reference = Perplexity()
    ours = TokenPerplexity()
    for batch_logits, batch_target in zip(logits, target, strict=True):  # batches of different loss
        reference.update(batch_logits, batch_target)
        nll = torch.nn.functional.cross_entropy(batch_logits.flatten(0, 1), batch_target.flatten(), reduction="sum")
        ours.update(nll, torch.tensor(batch_target.numel()))
    assert float(ours.compute()) == pytest.approx(float(reference.compute()), rel=1e-5)
    # Token-weighted, not a mean of per-batch perplexities.
    weighted = TokenPerplexity()
    weighted.update(torch.tensor(1.0), torch.tensor(1))
    weighted.update(torch.tensor(9.0), torch.tensor(3))
    assert float(weighted.compute()) == pytest.approx(float(torch.exp(torch.tensor(10.0 / 4))))
