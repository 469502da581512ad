"""Move training state off the accelerator and back, e.g. while an inference engine shares the GPU (RLHF).

Works on storages, not tensors: Megatron's parameters and gradients are views into contiguous DDP buffers, and
the optimizer holds references to its state tensors. Freeing a storage (``resize_(0)``) and refilling it later
keeps every view and reference valid, so nothing has to be re-wired after :func:`reload`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_megatron.compat.megatron_internals import torch_optimizers
from lightning_megatron.training import graphs


@dataclass
class Offloaded:
    """Storages whose memory was released, with their contents on the host (pinned for CUDA)."""

    saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = field(default_factory=list)
    """(device storage, host copy) pairs restored by :func:`reload`."""
    zeroed: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    """(device storage, size in bytes) pairs re-allocated and zero-filled by :func:`reload` (gradients)."""

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes() for _, host in self.saved) + sum(size for _, size in self.zeroed)


def _unique_storages(tensors: Iterable[torch.Tensor | None]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:  # already released
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Main (fp32) parameters and state tensors of every torch optimizer inside a Megatron optimizer."""
    tensors: list[torch.Tensor] = []
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            tensors.extend(group["params"])
        for state in torch_optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return tensors


def offload(
    chunks: Iterable[nn.Module], optimizer: Any | None, *, params: bool, grads: bool, optimizer_state: bool
) -> Offloaded:
    """Release the chosen device memory; parameters and optimizer state are copied to the host first."""
    chunks = list(chunks)
    if graphs.in_use(chunks):
        raise RuntimeError(
            "offload() with ModelConfig(cuda_graphs=True) during a fit: the captured CUDA graphs read and write the "
            "weights' and gradients' device addresses, which reload() would change; use cuda_graphs=False with offload"
        )
    record = Offloaded()
    model_params = [p for chunk in chunks for p in chunk.parameters()]
    to_save: list[torch.Tensor] = []
    if params:
        to_save.extend(model_params)
    if optimizer_state and optimizer is not None:
        # fp32 main params of the distributed optimizer are views of the model's parameter buffer: with
        # params=False they must stay where they are (weights are still read, e.g. by an inference engine).
        kept = set() if params else {s.data_ptr() for s in _unique_storages(model_params)}
        to_save.extend(t for t in _optimizer_tensors(optimizer) if t.untyped_storage().data_ptr() not in kept)
    for storage in _unique_storages(to_save):
        host = torch.UntypedStorage(storage.nbytes(), device="cpu")
        if storage.device.type == "cuda":
            host = host.pin_memory()
        host.copy_(storage)
        record.saved.append((storage, host))
    if grads:
        main_grads = (getattr(p, "main_grad", None) for chunk in chunks for p in chunk.parameters())
        saved_ptrs = {s.data_ptr() for s, _ in record.saved}
        for storage in _unique_storages(main_grads):
            if storage.data_ptr() not in saved_ptrs:  # grads share no storage with params/state
                record.zeroed.append((storage, storage.nbytes()))
    for storage, _ in record.saved:
        storage.resize_(0)
    for storage, _ in record.zeroed:
        storage.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def reload(record: Offloaded) -> None:
    """Re-allocate every released storage; restore saved contents and zero the gradients."""
    for storage, host in record.saved:
        storage.resize_(host.nbytes())
        storage.copy_(host)
    for storage, size in record.zeroed:
        storage.resize_(size)
        storage.fill_(0)
    record.saved.clear()
    record.zeroed.clear()


class Offloader:
    """The storages one strategy released with :func:`offload`, until :meth:`reload` (one release at a time)."""

    def __init__(self) -> None:
        self.record: Offloaded | None = None

    def release(self, chunks: Callable[[], Iterable[nn.Module]], optimizer: Any | None, **which: bool) -> int:
        """:func:`offload` of ``chunks()`` (asked for only when nothing is released yet) and ``optimizer``
        (``which``: its ``params``, ``grads``, ``optimizer_state``); the bytes released."""
        if self.record is not None:
            raise RuntimeError("MegatronStrategy.offload called twice without reload()")
        self.record = offload(chunks(), optimizer, **which)
        return self.record.nbytes

    def reload(self, strict: bool = True) -> None:
        """Bring the released storages back; without one, ``RuntimeError`` if ``strict`` (else nothing)."""
        if self.record is None:
            if strict:
                raise RuntimeError("MegatronStrategy.reload called without a previous offload()")
            return
        reload(self.record)
        self.record = None
