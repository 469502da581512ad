"""LightningDataModule for the embedded default corpus (byte-level, built from installed packages' sources)."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from lightning_megatron.data import demo_dataloaders


class ByteCorpusDataModule(L.LightningDataModule):
    """Packed byte-level sequences of the Python sources of lightning and megatron-core (nothing downloaded).

    Lightning shards the training set by Megatron's data-parallel rank (the strategy supplies the sampler's rank
    and size), so tensor- and pipeline-parallel peers read the same samples.

    Args:
        seq_length: tokens (bytes) per sample; must equal the model's ``seq_length``.
        batch_size: samples per optimizer step on each data-parallel rank (split into micro-batches).
        max_bytes: size of the corpus built from the installed packages.
        val_fraction: tail fraction of the corpus held out for validation.
        num_val_batches: cap on validation batches (``None``: the whole held-out part).
    """

    def __init__(
        self,
        seq_length: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        num_val_batches: int | None = 4,
    ) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_val_batches = num_val_batches
        self._loaders: tuple[DataLoader, DataLoader] | None = None

    def setup(self, stage: str) -> None:
        if self._loaders is None:
            self._loaders = demo_dataloaders(
                seq_length=self.seq_length, batch_size=self.batch_size, max_bytes=self.max_bytes,
                val_fraction=self.val_fraction, num_val_batches=self.num_val_batches,
            )  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        assert self._loaders is not None, "setup() builds the loaders"
        return self._loaders[0]

    def val_dataloader(self) -> DataLoader:
        assert self._loaders is not None, "setup() builds the loaders"
        return self._loaders[1]
