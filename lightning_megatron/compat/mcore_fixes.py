"""megatron-core 0.19 workarounds for loading the distributed optimizer's torch-native Adam state (no Transformer
Engine / apex), each a small documented function on our own optimizer's state (the one that replaces a Megatron
method during a load is :class:`~lightning_megatron.compat.patches.KeepAdamStepOnLoad`). The layout tests fail when
any of them stops being right (cross-layout resume must be exact).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.compat.megatron_internals import torch_adams, torch_optimizers


def init_adam_state(optimizer: Any) -> None:
    """Give a fresh torch Adam the state it has after a step (zero moments, step 0), so that its sharded state dict
    can be loaded into, or saved before the first optimizer step.

    megatron-core 0.19's ``DistributedOptimizer.state_dict`` asserts exactly one ``step`` value among the torch
    optimizer's per-parameter states, which a fresh torch Adam does not have yet (a bare ``AssertionError``).
    torch's Adam starts from exactly these values when it finds no state, so the first step is unchanged.
    """
    for torch_optimizer in torch_adams(optimizer):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if len(state) == 0:
                    device = param.device if group.get("fused") else None  # see training.optim.place_adam_steps
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def untie_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam ``step`` tensor after loading.

    megatron-core 0.19's ``DistributedOptimizer.load_state_dict`` (torch-native path) assigns *one* ``step``
    tensor to every parameter's state; torch Adam increments it in place once per parameter, so the bias
    correction of every step after a resume would be wrong.
    """
    # Where each counter lives (host, or the device for fused Adam) is decided by the strategy's use_fused_adam,
    # which runs after every load because Megatron also restores the saved groups' fused/foreach flags.
    for torch_optimizer in torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
