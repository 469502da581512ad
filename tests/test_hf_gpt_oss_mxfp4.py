"""GPT-OSS MXFP4 checkpoints in and out: the tiny random GPT-OSS of ``tests/hf_gpt_oss_models.py`` (2 layers, 4
experts, intermediate size 64 so that both expert projections span two 32-value blocks), its experts quantized there
with plain torch to MXFP4 as GPT-OSS ships them (``*_blocks`` uint8 ``[E, out, in / 32, 16]``, ``*_scales`` e8m0
``[E, out, in / 32]``, in a second file named by an index), layer 1's experts left in float32 and listed in
``modules_to_not_convert``.

At one process, logits and validation loss equal ``transformers`` on the dequantized weights (dequantized by the
helper, independently of the loader, and checked here against ``transformers``' own MXFP4 dequantization); an
expert-parallel rank reads only its experts' blocks and scales, and a tensor-parallel slice equals that slice of the
dequantized tensor; unsupported settings and inconsistent files are refused by name; the ``save_hf`` export loads in
``transformers`` (no ``quantization_config``) with our logits; ``weight_format="mxfp4"`` writes the source's bytes
back (a float GPT-OSS source's experts: ``tests/test_hf_gpt_oss.py``, with the helper's quantizer). The whole model
at EP=2 against ``transformers``: ``tests/test_hf_moe_layouts.py``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule
from lightning_megatron.gpt.hf import load as hf_load
from lightning_megatron.gpt.hf.load import ExpertPieces, HFCheckpoint, open_pretrained, read_local
from lightning_megatron.gpt.hf.mapping import chunk_params
from lightning_megatron.gpt.hf.mxfp4 import quantize
from lightning_megatron.gpt.hf.params import expert_piece, rank_block
from tests.hf_gpt_oss_models import dequantize_mxfp4, make_gpt_oss, make_mxfp4, quantize_mxfp4
from tests.hf_moe_models import Export, cpu_trainer, hf_forward
from tests.safe_open_reads import RecordingSafeOpen

SEQ = 16


def stored(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files."""
    return {name: t for file in sorted(path.glob("*.safetensors")) for name, t in load_file(file).items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf_mxfp4")
    return make_mxfp4(make_gpt_oss(root / "source", intermediate_size=64), root / "mxfp4")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


class ExportAll(Export):
    """The float export, and the MXFP4 one beside it (in files of about 20 kB)."""

    def on_predict_end(self, trainer: Any, module: MegatronLMModule) -> None:  # type: ignore[override]
        super().on_predict_end(trainer, module)
        with pytest.raises(ValueError, match=r"weight_format='fp8_block'\) .* this module's source is not block-q"):
            module.save_hf(self.path.with_name("unused"), weight_format="fp8_block")
        module.save_hf(self.path.with_name(self.path.name + "_mxfp4"), weight_format="mxfp4", max_shard_size=20_000)


@pytest.fixture(scope="module")
def one_process(models: tuple[Path, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    module = MegatronLMModule.from_hf(models[0], seq_length=SEQ)
    export = ExportAll(tmp_path_factory.mktemp("saved") / "gpt_oss")
    loader = DataLoader(tokens, batch_size=4)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
    val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
    return {"logits": logits, "val_loss": val_loss, "export": export}


def test_transformers_dequantizes_the_test_checkpoint_to_the_reference(models: tuple[Path, Path]) -> None:
    """The format written here is GPT-OSS's: transformers' own MXFP4 dequantization reads it as the reference."""
    path, reference = models
    config = transformers.Mxfp4Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    want = load_file(reference / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    assert set(model.state_dict()) == set(want)


def test_one_process_matches_transformers_on_the_dequantized_weights(
    one_process: dict, models: tuple[Path, Path], tokens: torch.Tensor
) -> None:
    path, reference = models
    assert any(name.endswith("_blocks") for name in stored(path))
    logits, loss, _ = hf_forward(reference, tokens)
    torch.testing.assert_close(one_process["logits"], logits, rtol=1e-4, atol=1e-4)
    assert one_process["val_loss"] == pytest.approx(loss, rel=1e-5)
    for name, tensor in load_file(reference / "model.safetensors").items():  # exactly the dequantized values
        assert torch.equal(one_process["export"].tensors[name], tensor), name


def test_the_float_export_loads_in_transformers_without_quantization(one_process: dict, tokens: torch.Tensor) -> None:
    saved = one_process["export"].path
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert all(t.dtype == torch.float32 for t in load_file(saved / "model.safetensors").values())
    logits, _, _ = hf_forward(saved, tokens)
    torch.testing.assert_close(logits, one_process["logits"], rtol=1e-4, atol=1e-4)


def test_the_mxfp4_export_is_the_source(one_process: dict, models: tuple[Path, Path]) -> None:
    """Every tensor as the source stored it, byte for byte (blocks, scales, layer 1's float experts), config.json's
    quantization_config kept; it reads back as the dequantized weights."""
    path, reference = models
    saved = one_process["export"].path.with_name("gpt_oss_mxfp4")
    config = json.loads((saved / "config.json").read_text())
    assert config["quantization_config"] == json.loads((path / "config.json").read_text())["quantization_config"]
    assert len(json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    written, source = stored(saved), stored(path)
    assert written.keys() == source.keys()
    for name, tensor in source.items():
        assert written[name].dtype == tensor.dtype, name
        assert torch.equal(written[name], tensor), name
    checkpoint, _ = open_pretrained(saved)
    with checkpoint.lazy_tensors() as lazy:
        for name, tensor in load_file(reference / "model.safetensors").items():
            assert torch.equal(lazy(name)[:], tensor), name


def test_quantize_gives_dequantized_values_back_and_agrees_with_the_test_quantizer() -> None:
    weight = torch.randn(3, 64, 40, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[0, :32, 0] = 0.0  # an all-zero block
    weight[1, :32, 1] = torch.tensor([6.0, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)  # e2m1 ties: to even codes
    blocks, scales = quantize(weight)
    expected = quantize_mxfp4(weight)
    keep = torch.ones(scales.shape, dtype=torch.bool)
    keep[0, 0, 0] = keep[1, 1, 0] = False  # (the test's quantizer has no rule for those two blocks)
    assert torch.equal(blocks[keep], expected[0][keep])
    assert torch.equal(scales[keep], expected[1][keep])
    assert scales[0, 0, 0] == 127
    assert (blocks[0, 0, 0] == 0).all()
    codes = torch.stack([blocks[1, 1, 0] & 15, blocks[1, 1, 0] >> 4], dim=-1).flatten()[:8]
    assert codes.tolist() == [7, 8, 2, 2, 4, 4, 6, 6]  # 6, -0, 1, 1, 2, 2, 4, 4 (scale 2**0)
    values = dequantize_mxfp4(blocks, scales)
    again = quantize(values)
    assert torch.equal(again[0], blocks)
    assert torch.equal(again[1], scales)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_an_expert_parallel_rank_reads_only_its_experts_blocks(
    tp: int, models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table of expert-parallel rank 1 of 2 (experts 2 and 3) at expert tensor parallelism ``tp``: each piece a
    rank reads equals that rank's block of the fully dequantized expert, and the loader's reads of blocks and scales
    are of experts 2 and 3 only, each the rank's output rows (gate_up) or the blocks over its input rows (down)."""
    path, reference = models
    checkpoint, config = open_pretrained(path)
    full = load_file(reference / "model.safetensors")
    monkeypatch.setattr(hf_load, "safe_open", RecordingSafeOpen)
    RecordingSafeOpen.reads = []
    params = chunk_params(config, pre=False, post=False, offset=0, num_layers=1, experts=range(2, 4))
    params = [p for p in params if p.expert is not None]
    with checkpoint.lazy_tensors() as lazy:
        pieces = ExpertPieces(lazy, 4)
        for p, rank in [(p, rank) for p in params for rank in range(tp)]:
            whole, expert = expert_piece(p.hf[0][0])
            want = rank_block(p.kind, full[whole][expert], rank, tp)
            assert torch.equal(pieces.read(p.hf[0][0], p.kind, rank, tp), want), (p, rank)
            read_local(p, lazy, pieces, rank, tp, config)  # (what _copy_shards copies)
    packed = [read for read in RecordingSafeOpen.reads if read[0].endswith(("_blocks", "_scales"))]
    assert {index[0] for _, index, _ in packed} == {2, 3}
    for name, _, shape in packed:
        if "gate_up_proj" in name:  # [E, 128 out, 2 blocks, 16]: a rank's 128 / tp output rows, both blocks
            assert shape[:2] == (128 // tp, 2), (name, shape)
        else:  # [E, 64 out, 2 blocks of the 64 inputs, 16]: the blocks over a rank's 64 / tp input rows
            assert shape[:2] == (64, math.ceil(64 // tp / 32)), (name, shape)


def _tampered(models: tuple[Path, Path], tmp_path: Path, config: dict | None, **files: Any) -> Path:
    """A copy of the MXFP4 checkpoint with config.json's quantization_config updated (None: removed) and tensors of
    the blocks' file replaced (a tensor None: removed)."""
    path = Path(shutil.copytree(models[0], tmp_path / "mxfp4"))
    written = json.loads((path / "config.json").read_text())
    if config is None:
        del written["quantization_config"]
    else:
        written.update({k: v for k, v in config.items() if k != "quantization_config"})
        written["quantization_config"].update(config.get("quantization_config", {}))
    (path / "config.json").write_text(json.dumps(written))
    if files:
        part = {**load_file(path / "model-00002-of-00002.safetensors"), **files}
        part = {n: t for n, t in part.items() if t is not None}
        save_file(part, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.endswith(("_blocks", "_scales"))}
        index["weight_map"].update(dict.fromkeys(part, "model-00002-of-00002.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize(
    ("config", "files", "match"),
    [
        ({"quantization_config": {"group_size": 64}}, {}, r"quantization_config\.group_size=64 is not supported"),
        ({"quantization_config": {"modules_to_not_convert": "lm_head"}}, {}, r"modules_to_not_convert='lm_head' is"),
        (
            {"quantization_config": {"modules_to_not_convert": ["model.layers.0.mlp.experts"]}},
            {},
            rf"{GATE_UP}_blocks in .* is MXFP4, but quantization_config\.modules_to_not_convert lists 'model\.layers",
        ),
        ({"architectures": ["Qwen3ForCausalLM"]}, {}, r"MXFP4 weights are read for GPT-OSS's experts only, not Qwen3"),
        (None, {}, r"missing from .*: model\.layers\.0\.mlp\.experts\.gate_up_proj, "),
        ({}, {GATE_UP + "_scales": None}, rf"{GATE_UP}_blocks in .* has no {GATE_UP}_scales"),
        ({}, {GATE_UP + "_scales": torch.ones(4, 128, 1, dtype=torch.uint8)}, r"U8 \(4, 128, 1\); .* U8 \(4, 128, 2\)"),
        ({}, {GATE_UP + "_blocks": torch.ones(4, 128, 2, 16)}, rf"{GATE_UP}_blocks in .* is F32 \(4, 128, 2, 16\)"),
        ({}, {GATE_UP: torch.ones(4, 64, 128)}, rf"{GATE_UP} is in .* in float and in .* as MXFP4"),
    ],
)
def test_unsupported_settings_and_inconsistent_files_are_named(
    config: dict | None, files: dict, match: str, models: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=match):
        open_pretrained(_tampered(models, tmp_path, config, **files))


def test_nan_scales_are_refused_when_read(models: tuple[Path, Path], tmp_path: Path) -> None:
    scales = load_file(models[0] / "model-00002-of-00002.safetensors")[GATE_UP + "_scales"].clone()
    scales[3, 5, 1] = 255
    with HFCheckpoint.open(_tampered(models, tmp_path, {}, **{GATE_UP + "_scales": scales})).lazy_tensors() as lazy:
        lazy(GATE_UP)[2]  # another expert: read
        with pytest.raises(ValueError, match=rf"{GATE_UP}_scales of expert 3 holds e8m0 NaN scales"):
            lazy(GATE_UP)[3]


def test_only_gpt_oss_is_written_in_mxfp4() -> None:
    from lightning_megatron import tiny_gpt

    with pytest.raises(ValueError, match=r"weight_format='mxfp4'\) writes GPT-OSS's experts .* written as Llama"):
        MegatronLMModule(tiny_gpt()).save_hf("unused", weight_format="mxfp4")
