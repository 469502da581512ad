"""Reads of Megatron-Core's optimizer internals (names its public API does not promise); ``register.py`` lists them.

Megatron's optimizers wrap torch's: a ``ChainedOptimizer`` chains one optimizer per parameter kind (dense and
expert-parallel), each wrapping one torch optimizer in ``.optimizer``. The workarounds (``mcore_fixes.py``), the
offload and the fused-Adam switch act on those torch optimizers.
"""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer: one per part of a ``ChainedOptimizer`` (e.g. the dense
    and the expert-parallel parameters), else the one it wraps."""
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def torch_adams(optimizer: Any) -> list[torch.optim.Adam | torch.optim.AdamW]:
    """The torch Adam/AdamW optimizers among :func:`torch_optimizers` (those whose state the workarounds touch)."""
    return [opt for opt in torch_optimizers(optimizer) if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))]


def synchronize_steps(chained: Any) -> None:
    """``ChainedOptimizer._synchronize_steps()``: Megatron's alignment of the chained optimizers' step counts, which
    its own ``sharded_state_dict`` runs first (a no-op for torch's Adam); a state built without that method runs it
    too."""
    chained._synchronize_steps()


def experts_use_fused_ops(experts: Any) -> bool:
    """Whether Megatron's ``TEGroupedMLP`` (or a subclass) runs through Transformer Engine's op fuser
    (``_with_fused_impl``, set from ``config.use_transformer_engine_op_fuser`` when it is built)."""
    return bool(experts._with_fused_impl)
