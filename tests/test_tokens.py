"""Token files (numpy memmap) and their data module: writing, reading, packing, the train/val split, errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_megatron import TokenFileDataModule
from lightning_megatron.data import modules as data_modules
from lightning_megatron.data.tokens import main as tokens_main
from lightning_megatron.data.tokens import open_tokens, write_token_file


def _file(tmp_path: Path, n: int, dtype: str = "uint16", name: str = "tokens.bin") -> Path:
    path = tmp_path / name
    assert write_token_file([np.arange(n) % 50_000], path, dtype) == n
    return path


def test_windows_pack_the_file_and_the_tail_is_validation(tmp_path: Path) -> None:
    path = _file(tmp_path, 1000)  # 62 windows of 16 tokens; the last 8 tokens are dropped
    dm = TokenFileDataModule(str(path), seq_length=16, batch_size=2, val_fraction=0.1, shuffle=False)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (56, 6)
    joined = torch.cat([*(dm.train_set[i] for i in range(56)), *(dm.val_set[i] for i in range(6))])
    assert torch.equal(joined, torch.arange(62 * 16))  # every window once, in file order, no overlap
    assert dm.train_set[0].dtype == torch.long
    assert torch.equal(dm.val_set[-1], dm.val_set[5])
    with pytest.raises(IndexError):
        dm.val_set[6]
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert torch.equal(torch.cat(list(train)), torch.cat([dm.train_set[i] for i in range(56)]).view(-1, 16))
    assert len(val) == 3
    assert train.drop_last
    assert not train.pin_memory  # no Trainer on CUDA: pageable batches (pin_memory=True asks for pinned ones)
    assert TokenFileDataModule(str(path), seq_length=16, pin_memory=True)._pin_memory()
    # Lightning keeps a DistributedSampler it finds (it would otherwise inject its own, always shuffled).
    assert isinstance(train.sampler, DistributedSampler)
    shuffled = TokenFileDataModule(str(path), seq_length=16, batch_size=2, val_fraction=0.1, seed=3)
    shuffled.setup("fit")
    order = torch.cat(list(shuffled.train_dataloader()))[:, 0] // 16
    assert sorted(order.tolist()) == list(range(56))
    assert order.tolist() != list(range(56))
    capped = TokenFileDataModule(str(path), seq_length=16, batch_size=2, val_fraction=0.1, num_val_batches=1)
    capped.setup("fit")
    assert len(capped.val_set) == 2


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_by_data_parallel_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool) -> None:
    """4 processes at TP=2 x DP=2 (Megatron puts TP peers on consecutive global ranks: DP rank = global // 2)."""
    path = _file(tmp_path, 16 * 103)  # 103 windows: 93 train, 10 val; odd counts, so each rank drops one
    seen = {}
    for global_rank in range(4):
        monkeypatch.setattr(data_modules, "data_parallel_rank_and_size", lambda r=global_rank: (r // 2, 2))
        dm = TokenFileDataModule(str(path), seq_length=16, batch_size=2, val_fraction=0.1, shuffle=shuffle)
        dm.setup("fit")
        seen[global_rank] = [[int(b[0]) // 16 for b in loader_batches] for loader_batches in (
            torch.cat(list(dm.train_dataloader())), torch.cat(list(dm.val_dataloader())))]  # fmt: skip
    assert seen[0] == seen[1]  # tensor-parallel peers read the same windows
    assert seen[2] == seen[3]
    for split, total, first in ((0, 93, 0), (1, 10, 93)):
        a, b = seen[0][split], seen[2][split]
        assert not set(a) & set(b)  # data-parallel ranks read disjoint windows
        assert len(a) == len(b) == (total // 2) // 2 * 2  # even shards, whole batches
        assert set(a) | set(b) <= set(range(first, first + total))
    assert (seen[0][0] != sorted(seen[0][0])) == shuffle  # file order unless shuffled (validation never is)
    assert seen[0][1] == sorted(seen[0][1])


def test_uint32_npy_and_pickling_without_the_data(tmp_path: Path) -> None:
    ids = np.array([70_000, 1, 2, 3, 100_000, 5, 6, 7] * 4, dtype=np.uint32)
    np.save(tmp_path / "t.npy", ids)
    dm = TokenFileDataModule(str(tmp_path / "t.npy"), seq_length=4, batch_size=1, val_fraction=0.25)
    dm.setup("fit")
    assert dm.train_set[0].tolist() == [70_000, 1, 2, 3]
    write_token_file([ids[:4], ids[4:]], tmp_path / "t32.bin", "uint32")
    assert open_tokens(tmp_path / "t32.bin", "uint32").tolist() == ids.tolist()
    # DataLoader workers receive the dataset pickled: the memmap must not travel (it would copy the file).
    blob = pickle.dumps(dm.train_set)
    assert len(blob) < 1000
    assert pickle.loads(blob)[1].tolist() == [100_000, 5, 6, 7]


def test_errors_name_field_value_and_fix(tmp_path: Path) -> None:
    path = _file(tmp_path, 100)
    with pytest.raises(ValueError, match=r"dtype='uint8' is not a token dtype; use one of"):
        TokenFileDataModule(str(path), seq_length=8, dtype="uint8")
    with pytest.raises(ValueError, match=r"seq_length=0 must be a positive integer"):
        TokenFileDataModule(str(path), seq_length=0)
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \(0, 1\)"):
        TokenFileDataModule(str(path), seq_length=8, val_fraction=1.0)
    with pytest.raises(ValueError, match=r"12 windows of seq_length=8: 11 train and 1 val .* batch_size=2 x 1 data"):
        TokenFileDataModule(str(path), seq_length=8, batch_size=2, val_fraction=0.1).setup("fit")
    with pytest.raises(ValueError, match=r"is not a file; write one with lightning-megatron-tokens"):
        open_tokens(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"x" * 201)
    with pytest.raises(ValueError, match=r"201 bytes is not a multiple of 2 \(dtype='uint16'\)"):
        open_tokens(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match=r"token id 70000 does not fit dtype='uint16'; use uint32"):
        write_token_file([[1, 70_000]], tmp_path / "big.bin")
    assert not (tmp_path / "big.bin").exists()  # nothing under the real name after a failed write
    with pytest.raises(ValueError, match=r"empty.bin' is empty; it holds no tokens"):
        open_tokens(_file(tmp_path, 0, name="empty.bin"))
    np.save(tmp_path / "f.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"holds float64\[3\]"):
        open_tokens(tmp_path / "f.npy")


def test_token_file_command_is_installed() -> None:
    # The documented command is a console script: `python -m lightning_megatron.data.tokens` makes runpy warn (the
    # package imports that module before running it as __main__).
    from importlib.metadata import entry_points

    commands = entry_points(group="console_scripts", name="lightning-megatron-tokens")
    assert len(commands) == 1, "no lightning-megatron-tokens command: pyproject.toml lacks it, or run pip install -e ."
    assert next(iter(commands)).load() is tokens_main


def test_token_file_script_writes_byte_ids(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    # main() is what the lightning-megatron-tokens command runs; in-process (a subprocess costs ~7 s of imports).
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b.txt").write_bytes(b"world")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "corpus" / "tokens.bin"
    tokens_main(["a.txt", "b.txt", "--out", str(out)])
    assert "wrote 12 tokens (uint16)" in capsys.readouterr().out
    assert bytes(open_tokens(out).astype(np.uint8)) == b"hello\n\nworld"


def test_token_file_script_with_a_local_hf_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"</s>": 0, "[UNK]": 1, "hello": 2, "world": 3, "again": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="[UNK]").save_pretrained(
        tmp_path / "tok"
    )
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.txt").write_text("world again hello")
    out = tmp_path / "ids.bin"
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    tokens_main([*inputs, "--out", str(out), "--tokenizer", str(tmp_path / "tok")])
    assert "wrote 7 tokens" in capsys.readouterr().out
    assert open_tokens(out).tolist() == [2, 3, 0, 3, 4, 2, 0]  # each document ends with EOS
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").eos_token_id == 0
