"""fp8 block-quantized HF checkpoints in (and out): tiny random Qwen3 and DeepSeek-V3 models written with
``save_pretrained``, their ``*_proj`` weights quantized here with plain torch to ``float8_e4m3fn`` with a float32
``*_scale_inv`` per block of ``weight_block_size`` (blocks that do not divide the shapes, so last blocks are partial),
and config.json's ``quantization_config`` as DeepSeek-V3 ships it.

At one process, logits and validation loss equal ``transformers`` on the dequantized weights (dequantized here,
independently of the loader); a tensor-parallel rank's slice equals that slice of the dequantized tensor and reads only
its range; unsupported settings and inconsistent files are refused by name; the ``save_hf`` export loads in
``transformers`` (no ``quantization_config``) with our logits; ``weight_format="fp8_block"`` writes the source's
format back.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule
from lightning_megatron.gpt.hf.load import HFCheckpoint, open_pretrained, read_shard
from lightning_megatron.gpt.hf.params import Kind, rank_block
from lightning_megatron.gpt.hf.quantized import DequantizedSlice
from tests.hf_deepseek_models import VARIANTS
from tests.hf_deepseek_models import make_model as make_deepseek
from tests.hf_dense_models import make_hf_model
from tests.hf_moe_models import Export, cpu_trainer, hf_forward
from tests.quantized_files import write_quantized

SEQ = 16
UNCONVERTED = "model.layers.1.mlp.down_proj"  # listed in modules_to_not_convert: stays float32
MODELS = {"qwen3": [40, 24], "deepseek_v3": [16, 24]}  # weight_block_size: partial last blocks in both dimensions


def quantize_blocks(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values and float32 scale_inv per block, as DeepSeek's releases are made."""
    (rows, cols), (b0, b1) = w.shape, block
    grid = math.ceil(rows / b0), math.ceil(cols / b1)
    scale = torch.empty(grid)
    fp8 = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            scale[i, j] = part.abs().max() / 448
            fp8[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return fp8, scale


def dequantize_blocks(fp8: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    rows, cols = fp8.shape
    spread = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return fp8.float() * spread


def make_fp8(source: Path, path: Path, block: list[int]) -> tuple[Path, Path]:
    """``source`` with its ``*_proj`` weights block-quantized (scales in a second file, named by an index), and the
    reference: ``source`` with those weights replaced by their dequantized values."""
    tensors = load_file(source / "model.safetensors")
    weights, scales, reference = {}, {}, dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight") and not name.startswith(UNCONVERTED):
            weights[name], scales[name + "_scale_inv"] = quantize_blocks(tensor, block)
            reference[name] = dequantize_blocks(weights[name], scales[name + "_scale_inv"], block)
        else:
            weights[name] = tensor
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block,
                    "modules_to_not_convert": ["lm_head", UNCONVERTED]}  # fmt: skip
    return write_quantized(source, path, (weights, scales), quantization, reference)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("hf_fp8")
    sources = {
        "qwen3": make_hf_model("qwen3", root / "qwen3_source"),
        "deepseek_v3": make_deepseek(root / "deepseek_v3_source", **VARIANTS["q_lora_yarn"]),
    }
    return {name: make_fp8(sources[name], root / name, MODELS[name]) for name in MODELS}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


class ExportBoth(Export):
    """The float export, and the fp8 one beside it (in files of about 20 kB: a weight and its scales may part)."""

    def on_predict_end(self, trainer: Any, module: MegatronLMModule) -> None:  # type: ignore[override]
        super().on_predict_end(trainer, module)
        with pytest.raises(ValueError, match=r"weight_format='int4'\): 'float' writes dtype tensors, 'fp8_block'"):
            module.save_hf(self.path.with_name("unused"), weight_format="int4")  # type: ignore[arg-type]
        module.save_hf(self.path.with_name(self.path.name + "_fp8"), weight_format="fp8_block", max_shard_size=20_000)


@pytest.fixture(scope="module")
def one_process(models: dict, tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    results = {}
    for name, (path, _) in models.items():
        module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = ExportBoth(tmp_path_factory.mktemp("saved") / name)
        loader = DataLoader(tokens, batch_size=4)
        logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
        val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
        results[name] = {"logits": logits, "val_loss": val_loss, "export": export, "module": module}
    return results


@pytest.mark.parametrize("name", list(MODELS))
def test_one_process_matches_transformers_on_the_dequantized_weights(
    name: str, one_process: dict, models: dict, tokens: torch.Tensor
) -> None:
    path, reference = models[name]
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(path / "model-00001-of-00002.safetensors").values())
    logits, loss, _ = hf_forward(reference, tokens)
    got = one_process[name]
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
    dequantized = load_file(reference / "model.safetensors")
    for tensor_name, tensor in dequantized.items():  # the weights themselves: exactly the dequantized values
        assert torch.equal(got["export"].tensors[tensor_name], tensor), tensor_name


@pytest.mark.parametrize("name", list(MODELS))
def test_the_export_loads_in_transformers_without_quantization(
    name: str, one_process: dict, models: dict, tokens: torch.Tensor
) -> None:
    saved = one_process[name]["export"].path
    config = json.loads((saved / "config.json").read_text())
    assert "quantization_config" not in config
    assert all(t.dtype == torch.float32 for t in load_file(saved / "model.safetensors").values())
    logits, _, _ = hf_forward(saved, tokens)
    torch.testing.assert_close(logits, one_process[name]["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_fp8_export_is_the_source_format(name: str, one_process: dict, models: dict) -> None:
    """fp8 values as the source's, scales within rounding of it, config.json's quantization_config kept; and it
    reads back (checked by name, shape and scales) as the dequantized weights."""
    path, reference = models[name]
    saved = one_process[name]["export"].path.with_name(name + "_fp8")
    config = json.loads((saved / "config.json").read_text())
    assert config["quantization_config"] == json.loads((path / "config.json").read_text())["quantization_config"]
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    written = {n: t for file in set(index.values()) for n, t in load_file(saved / file).items()}
    source = {n: t for file in ("model-00001-of-00002", "model-00002-of-00002")
              for n, t in load_file(path / f"{file}.safetensors").items()}  # fmt: skip
    assert written.keys() == source.keys()
    for tensor_name, tensor in source.items():
        assert written[tensor_name].dtype == tensor.dtype, tensor_name
        if tensor.dtype == torch.float8_e4m3fn:
            assert torch.equal(written[tensor_name].float(), tensor.float()), tensor_name
        else:
            torch.testing.assert_close(written[tensor_name], tensor, rtol=1e-6, atol=0)
    checkpoint, _ = open_pretrained(saved)
    dequantized = load_file(reference / "model.safetensors")
    with checkpoint.lazy_tensors() as lazy:
        for tensor_name, tensor in dequantized.items():
            torch.testing.assert_close(lazy(tensor_name)[:], tensor, rtol=1e-6, atol=0)


SLICED: list[tuple[str, Kind]] = [
    ("model.layers.0.self_attn.q_proj.weight", "rows"),  # [128, 64]: rank 1 of 2 starts inside a block row
    ("model.layers.0.self_attn.o_proj.weight", "cols"),  # [64, 128]
    ("model.layers.1.mlp.gate_proj.weight", "rows"),  # [96, 64]
    ("model.layers.0.mlp.down_proj.weight", "cols"),  # [64, 96]
    (UNCONVERTED + ".weight", "cols"),  # float32: read as stored
    ("model.embed_tokens.weight", "rows"),
]


@pytest.mark.parametrize(("name", "kind"), SLICED)
def test_a_tensor_parallel_slice_is_the_slice_of_the_dequantized_tensor(name: str, kind: Kind, models: dict) -> None:
    path, reference = models["qwen3"]
    full = load_file(reference / "model.safetensors")[name]
    checkpoint = HFCheckpoint.open(path)
    with checkpoint.lazy_tensors() as lazy:
        for tp in (1, 2, 4):
            for rank in range(tp):
                assert torch.equal(read_shard(lazy(name), kind, rank, tp), rank_block(kind, full, rank, tp))


class Recording:
    """A lazy slice that records the shape of each read."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.reads = inner, []

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        read = self.inner[index]
        self.reads.append(tuple(read.shape))
        return read


def test_a_rank_reads_only_its_range_and_the_scales_of_its_blocks(models: dict) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"  # [64, 128] in blocks of [40, 24]: 2 x 6 scales
    with HFCheckpoint.open(models["qwen3"][0]).lazy_tensors(raw=True) as lazy:
        weight, scale = Recording(lazy(name)), Recording(lazy(name + "_scale_inv"))
        shard = read_shard(DequantizedSlice(weight, scale, (40, 24)), "cols", 1, 2)
    assert shard.shape == (64, 64)
    assert weight.reads == [(64, 64)]  # columns 64..127 only, in fp8
    assert scale.reads == [(2, 4)]  # the block columns 2..5 that cover them


def _tampered(models: dict, tmp_path: Path, quantization: dict | None, **files: Any) -> Path:
    """A copy of the fp8 Qwen3 with quantization_config changed (None: removed) and tensors of the scales' file
    replaced (a tensor None: removed)."""
    path = Path(shutil.copytree(models["qwen3"][0], tmp_path / "fp8"))
    config = json.loads((path / "config.json").read_text())
    if quantization is None:
        del config["quantization_config"]
    else:
        config["quantization_config"] = {**config["quantization_config"], **quantization}
    (path / "config.json").write_text(json.dumps(config))
    if files:
        scales = {**load_file(path / "model-00002-of-00002.safetensors"), **files}
        scales = {n: t for n, t in scales.items() if t is not None}
        save_file(scales, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.endswith("_scale_inv")}
        index["weight_map"].update(dict.fromkeys(scales, "model-00002-of-00002.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        ({"quant_method": "gptq"}, r"quant_method='gptq' is not supported"),
        ({"quant_method": "compressed-tensors"}, r"quant_method='compressed-tensors' is not supported"),
        ({"fmt": "e5m2"}, r"quantization_config\.fmt='e5m2' is not supported"),
        ({"activation_scheme": "static"}, r"activation_scheme='static' is not supported"),
        ({"weight_block_size": None}, r"weight_block_size=None is not supported"),
        ({"weight_block_size": [128]}, r"weight_block_size=\[128\] is not supported"),
        ({"scale_fmt": "ue8m0"}, r"scale_fmt='ue8m0' is not supported"),
        ({"modules_to_not_convert": "lm_head"}, r"modules_to_not_convert='lm_head' is not a list"),
        (
            {"modules_to_not_convert": ["model.layers.0.self_attn"]},
            r"q_proj\.weight in .* is F8_E4M3, but quantization_config\.modules_to_not_convert lists "
            r"'model\.layers\.0\.self_attn'",
        ),
        (None, r"q_proj\.weight in .* is F8_E4M3 \(fp8\), but config\.json has no quantization_config"),
    ],
)
def test_unsupported_quantization_settings_are_named(
    quantization: dict | None, match: str, models: dict, tmp_path: Path
) -> None:
    path = _tampered(models, tmp_path, quantization)
    with pytest.raises(ValueError, match=match):
        open_pretrained(path)


Q = "model.layers.0.self_attn.q_proj.weight"
KEPT = UNCONVERTED + ".weight"


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({Q + "_scale_inv": None}, rf"{Q} in .* is F8_E4M3 but has no {Q}_scale_inv"),
        ({Q + "_scale_inv": torch.ones(3, 2)}, r"q_proj\.weight_scale_inv in .* is F32 \(3, 2\); .* needs \(4, 3\)"),
        ({Q + "_scale_inv": torch.ones(4, 3, dtype=torch.int32)}, r"is I32 \(4, 3\)"),
        ({KEPT + "_scale_inv": torch.ones(2, 4)}, rf"{KEPT}_scale_inv in .* scales {KEPT}, which is F32, not"),
        ({"model.layers.0.mlp.unknown_scale_inv": torch.ones(1)}, r"does not explain: model\.layers\.0\.mlp\.unk"),
    ],
)
def test_inconsistent_fp8_files_are_refused(files: dict, match: str, models: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        open_pretrained(_tampered(models, tmp_path, {}, **files))


def test_adapters_take_no_weight_format() -> None:
    from lightning_megatron import MegatronLMModule, tiny_gpt

    with pytest.raises(ValueError, match=r"adapter=True, weight_format='fp8_block'\): adapters are written in dtype"):
        MegatronLMModule(tiny_gpt()).save_hf("unused", adapter=True, weight_format="fp8_block")
