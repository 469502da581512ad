"""Hugging Face in and out: Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 / Gemma 2 import, export and round trips at
one process (the tiny random models of ``tests/hf_dense_models.py``; nothing is downloaded).

Parity is against ``transformers`` in float32 with eager attention: logits from ``trainer.predict`` and the loss
from ``trainer.validate`` on the same tokens, for every architecture; configuration mapping, the export's names and
shapes, exact round trips, packed rows, and the errors of a checkpoint or configuration that cannot be imported. The
same models at TP=2, PP=2, CP=2 and TP=2 x PP=2: ``tests/test_hf_layouts.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, ModelConfig, pack_sequences, tiny_gpt
from lightning_megatron.gpt.hf.config import check_exportable
from lightning_megatron.gpt.hf.mapping import family, hf_weight_shapes
from tests.hf_dense_models import (
    ARCHS,
    LLAMA3_ROPE,
    SEQ,
    ExportAndSave,
    hf_forward,
    hf_state_shapes,
)
from tests.hf_moe_models import cpu_trainer, hf_per_document, packed_documents


@pytest.fixture(scope="module")
def one_process(hf_models: dict[str, Path], hf_tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every architecture at one process: predict (exporting and saving at its end) and validate."""
    results = {}
    for arch, path in hf_models.items():
        module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = ExportAndSave(tmp_path_factory.mktemp("saved") / arch)
        loader = DataLoader(hf_tokens, batch_size=4)
        logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
        val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
        results[arch] = {"logits": logits, "val_loss": val_loss, "export": export, "module": module}
    return results


# ------------------------------------------------------------------------------------------- config mapping
def test_config_from_hf_maps_each_architecture(hf_models: dict[str, Path]) -> None:
    llama = ModelConfig.from_hf(hf_models["llama"])
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads, llama.num_query_groups) == (4, 64, 8, 4)
    assert (llama.kv_channels, llama.ffn_hidden_size, llama.vocab_size, llama.norm_epsilon) == (8, 96, 128, 1e-6)
    assert (llama.rotary_base, llama.rope_scaling, llama.rope_scaling_factor) == (500000, True, 8.0)
    assert llama.seq_length == 16384
    assert not llama.share_embeddings_and_output_weights
    assert not llama.add_qkv_bias
    assert not llama.qk_layernorm
    mistral = ModelConfig.from_hf(hf_models["mistral"])
    assert mistral.seq_len_interpolation_factor == 2.0
    assert mistral.seq_length == 64  # capped by the sliding window
    qwen2 = ModelConfig.from_hf(json.loads((hf_models["qwen2"] / "config.json").read_text()), seq_length=SEQ)
    assert qwen2.add_qkv_bias
    assert qwen2.share_embeddings_and_output_weights
    assert qwen2.seq_length == SEQ
    qwen3 = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(hf_models["qwen3"]), hidden_dropout=0.1)
    assert qwen3.qk_layernorm
    assert qwen3.kv_channels == 32
    assert qwen3.hidden_dropout == 0.1
    assert not qwen3.add_qkv_bias


# ------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("arch", list(ARCHS))
def test_one_process_matches_transformers(
    arch: str, one_process: dict, hf_models: dict, hf_tokens: torch.Tensor
) -> None:
    logits, loss = hf_forward(hf_models[arch], hf_tokens)
    got = one_process[arch]
    assert got["logits"].shape == (4, SEQ, 128)
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_llama3_rope_frequencies_match_transformers(one_process: dict, hf_models: dict) -> None:
    # At 16 tokens the scaled low frequencies barely move the logits: compare the frequencies themselves.
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    chunk = one_process["llama"]["module"].chunks[0]
    # The torch-native attention (kernels "auto" on CPU too) applies RoPE inside: its table's RotaryEmbedding.
    inv_freq = chunk.decoder.layers[0].self_attention.core_attention.rope.embedding.inv_freq
    torch.testing.assert_close(inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    unscaled = 1.0 / 500000 ** (torch.arange(0, 8, 2).float() / 8)  # head_dim 8
    assert not torch.allclose(inv_freq, unscaled)  # the scaling is in effect


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_names_and_shapes_are_the_hf_state_dict(arch: str, one_process: dict, hf_models: dict) -> None:
    want = hf_state_shapes(hf_models[arch])
    assert one_process[arch]["export"].shapes == want
    assert hf_weight_shapes(one_process[arch]["module"].config) == want


@pytest.mark.parametrize("arch", list(ARCHS))
def test_untrained_round_trip_is_exact(arch: str, one_process: dict, hf_models: dict, hf_tokens: torch.Tensor) -> None:
    saved = one_process[arch]["export"].path
    original, written = load_file(hf_models[arch] / "model.safetensors"), load_file(saved / "model.safetensors")
    assert set(written) == set(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((saved / "config.json").read_text()) == json.loads((hf_models[arch] / "config.json").read_text())
    assert (
        hf_forward(saved, hf_tokens)[1] == hf_forward(hf_models[arch], hf_tokens)[1]
    )  # transformers loads it unchanged


@pytest.mark.parametrize("arch", list(ARCHS))
def test_family_adapter_converts_whole_state_dicts(arch: str, one_process: dict, hf_models: dict) -> None:
    """The family's to_hf / from_hf (one process, whole state dicts) agree with the model that import built and
    that matches transformers' logits: from_hf of the HF file is its state dict, to_hf of its state dict the file."""
    module = one_process[arch]["module"]
    adapter = family(module.config)
    families = {"llama": "Llama", "mistral": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma3",
                "gemma2": "Gemma2"}  # fmt: skip
    assert type(adapter).__name__ == families[arch]
    original = load_file(hf_models[arch] / "model.safetensors")
    params = {name: p.detach() for name, p in module.chunks[0].named_parameters()}
    converted = adapter.from_hf(original, module.config)
    assert converted.keys() == params.keys()
    for name, tensor in converted.items():
        assert torch.equal(tensor, params[name]), name
    back = adapter.to_hf(params, module.config)
    assert list(back) == [name for name in hf_weight_shapes(module.config, include_tied=False)]
    tied = {"lm_head.weight"} if module.config.share_embeddings_and_output_weights else set()
    assert back.keys() == original.keys() - tied
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name


def test_no_family_holds_qkv_biases_with_qk_norms() -> None:
    with pytest.raises(ValueError, match=r"no HF architecture holds a model with add_qkv_bias=True, qk_layernorm=True"):
        check_exportable(tiny_gpt(add_qkv_bias=True, qk_layernorm=True))


GENERATED = {
    "Qwen2ForCausalLM": {"add_qkv_bias": True, "share_embeddings_and_output_weights": True},
    "Qwen3ForCausalLM": {"qk_layernorm": True, "kv_channels": 32},
    "LlamaForCausalLM": {"rope_scaling": True, "rotary_base": 500000},
}


@pytest.mark.parametrize("arch", list(GENERATED))
def test_save_hf_of_a_model_not_from_hf(arch: str, tmp_path: Path, hf_tokens: torch.Tensor) -> None:
    """A ModelConfig-built model is written with a generated config.json that transformers loads."""
    config = tiny_gpt(num_layers=2, vocab_size=128, num_query_groups=2, seq_length=SEQ, **GENERATED[arch])
    export = ExportAndSave(tmp_path / "out")
    logits = torch.cat(
        cpu_trainer(callbacks=[export]).predict(MegatronLMModule(config), DataLoader(hf_tokens, batch_size=4))
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [arch]
    torch.testing.assert_close(hf_forward(tmp_path / "out", hf_tokens)[0], logits, rtol=1e-4, atol=1e-4)


def test_models_without_an_hf_counterpart_are_not_exported() -> None:
    with pytest.raises(ValueError, match=r"normalization='LayerNorm', add_bias_linear=True: no HF counterpart"):
        check_exportable(tiny_gpt(normalization="LayerNorm", add_bias_linear=True))


def test_sharded_hf_checkpoint(hf_models: dict, one_process: dict, tmp_path: Path, hf_tokens: torch.Tensor) -> None:
    transformers.AutoModelForCausalLM.from_pretrained(hf_models["qwen2"]).save_pretrained(
        tmp_path, max_shard_size="50KB"
    )
    assert (tmp_path / "model.safetensors.index.json").is_file()
    module = MegatronLMModule.from_hf(tmp_path, seq_length=SEQ)
    val_loss = cpu_trainer().validate(module, DataLoader(hf_tokens, batch_size=4))[0]["val_loss"]
    assert val_loss == one_process["qwen2"]["val_loss"]


def test_packed_rows_match_each_document_alone(hf_models: dict) -> None:
    """One process: packed rows give transformers' per-document loss and log-probs, and our own run of the same
    documents unpacked (one per row, padded with ignored labels) gives the same loss."""
    want_loss, want_logprobs = hf_per_document(hf_models["llama"])
    module = MegatronLMModule.from_hf(hf_models["llama"], seq_length=SEQ, config_overrides={"kernels": "torch"})
    rows = DataLoader(pack_sequences(packed_documents(), SEQ), batch_size=4)
    assert cpu_trainer().validate(module, rows)[0]["val_loss"] == pytest.approx(want_loss, rel=1e-5)
    unpacked = []
    for doc in packed_documents():
        pad = SEQ - len(doc)
        labels = torch.cat([doc, torch.full((pad,), -100)])
        unpacked.append({"input_ids": torch.cat([doc, torch.zeros(pad, dtype=torch.long)]), "labels": labels})
    loss = cpu_trainer().validate(module, DataLoader(unpacked, batch_size=8))[0]["val_loss"]
    assert loss == pytest.approx(want_loss, rel=1e-5)
    module.prediction = "logprobs"
    got = torch.cat([p["logprobs"] for p in cpu_trainer().predict(module, rows)])
    torch.testing.assert_close(got, want_logprobs, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- errors
def _copy(src: Path, dst: Path, drop: str | None = None, config: dict | None = None) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop}, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = {**json.loads((src / "config.json").read_text()), **(config or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_wrong_architecture(tmp_path: Path) -> None:
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM.*Qwen3ForCausalLM.*Bridge"):
        MegatronLMModule.from_hf(tmp_path)


def test_missing_tensor(hf_models: dict, tmp_path: Path) -> None:
    path = _copy(hf_models["qwen2"], tmp_path / "m", drop="model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(ValueError, match=r"missing from .*model\.safetensors: model\.layers\.1\.self_attn\.k_proj\."):
        MegatronLMModule.from_hf(path)


def test_shapes_that_disagree_with_the_config(hf_models: dict, tmp_path: Path) -> None:
    path = _copy(hf_models["llama"], tmp_path / "m", config={"intermediate_size": 128})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight in .*model\.safetensors has "
                                         r"shape \(96, 64\), but config\.json implies \(128, 64\)"):  # fmt: skip
        MegatronLMModule.from_hf(path)


def test_unexplained_tensors(hf_models: dict, tmp_path: Path) -> None:
    path = _copy(hf_models["llama"], tmp_path / "m", config={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"does not explain: model\.layers\.3\."):
        MegatronLMModule.from_hf(path)


def test_pickled_weights_are_refused(hf_models: dict, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((hf_models["llama"] / "config.json").read_text())
    torch.save(load_file(hf_models["llama"] / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*only safetensors"):
        MegatronLMModule.from_hf(tmp_path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, r"rope_type='yarn'"),
        ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 4096}}, r"llama3 RoPE .*4096"),
        ({"attention_bias": True}, r"attention_bias=True"),
        ({"hidden_act": "relu"}, r"hidden_act='relu'"),
    ],
)
def test_unsupported_config_features(change: dict, match: str, hf_models: dict) -> None:
    cfg = {**json.loads((hf_models["llama"] / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_seq_length_beyond_the_sliding_window(hf_models: dict) -> None:
    with pytest.raises(ValueError, match=r"seq_length=128 exceeds the model's sliding attention window \(64\)"):
        ModelConfig.from_hf(hf_models["mistral"], seq_length=128)


def test_export_outside_a_run_raises(hf_models: dict) -> None:
    module = MegatronLMModule.from_hf(hf_models["llama"], seq_length=SEQ)
    with pytest.raises(RuntimeError, match=r"while the Trainer runs"):
        module.export_hf_weights()
    with pytest.raises(RuntimeError, match=r"while the Trainer runs"):
        module.save_hf("unused")


# Gemma: tied embeddings (the value head replaces the tied LM head), (1 + w) norms before and after each sublayer,
# scaled embeddings; Gemma 2's final soft-cap is the LM head's, not the value head's.
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2"])
def test_value_module_from_hf_uses_the_pretrained_backbone(arch: str, hf_models: dict, hf_tokens: torch.Tensor) -> None:
    """The critic is the HF decoder plus a scalar head: values = head(final hidden states of transformers)."""
    from lightning_megatron import MegatronValueModule

    module = MegatronValueModule.from_hf(hf_models[arch], seq_length=SEQ)
    values = torch.cat(cpu_trainer().predict(module, DataLoader(hf_tokens, batch_size=4)))
    assert values.shape == hf_tokens.shape
    head = module.chunks[0].output_layer
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_models[arch], dtype=torch.float32,
                                                           attn_implementation="eager")  # fmt: skip
    with torch.no_grad():
        hidden = hf.model(input_ids=hf_tokens).last_hidden_state  # after the final norm
        want = (hidden @ head.weight.float().T + head.bias.float()).squeeze(-1)
    torch.testing.assert_close(values, want, rtol=1e-4, atol=1e-4)
