"""What a LightningModule holds beside its Megatron chunks: saved in the checkpoint, restored exactly.

A buffer registered on the module (a running statistic, a step counter), the parameters of a small head of its own,
any ``nn.Module`` attribute that is not one of the chunks: Lightning keeps them in the checkpoint's ``state_dict``.
Under MegatronStrategy the chunks are saved sharded, and this is the rest of ``module.state_dict()``, which
:func:`capture` hands Lightning as ``state_dict`` (host copies; the checkpoint's common state, written once, by rank
0), and :func:`restore` loads back -- on resume (``load_model_state_dict``), in ``validate``/``test``/``predict``
with ``ckpt_path`` and in ``load_from_checkpoint``, with the module's ``strict_loading``. Such state is the same on
every rank of a model replica (they run the same steps on the same batch): one that differs there raises, naming the
entry, instead of saving one rank's value for all. Across data-parallel replicas rank 0's is saved, as plain DDP does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

CHUNKS = "chunks."  # the chunks' own entries: saved sharded


def capture(module: nn.Module, replica: Any | None = None) -> dict[str, Any]:
    """The module's state but its chunks' (``module.state_dict()`` without ``chunks.*``), tensors copied to the host.

    Collective over ``replica`` (a group of the ranks of this model replica; ``None``: this process alone) when there
    is any such state: raises ``ValueError`` naming the entries that differ between its ranks."""
    state = {name: value for name, value in module.state_dict().items() if not name.startswith(CHUNKS)}
    state = {name: value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value
             for name, value in state.items()}  # fmt: skip
    if state and replica is not None and torch.distributed.get_world_size(replica) > 1:
        _check_replicated(state, replica)
    return state


def _check_replicated(state: Mapping[str, Any], replica: Any) -> None:
    digests = {name: _digest(value) for name, value in state.items()}
    gathered: list[dict[str, str] | None] = [None] * torch.distributed.get_world_size(replica)
    torch.distributed.all_gather_object(gathered, digests, group=replica)
    differing = sorted({name for other in gathered for name in digests if (other or {}).get(name) != digests[name]})
    if differing:
        raise ValueError(
            f"the LightningModule's state outside its Megatron chunks differs between the ranks of one model replica "
            f"(tensor x pipeline x context parallel): {', '.join(differing[:5])}. These ranks run the same steps on "
            "the same batch, so such state must be computed alike on each (e.g. from the batch or the step, not from "
            "the rank); a checkpoint would keep one rank's value for all"
        )


def _digest(value: Any) -> str:
    if isinstance(value, Tensor):
        data = value.reshape(-1).contiguous().view(torch.uint8)
        return f"{value.dtype}{tuple(value.shape)}" + hashlib.sha1(data.numpy().tobytes()).hexdigest()
    return repr(value)


def restore(module: nn.Module, state: Mapping[str, Any] | None, strict: bool = True) -> None:
    """Load ``state`` (what :func:`capture` saved) into the module's state outside its chunks. With ``strict``, an
    entry the module has and the checkpoint lacks (or the reverse) raises ``RuntimeError`` naming it, as
    ``load_state_dict`` does; ``state=None`` (a checkpoint written before this state was saved) restores nothing and
    warns if the module has such state."""
    own = [name for name in module.state_dict() if not name.startswith(CHUNKS)]
    if state is None:
        if own:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"the checkpoint holds no state of the module outside its chunks: {own[:5]} stay as is")
        return
    unexpected = sorted(name for name in state if name.startswith(CHUNKS) or name not in own)
    missing = sorted(name for name in own if name not in state)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"error loading the state of {type(module).__name__} outside its Megatron chunks: missing "
            f"{missing or 'nothing'}, unexpected {unexpected or 'nothing'} (the checkpoint's module had other "
            "buffers or submodules); make the module match, or set its strict_loading = False"
        )
    loadable = {name: value for name, value in state.items() if name in own}
    result = module.load_state_dict(loadable, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
