"""Names in Lightning's strategy registry: ``Trainer(strategy="megatron")``, ``"megatron_tp2"`` and the like.

Lightning discovers only its own strategies, so these names are registered when ``lightning_megatron`` is imported.
Each name is a ``MegatronStrategy`` with the listed keyword arguments; everything else keeps its default (data
parallelism fills the rest of the world). Pass ``MegatronStrategy(...)`` for anything else.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_megatron.strategy import MegatronStrategy

PRESETS: dict[str, dict[str, Any]] = {
    MegatronStrategy.strategy_name: {},
    "megatron_tp2": {"tp": 2},
    "megatron_tp4": {"tp": 4},
    "megatron_tp8": {"tp": 8},
    "megatron_tp2_sp": {"tp": 2, "sequence_parallel": True},
    "megatron_pp2": {"pp": 2},
    "megatron_pp4": {"pp": 4},
    "megatron_tp2_pp2": {"tp": 2, "pp": 2},
}
"""Registry name -> ``MegatronStrategy`` keyword arguments. Data parallelism fills the rest of the world."""


def register(registry: Any = StrategyRegistry) -> list[str]:
    """Register every preset not registered yet (a re-import leaves earlier entries alone); return their names."""
    added = []
    for name, kwargs in PRESETS.items():
        if name in registry:
            continue
        layout = ", ".join(f"{key}={value}" for key, value in kwargs.items())
        description = f"MegatronStrategy({layout})" if kwargs else "Megatron-Core TP/PP/VPP/CP/EP parallelism"
        registry.register(name, MegatronStrategy, description=description, **kwargs)
        added.append(name)
    return added


register()
