"""Tests for the download-free demo data pipeline (CPU, fast: corpora are kept to a few hundred KB)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

from lightning_megatron.data.corpus import (
    VOCAB_SIZE,
    PackedByteDataset,
    build_corpus,
    demo_dataloaders,
    synthetic_tokens,
    train_val_split,
)

SMALL = 200_000


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return build_corpus(max_bytes=SMALL)


def test_corpus_deterministic_nonempty_and_bounded(corpus: np.ndarray) -> None:
    assert corpus.dtype == np.uint8
    assert corpus.ndim == 1
    assert 0 < corpus.size <= SMALL
    np.testing.assert_array_equal(corpus, build_corpus(max_bytes=SMALL))


def test_corpus_is_python_source(corpus: np.ndarray) -> None:
    text = corpus.tobytes().decode("utf-8", errors="replace")
    assert text.count("\ufffd") < len(text) // 1000  # .py sources are (almost entirely) utf-8
    assert "def " in text
    assert "import " in text
    assert "\n\n" in text


def test_corpus_prefix_stable_across_max_bytes(corpus: np.ndarray) -> None:
    # Truncation only cuts the tail: a smaller budget yields a prefix of a larger one.
    small = build_corpus(max_bytes=1234)
    assert small.size == 1234
    np.testing.assert_array_equal(small, corpus[:1234])


def test_corpus_exact_bytes_from_fake_package(tmp_path, monkeypatch) -> None:
    # A tiny package on sys.path pins down ordering, separators, file filtering and the no-escape rule exactly.
    root = tmp_path / "site" / "lm_fake_corpus_pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_bytes(b"init")
    (root / "b.py").write_bytes(b"bbb")
    (root / "sub" / "a.py").write_bytes(b"sub-a")
    (root / "notes.txt").write_bytes(b"not python")
    outside = tmp_path / "outside.py"
    outside.write_bytes(b"SECRET")
    (root / "link.py").symlink_to(outside)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()

    # Sorted by relative path: "__init__.py" < "b.py" < "sub/a.py"; link.py and notes.txt are skipped.
    expected = b"init\n\nbbb\n\nsub-a"
    assert build_corpus(packages=("lm_fake_corpus_pkg",), max_bytes=1000).tobytes() == expected
    assert build_corpus(packages=("lm_fake_corpus_pkg",), max_bytes=7).tobytes() == expected[:7]
    # Listing the package twice (or a package and its subpackage) reads each file once.
    both = build_corpus(packages=("lm_fake_corpus_pkg", "lm_fake_corpus_pkg.sub"), max_bytes=1000)
    assert both.tobytes() == expected
    assert build_corpus(packages=("lm_fake_corpus_pkg.sub",), max_bytes=1000).tobytes() == b"sub-a"


def test_corpus_subpackage_only() -> None:
    only = build_corpus(packages=("megatron.core",), max_bytes=50_000)
    assert only.size == 50_000
    assert not np.array_equal(only, build_corpus(max_bytes=50_000))  # default corpus starts with lightning


def test_corpus_errors() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        build_corpus(max_bytes=0)
    with pytest.raises(ValueError, match="packages"):
        build_corpus(packages=("definitely_not_an_installed_pkg_xyz",), max_bytes=100)
    with pytest.raises(ValueError, match="packages"):
        build_corpus(packages=(), max_bytes=100)


def test_corpus_cache_round_trip(tmp_path, corpus: np.ndarray) -> None:
    first = build_corpus(max_bytes=SMALL, cache_dir=tmp_path)
    cached = sorted(tmp_path.glob("corpus-*.npy"))
    assert len(cached) == 1
    assert not list(tmp_path.glob(".corpus-*"))  # temp file was renamed away
    np.testing.assert_array_equal(first, corpus)
    np.testing.assert_array_equal(np.load(cached[0]), corpus)

    # A hit must come from the file: overwrite it with a marker and check that is what gets returned.
    marker = np.arange(10, dtype=np.uint8)
    np.save(cached[0], marker)
    np.testing.assert_array_equal(build_corpus(max_bytes=SMALL, cache_dir=tmp_path), marker)

    # A different budget is a different key.
    build_corpus(max_bytes=SMALL // 2, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("corpus-*.npy"))) == 2


def test_packed_dataset_shapes_and_reconstruction(corpus: np.ndarray) -> None:
    seq = 64
    ds = PackedByteDataset(corpus, seq)
    assert len(ds) == corpus.size // seq
    item = ds[0]
    assert item.dtype == torch.long
    assert item.shape == (seq,)
    assert int(item.min()) >= 0
    assert int(item.max()) < VOCAB_SIZE
    joined = torch.cat([ds[i] for i in range(len(ds))]).numpy()
    np.testing.assert_array_equal(joined, corpus[: len(ds) * seq].astype(np.int64))
    torch.testing.assert_close(ds[-1], ds[len(ds) - 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_packed_dataset_errors() -> None:
    with pytest.raises(ValueError, match="seq_length"):
        PackedByteDataset(np.zeros(10, dtype=np.uint8), 0)
    with pytest.raises(ValueError, match="1-D"):
        PackedByteDataset(np.zeros((2, 5), dtype=np.uint8), 2)
    assert len(PackedByteDataset(np.zeros(3, dtype=np.uint8), 4)) == 0


def test_train_val_split() -> None:
    data = np.arange(100, dtype=np.uint8)
    train, val = train_val_split(data, 0.1)
    assert (train.size, val.size) == (90, 10)
    np.testing.assert_array_equal(np.concatenate([train, val]), data)
    np.testing.assert_array_equal(val, data[90:])  # tail is val


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_train_val_split_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(np.arange(100, dtype=np.uint8), fraction)


def test_train_val_split_empty_part() -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(np.arange(10, dtype=np.uint8), 0.01)  # val would be empty
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(np.arange(10, dtype=np.uint8), 0.99)  # train would be empty


def test_demo_dataloaders(tmp_path) -> None:
    seq, bs = 32, 4
    train_dl, val_dl = demo_dataloaders(seq, bs, max_bytes=SMALL, val_fraction=0.1, cache_dir=tmp_path)
    assert train_dl.drop_last
    assert val_dl.drop_last
    batch = next(iter(train_dl))
    assert batch.dtype == torch.long
    assert batch.shape == (bs, seq)
    # shuffle=False: the first batch is the start of the corpus.
    np.testing.assert_array_equal(batch.flatten().numpy(), build_corpus(max_bytes=SMALL)[: bs * seq])
    assert len(train_dl) == (int(SMALL * 0.9) // seq) // bs
    assert all(b.shape == (bs, seq) for b in val_dl)


def test_demo_dataloaders_num_val_batches() -> None:
    _, val_dl = demo_dataloaders(16, 2, max_bytes=20_000, num_val_batches=3)
    assert isinstance(val_dl.dataset, Subset)
    assert len(val_dl.dataset) == 6
    assert len(val_dl) == 3
    # More batches than exist: keep everything rather than fail.
    _, val_all = demo_dataloaders(16, 2, max_bytes=20_000, num_val_batches=10_000)
    assert len(val_all.dataset) == (1000 // 16)


def test_demo_dataloaders_too_small() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        demo_dataloaders(64, 8, max_bytes=2_000)


def test_synthetic_tokens_deterministic_and_in_range() -> None:
    a = synthetic_tokens(8, 16, 50, seed=3)
    assert a.dtype == torch.long
    assert a.shape == (8, 16)
    assert int(a.min()) >= 0
    assert int(a.max()) < 50
    torch.testing.assert_close(a, synthetic_tokens(8, 16, 50, seed=3))
    assert not torch.equal(a, synthetic_tokens(8, 16, 50, seed=4))


def test_synthetic_tokens_leaves_global_rng_untouched() -> None:
    state = torch.get_rng_state()
    synthetic_tokens(4, 32, 1000, seed=1)
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    synthetic_tokens(4, 32, 1000, seed=1)
    torch.testing.assert_close(torch.rand(3), expected)


def test_data_parallel_shard_deals_whole_rounds() -> None:
    from lightning_megatron import DataParallelShard

    # 11 samples over 2 ranks: both get 5 (the 11th would give rank 0 a batch more, alone in its collectives)
    assert [list(DataParallelShard(range(11), rank, 2)) for rank in range(2)] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    # DataLoader workers split a rank's share again, disjointly, each as many samples
    from torch.utils.data import DataLoader

    seen = [sorted(int(x) for x in DataLoader(DataParallelShard(range(20), rank, 2), num_workers=2)) for rank in (0, 1)]
    assert seen == [[0, 2, 4, 6, 8, 10, 12, 14, 16, 18], [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]]
    with pytest.raises(ValueError, match=r"rank=1, size=None"):
        DataParallelShard(range(4), rank=1)
