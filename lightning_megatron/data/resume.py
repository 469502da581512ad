"""Exact mid-epoch resume for plain DataLoaders.

Lightning restores a mid-epoch run's loop progress, but a plain ``DataLoader`` restarts from its first batch:
the resumed run would train on batches it already saw. Lightning does restore loaders that implement
``state_dict``/``load_state_dict`` (its ``_Stateful`` protocol), so the strategy hands Lightning the training
loader wrapped in :class:`ResumableLoader`, whose state is the number of batches the loop trained on and the
global batch size (samples per step over all data-parallel ranks) they had.

The position is exact only for the same global batch size: the sampler deals each epoch's samples to the
data-parallel ranks in global batches, so a layout with another data-parallel size resumes exactly when
``batch_size x data-parallel size`` is unchanged. Another global batch size mid-epoch would re-train or skip samples
(and Lightning's loop counts the epoch in batches), so it is refused, naming both sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

_END = object()


class ResumableLoader:
    """Iterates ``loader``; after ``load_state_dict`` the next iteration skips the batches already trained on.

    ``global_batch``: samples one batch of ``loader`` stands for over all data-parallel ranks (``None``: unknown,
    e.g. a loader without ``batch_size``; then the position is not checked against another batch size).
    """

    def __init__(self, loader: Any, consumed: Callable[[], int], global_batch: int | None = None) -> None:
        self.loader = loader
        self._consumed = consumed
        self.global_batch = global_batch
        self._skip = 0

    @classmethod
    def of_training(cls, loader: Any, trainer: Any, data_parallel_size: int) -> Any:
        """``loader`` as the training loader of ``trainer``, whose loop counts the batches trained on (Lightning's
        loop progress: public attributes, though not a documented API). ``processed``, not ``ready``: a save in
        ``on_exception`` (e.g. on SIGTERM) comes after the next batch was fetched but before it was trained on.
        A loader with its own ``state_dict``/``load_state_dict`` (LitData's ``StreamingDataLoader``, torchdata's
        ``StatefulDataLoader``) is returned as it is: Lightning saves and restores its state itself."""
        if callable(getattr(loader, "load_state_dict", None)) and callable(getattr(loader, "state_dict", None)):
            return loader
        progress = trainer.fit_loop.epoch_loop.batch_progress
        batch_size = _batch_size(loader)
        global_batch = batch_size * data_parallel_size if batch_size else None
        return cls(loader, consumed=lambda: progress.current.processed, global_batch=global_batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        return self._batches(skip)

    def _batches(self, skip: int) -> Iterator[Any]:
        # A generator: nothing is read until the loop asks for the first batch. Lightning creates the iterator before
        # it sets the sampler's epoch (FitLoop.setup_data, then on_advance_start): skipping there would skip the batches
        # of epoch 0's shuffle, and a run resumed mid-epoch in a later epoch would train on the wrong samples.
        iterator = iter(self.loader)
        for _ in range(skip):  # map-style or not, skipping by reading is always correct
            if next(iterator, _END) is _END:
                return
        yield from iterator

    # Lightning calls set_epoch on these for shuffling DistributedSamplers.
    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    def state_dict(self) -> dict[str, int]:
        state = {"batches_consumed": int(self._consumed())}
        if self.global_batch is not None:
            state["global_batch_size"] = self.global_batch
        if hasattr(self.loader, "__len__"):
            state["batches_per_epoch"] = len(self.loader)
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state["batches_consumed"])
        # A checkpoint taken after the epoch's last batch resumes at the start of the next epoch: measured in the
        # saved run's epoch (another batch size makes another epoch length).
        length = state.get("batches_per_epoch") or (len(self.loader) if hasattr(self.loader, "__len__") else None)
        self._skip = consumed % length if length else consumed
        saved = state.get("global_batch_size")
        if self._skip and saved is not None and self.global_batch is not None and saved != self.global_batch:
            raise ValueError(
                f"the checkpoint was saved {consumed} batches into an epoch of global batches of {saved} samples "
                f"(DataLoader batch_size x data-parallel size), and this run's global batch is {self.global_batch}: "
                f"resuming there would re-train or skip samples. Resume mid-epoch with a global batch of {saved} "
                "(e.g. halve batch_size when doubling the data-parallel size), or change it at an epoch boundary "
                "(a checkpoint saved at the end of an epoch)"
            )


def _batch_size(loader: Any) -> int | None:
    """Samples per batch of ``loader`` (a DataLoader's ``batch_size``, or its batch sampler's)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None
