"""Download-free demo data: a byte-level corpus built from installed packages' Python sources.

The demo must train a small GPT on CPU without network access and without vendoring third-party text, so
the corpus is assembled at run time from the ``.py`` files (code + docstrings) that every install of this
project already has on disk. Tokenisation is byte-level: token id == byte value, vocabulary size 256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

__all__ = ["VOCAB_SIZE", "PackedByteDataset", "build_corpus", "demo_dataloaders", "synthetic_tokens", "train_val_split"]

VOCAB_SIZE = 256  # byte-level tokens
DEFAULT_PACKAGES: tuple[str, ...] = ("lightning", "megatron.core", "torch")
_FILE_SEP = b"\n\n"
# Bump when the corpus layout changes so that stale caches are never reused.
_CORPUS_FORMAT = 1


def _package_root(name: str) -> Path:
    """Locate a package's directory (or single-module file) without importing it.

    ``importlib.util.find_spec("a.b")`` imports ``a``, which for torch-sized packages costs seconds, so only the
    top-level name goes through ``find_spec`` and the rest of the dotted path is resolved on the file system.
    """
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ValueError(f"packages: {name!r} is not installed")
    if not rest:
        if spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations))).resolve()
        if spec.origin and spec.origin.endswith(".py"):
            return Path(spec.origin).resolve()
        raise ValueError(f"packages: {name!r} has no Python sources (origin={spec.origin!r})")
    # Namespace packages (e.g. ``megatron``) can span several locations; take the first that holds the subpackage.
    for location in spec.submodule_search_locations or ():
        candidate = Path(location, *rest)
        if candidate.is_dir():
            return candidate.resolve()
        if candidate.with_suffix(".py").is_file():
            return candidate.with_suffix(".py").resolve()
    # Unusual layouts (custom finders, ``__path__`` manipulation): fall back to the importing lookup.
    full = importlib.util.find_spec(name)
    where = full and (next(iter(full.submodule_search_locations or ()), None) or full.origin)
    if not where:
        raise ValueError(f"packages: {name!r} is not installed")
    return Path(where).resolve()


def _package_version(name: str) -> str:
    """Best-effort distribution version; only feeds the cache key, so failures degrade to ``"unknown"``."""
    top = name.split(".")[0]
    for dist in (top, name.replace(".", "-"), name.replace(".", "_")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    dists = importlib.metadata.packages_distributions().get(top, [])  # slow (scans every dist), so last resort
    return ",".join(f"{d}=={importlib.metadata.version(d)}" for d in sorted(dists)) or "unknown"


def _iter_py_files(root: Path) -> Iterator[Path]:
    """Yield ``.py`` files under ``root`` in a deterministic order, never leaving ``root``.

    Sorting by relative POSIX path makes the order independent of file-system enumeration order; symlinks that
    resolve outside the package are skipped so that only the named packages are ever read.
    """
    if root.is_file():
        yield root
        return
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")):
        path = root / rel
        if path.is_file() and path.resolve().is_relative_to(root):
            yield path


def _select_files(packages: Sequence[str], max_bytes: int) -> list[tuple[str, Path, os.stat_result]]:
    """Files that will make up the corpus, found by stat only (no reads) so the cache key is cheap to compute."""
    selected: list[tuple[str, Path, os.stat_result]] = []
    seen: set[Path] = set()  # overlapping packages (e.g. "megatron" and "megatron.core") are read once
    total = 0
    for name in packages:
        for path in _iter_py_files(_package_root(name)):
            if total >= max_bytes:
                return selected
            resolved = path.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            st = path.stat()
            selected.append((name, path, st))
            total += st.st_size + len(_FILE_SEP)
    return selected


def _cache_key(packages: Sequence[str], max_bytes: int, files: list[tuple[str, Path, os.stat_result]]) -> str:
    # Versions alone miss editable installs and in-place patches, so the exact file list (path, size, mtime) is
    # hashed too; the stat calls are far cheaper than re-reading tens of MB.
    h = hashlib.sha256(f"format={_CORPUS_FORMAT};max_bytes={max_bytes}\n".encode())
    for name in packages:
        h.update(f"pkg={name}=={_package_version(name)}\n".encode())
    for name, path, st in files:
        h.update(f"{name}:{path}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def build_corpus(
    packages: Sequence[str] = DEFAULT_PACKAGES,
    max_bytes: int = 8_000_000,
    cache_dir: str | Path | None = None,
) -> np.ndarray:
    """Concatenate the ``.py`` sources of ``packages`` (sorted, ``b"\\n\\n"``-separated) into a uint8 array.

    The result is at most ``max_bytes`` long and is a pure function of the installed files, so every rank of a
    distributed job builds the same corpus independently. With ``cache_dir`` the array is stored as
    ``corpus-<hash>.npy`` and reused while the selected files are unchanged.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if isinstance(packages, str):  # a bare string would otherwise be iterated character by character
        packages = (packages,)
    if not packages:
        raise ValueError(f"packages must name at least one package, got {packages!r}")

    files = _select_files(packages, max_bytes)
    cache_path: Path | None = None
    if cache_dir is not None:
        cache_path = Path(cache_dir) / f"corpus-{_cache_key(packages, max_bytes, files)}.npy"
        if cache_path.is_file():
            return np.load(cache_path)

    parts: list[bytes] = []
    total = 0
    for i, (_, path, _) in enumerate(files):
        chunk = (_FILE_SEP if i else b"") + path.read_bytes()
        parts.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8).copy()  # copy: writable, owns memory
    if corpus.size == 0:
        raise ValueError(f"packages: no .py sources found in {list(packages)!r}")

    if cache_path is not None:
        # Write to a temp file and rename atomically: several ranks may build the same cache concurrently.
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=".corpus-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, corpus)
            os.replace(tmp, cache_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return corpus


class PackedByteDataset(Dataset[torch.Tensor]):
    """Non-overlapping, fixed-length chunks of a byte array; item ``i`` is ``data[i*S:(i+1)*S]`` as int64.

    Items are bare LongTensors (``input_ids``); the model derives next-token labels from them. The trailing
    ``len(data) % seq_length`` bytes are dropped so that every sample has the same length.
    """

    def __init__(self, data: np.ndarray, seq_length: int) -> None:
        if seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if data.ndim != 1:
            raise ValueError(f"data must be 1-D, got shape {data.shape}")
        self.data = np.ascontiguousarray(data, dtype=np.uint8)
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.data) // self.seq_length

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        start = index * self.seq_length
        return torch.from_numpy(self.data[start : start + self.seq_length].astype(np.int64))


def train_val_split(data: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous split: the last ``val_fraction`` of ``data`` is validation (no leakage between packed chunks)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = int(round(len(data) * val_fraction))
    n_train = len(data) - n_val
    if n_val == 0 or n_train == 0:
        raise ValueError(
            f"val_fraction={val_fraction} splits {len(data)} items into {n_train} train / {n_val} val; both must be > 0"
        )
    return data[:n_train], data[n_train:]


def demo_dataloaders(
    seq_length: int,
    batch_size: int,
    max_bytes: int = 8_000_000,
    val_fraction: float = 0.05,
    num_val_batches: int | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Train/val DataLoaders over the byte corpus (vocab ``VOCAB_SIZE``).

    ``shuffle=False`` and no sampler: Lightning injects a DistributedSampler by data-parallel rank itself.
    ``drop_last=True`` because the strategy needs every batch to be divisible by the micro-batch size.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if num_val_batches is not None and num_val_batches <= 0:
        raise ValueError(f"num_val_batches must be positive or None, got {num_val_batches}")
    train_data, val_data = train_val_split(build_corpus(max_bytes=max_bytes, cache_dir=cache_dir), val_fraction)
    train_ds = PackedByteDataset(train_data, seq_length)
    val_ds: Dataset[torch.Tensor] = PackedByteDataset(val_data, seq_length)
    for field, ds in (("train", train_ds), ("val", val_ds)):
        if len(ds) < batch_size:  # drop_last would silently yield zero batches
            raise ValueError(
                f"{field} split has {len(ds)} samples of seq_length={seq_length}, fewer than batch_size={batch_size}; "
                f"raise max_bytes (={max_bytes}) or val_fraction (={val_fraction})"
            )
    if num_val_batches is not None:
        val_ds = Subset(val_ds, range(min(len(val_ds), num_val_batches * batch_size)))
    train_dl = DataLoader(train_ds, batch_size=batch_size, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=batch_size, shuffle=False, drop_last=True)
    return train_dl, val_dl


def synthetic_tokens(num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids ``[num_samples, seq_length]`` in ``[0, vocab_size)``.

    Uses a private ``torch.Generator`` so tests get reproducible data without perturbing the global RNG.
    """
    if num_samples < 0 or seq_length < 0:
        raise ValueError(f"num_samples and seq_length must be >= 0, got {num_samples}, {seq_length}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab_size, (num_samples, seq_length), generator=gen, dtype=torch.long)
