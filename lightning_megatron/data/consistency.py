"""Every rank of a model replica must see the same batch: a fingerprint of each batch compared over the replica.

Tensor-, pipeline- and context-parallel peers run one model on one batch: the first pipeline stage reads the inputs,
the last the labels, TP peers feed their halves of one all-reduced layer. Peers that read different samples (an
iterable dataset sharded by ``trainer.global_rank``, the usual DDP habit) train on a mix of batches without any
error. So each batch is fingerprinted on the host when the strategy moves it to the device (a 62-bit hash of every
tensor's bytes, names, dtypes and shapes), and the fingerprints are compared over the replica's gloo group before
the step's first forward: one all-reduce of two integers. Tensors that already live on an accelerator are
fingerprinted by name, dtype and shape only (hashing them would synchronise with the device).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_megatron.parallel.state import Groups

_MASK = (1 << 62) - 1  # the negated fingerprint must fit an int64 too


def fingerprint(batch: Any) -> int:
    """A 62-bit hash of ``batch``: tensors, mappings and sequences of them, numbers and strings by value, other
    objects by type only (a default ``repr`` holds a per-process address)."""
    digest = hashlib.sha256()  # hardware-accelerated on current CPUs: ~2 GB/s, faster than blake2b there
    _update(digest, batch)
    return int.from_bytes(digest.digest()[:8], "little") & _MASK


def _update(digest: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if value.device.type == "cpu":
            digest.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy())  # no copy
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(f"K{key!s}".encode())
            _update(digest, value[key])
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        digest.update(f"S{len(value)}".encode())
        for item in value:
            _update(digest, item)
    elif value is None or isinstance(value, str | bytes | int | float | bool):
        digest.update(f"V{value!r}".encode())
    else:
        digest.update(f"O{type(value).__qualname__}".encode())


class BatchCheck:
    """The strategy's per-batch check (``MegatronStrategy(check_batches=True)``, the default).

    :meth:`record` keeps the fingerprint of a host batch as the strategy moves it to the device, keyed by the moved
    batch; :meth:`verify`, collective over the replica and called in the step before any forward, compares the
    step's batch (recorded, or fingerprinted there: a step called directly, not by Lightning's loop) and raises
    ``ValueError`` on every rank of a replica whose ranks disagree. Without a replica group (one rank per replica)
    or when disabled, both do nothing.
    """

    def __init__(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(
                f"check_batches={enabled!r} must be True (compare every batch over the model replica) or False "
                "(skip the check)"
            )
        self.enabled = enabled
        self._recorded: tuple[int, int] | None = None  # (id of the moved batch, fingerprint of its host batch)

    def record(self, host_batch: Any, moved: Any, groups: Groups | None) -> Any:
        """Keep the fingerprint of ``host_batch`` (as loaded) for the step that gets ``moved``; return ``moved``."""
        if self.enabled and groups and groups.replica:
            self._recorded = (id(moved), fingerprint(host_batch))
        return moved

    def verify(self, groups: Groups | None, stage: str, batch: Any) -> None:
        """Collective over the model replica, before any forward of the step on ``batch``: raise ``ValueError``
        unless every rank of the replica has the same fingerprint."""
        group = groups.replica if groups else None
        if not self.enabled or group is None:
            return
        recorded, self._recorded = self._recorded, None
        mine = recorded[1] if recorded is not None and recorded[0] == id(batch) else fingerprint(batch)
        both = torch.tensor([mine, -mine], dtype=torch.int64)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
        if int(both[0]) != -int(both[1]):
            raise ValueError(_mismatch(stage, torch.distributed.get_process_group_ranks(group)))


def _mismatch(stage: str, ranks: Sequence[int]) -> str:
    return (
        f"the {stage} batch differs between the ranks of one model replica (global ranks {list(ranks)}: tensor-, "
        "pipeline- and context-parallel peers, which must all read the same samples); no forward ran. The data is "
        "sharded by something other than the data-parallel rank -- usually an IterableDataset that splits by "
        "trainer.global_rank/world_size or torch.distributed.get_rank(). Shard by trainer.strategy."
        "data_parallel_rank and data_parallel_size instead (lightning_megatron.DataParallelShard wraps any "
        "IterableDataset; LitData's StreamingDataset is sharded so by the strategy; for Hugging Face datasets: "
        "split_dataset_by_node(ds, rank=strategy.data_parallel_rank, world_size=strategy.data_parallel_size)), or "
        "use a map-style dataset (the strategy's sampler shards it). Random data (augmentation, generation, a "
        "random collate) must be drawn alike on a replica's ranks: seed its generator from the data-parallel rank "
        "(e.g. DataLoader(generator=torch.Generator().manual_seed(seed + strategy.data_parallel_rank))). "
        "MegatronStrategy(check_batches=False) turns this check off"
    )
