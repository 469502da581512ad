"""Exact mid-epoch resume for plain DataLoaders.

Lightning restores a mid-epoch run's loop progress, but a plain ``DataLoader`` restarts from its first batch:
the resumed run would train on batches it already saw. Lightning does restore loaders that implement
``state_dict``/``load_state_dict`` (its ``_Stateful`` protocol), so the strategy hands Lightning the training
loader wrapped in :class:`ResumableLoader`, whose state is the number of batches the loop consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

_END = object()


class ResumableLoader:
    """Iterates ``loader``; after ``load_state_dict`` the next iteration skips the batches already consumed."""

    def __init__(self, loader: Any, consumed: Callable[[], int]) -> None:
        self.loader = loader
        self._consumed = consumed
        self._skip = 0

    @classmethod
    def of_training(cls, loader: Any, trainer: Any) -> ResumableLoader:
        """``loader`` as the training loader of ``trainer``, whose loop counts the consumed batches (Lightning's loop
        progress: public attributes, though not a documented API)."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return cls(loader, consumed=lambda: progress.current.ready)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        skip, self._skip = self._skip, 0
        for _ in range(skip):  # map-style or not, skipping by reading is always correct
            if next(iterator, _END) is _END:
                break
        return iterator

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
        return {"batches_consumed": int(self._consumed())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state["batches_consumed"])
        # A checkpoint taken after the epoch's last batch resumes at the start of the next epoch.
        length = len(self.loader) if hasattr(self.loader, "__len__") else None
        self._skip = consumed % length if length else consumed
