"""Lightning's checkpoint hooks of :class:`~lightning_megatron.MegatronStrategy`, on Megatron's sharded state.

A base class of the strategy, as Lightning's ``CheckpointHooks`` is of the LightningModule: the hooks Lightning calls
to save, load and remove a checkpoint, which here write and read one sharded directory through Megatron's
``dist_checkpointing`` (``checkpointing/``): the model chunks, the distributed optimizer and LR schedule, the
module's state beside its chunks, the loop state. Every rank calls them. The strategy's state they use is declared
below; ``MegatronStrategy`` sets it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, override

from torch import Tensor

from lightning_megatron.checkpointing import sharded
from lightning_megatron.checkpointing.format import module_state
from lightning_megatron.checkpointing.load import loading
from lightning_megatron.checkpointing.writer import CheckpointWriter
from lightning_megatron.training import optim, retained

if TYPE_CHECKING:
    import torch

    from lightning_megatron.modules.base import MegatronLightningModule
    from lightning_megatron.parallel import state
    from lightning_megatron.runstate import RunState
    from lightning_megatron.training.retained import Retained

_PATH = str | os.PathLike


class ShardedCheckpointHooks:
    """Lightning's checkpoint hooks on Megatron's sharded checkpoints (a base class of ``MegatronStrategy``)."""

    checkpoint_writer: CheckpointWriter
    _run: RunState
    _groups: state.Groups | None
    _retained: Retained | None
    _megatron_optimizer: Any | None
    _scheduler: Any | None

    if TYPE_CHECKING:  # MegatronStrategy's (and DDPStrategy's) own

        @property
        def module(self) -> MegatronLightningModule: ...

        @property
        def root_device(self) -> torch.device: ...

        def sync_params(self) -> None: ...

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model and optimizer must exist to load sharded state into them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded together with the model in load_checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:  # what the module holds beside its chunks
        return module_state.capture(self.module, self._groups.replica if self._groups else None)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Tensor]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"MegatronStrategy.save_checkpoint takes no storage_options, got {storage_options!r}")
        after_run = self._run.run_chunks is None and self._retained is not None  # what the run kept comes back
        with self._retained.restored(self.module.chunks, self._megatron_optimizer) if after_run else nullcontext():
            self.sync_params()  # with overlapped param gather the last step's update may be pending
            build = partial(sharded.module_state, checkpoint, self.module, self._megatron_optimizer, self._scheduler)
            at_once = self._run.ddp_chunks is None or retained.interrupted(self.module)  # after a run, or failing
            self.checkpoint_writer.save(build, filepath, publish=at_once)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        with self.checkpoint_writer.loading(self._groups.control if self._groups else None) as reading:
            optimizer = self._megatron_optimizer
            loaded = loading.load_module(self.module, optimizer, checkpoint_path, self._scheduler, reading)
        optim.use_fused_adam(optimizer, fused=self.root_device.type == "cuda")  # the loaded groups carry the writer's
        return loaded

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module_state.restore(self.module, checkpoint.get("state_dict"), strict)  # the chunks: load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.checkpoint_writer.remove(filepath)  # waits for pending async saves: the last good checkpoint stays
