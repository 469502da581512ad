"""Lightning's data hooks of :class:`~lightning_megatron.MegatronStrategy`: every rank of a model replica (its
tensor x pipeline x context parallel group) reads the same batches.

A base class of the strategy, as :mod:`lightning_megatron.strategy_checkpoints` is: the sampler's replicas are
Megatron's data-parallel ranks, each DataLoader is bound to that rank (and wrapped to resume mid-epoch when it
trains), and each batch's fingerprint is recorded on its way to the device, for the check before the step's first
forward (``data/consistency.py``). The strategy's state they use is declared below; ``MegatronStrategy`` sets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, override

from lightning_megatron.data import consistency, sharding
from lightning_megatron.data.resume import ResumableLoader
from lightning_megatron.parallel import state
from lightning_megatron.training import guards

if TYPE_CHECKING:
    import torch

    from lightning_megatron.micro_batches import MicroBatching
    from lightning_megatron.modules.base import MegatronLightningModule


class DataParallelHooks:
    """Data parallelism over Megatron's data-parallel group (a base class of ``MegatronStrategy``)."""

    _batching: MicroBatching
    _batches: consistency.BatchCheck
    _groups: state.Groups | None
    num_nodes: int

    if TYPE_CHECKING:  # MegatronStrategy's (and DDPStrategy's) own

        @property
        def module(self) -> MegatronLightningModule: ...

    @property
    def data_parallel_rank(self) -> int:
        """Megatron's data-parallel rank: shard data by it (a model replica's ranks share it); 0 before setup."""
        return state.data_parallel_rank_and_size()[0]

    @property
    def data_parallel_size(self) -> int:
        """Megatron's data-parallel size: the number of model replicas reading different data; 1 before setup."""
        return state.data_parallel_rank_and_size()[1]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor-, pipeline- and context-parallel peers must see the same samples.
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        self._batching.check_loader(dataloader)
        sharding.bind_data_parallel(dataloader, self.data_parallel_rank, self.data_parallel_size, self.num_nodes)
        if not self.module.trainer.training:
            return dataloader
        guards.check_dataloader(dataloader, "training")
        return ResumableLoader.of_training(dataloader, self.module.trainer, self.data_parallel_size)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        moved = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]  # DDPStrategy's
        return self._batches.record(batch, moved, self._groups)  # the host batch's fingerprint (data/consistency.py)
