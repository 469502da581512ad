"""Hugging Face GLM-4.5 in and out (tiny random ``Glm4MoeForCausalLM`` written with ``save_pretrained``; nothing is
downloaded): GQA attention with q/k/v biases, RoPE on part of each head (``partial_rotary_factor``), q/k norms or
none, a dense first layer, shared experts and the sigmoid router with its correction bias (with and without groups,
with and without a scaling factor), and a multi-token-prediction layer in the checkpoint that import skips.

Against ``transformers`` in float32 with eager attention at one process: validation loss and logits; the export
(from the HF source, and generated for a model built from a ``ModelConfig``) loads in ``transformers`` with our
logits; three training steps follow ``transformers`` + ``torch.optim.AdamW``.
"""

from __future__ import annotations

import itertools
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, ModelConfig, tiny_gpt
from lightning_megatron.gpt.hf.mapping import family
from lightning_megatron.gpt.hf.registry import family_of
from tests.hf_moe_models import Export, cpu_trainer, hf_forward, save_randomised, train_both

SEQ = 16
BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "attention_bias": True,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
}
VARIANTS: dict[str, dict[str, Any]] = {
    # Groups (top-4 of 8 experts in 2 of 4 groups), a scaling factor, q/k norms, half of each 16-dim head rotated;
    # the checkpoint also holds one MTP layer (model.layers.3.*), which import skips.
    "qk_norm": {
        "use_qk_norm": True,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
    },
    # GLM-4.5's shape: no groups, no q/k norms; 32-dim heads (head_dim != hidden / heads), a quarter rotated.
    "plain": {
        "use_qk_norm": False,
        "num_experts_per_tok": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
}
MTP = {"qk_norm": 1, "plain": 0}
"""Multi-token-prediction layers each variant's checkpoint holds past its decoder layers."""


def make_model(path: Path, mtp: int = 0, **overrides: Any) -> Path:
    config = transformers.Glm4MoeConfig(**{**BASE, **overrides})
    save_randomised(config, path, sigmoid_router=True)
    if mtp:  # some of an MTP layer's tensors (a decoder layer plus eh_proj, enorm, ...) past num_hidden_layers
        tensors, n = load_file(path / "model.safetensors"), config.num_hidden_layers
        for i in range(n, n + mtp):
            tensors[f"model.layers.{i}.eh_proj.weight"] = torch.randn(64, 128)
            tensors[f"model.layers.{i}.enorm.weight"] = torch.ones(64)
            tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(64, 64)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        config_json = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config_json, "num_nextn_predict_layers": mtp}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_glm")
    return {name: make_model(root / name, MTP[name], **overrides) for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def one_process(models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = {}
    for name, path in models.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = Export(tmp_path_factory.mktemp("saved") / name)
        loader = DataLoader(tokens, batch_size=4)
        logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
        val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
        mtp = [str(w.message) for w in caught if "multi-token-prediction" in str(w.message)]
        results[name] = {"logits": logits, "val_loss": val_loss, "export": export, "module": module, "mtp": mtp}
    return results


def test_config_from_hf_maps_attention_rope_and_the_router(models: dict[str, Path]) -> None:
    config = ModelConfig.from_hf(models["qk_norm"])
    assert type(family(config)).__name__ == "Glm4Moe"
    assert (config.add_qkv_bias, config.qk_layernorm, config.multi_latent_attention) == (True, True, False)
    rope = (config.rotary_percent, config.rotary_base)
    assert (config.num_query_groups, config.kv_channels, rope) == (2, 16, (0.5, 5000))
    router = (config.moe_router_score_function, config.moe_router_enable_expert_bias, config.moe_router_num_groups)
    assert router == ("sigmoid", True, 4)
    assert (config.moe_router_topk, config.moe_router_group_topk, config.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (64, False)
    assert (config.moe_layer_freq, config.moe_ffn_hidden_size, config.moe_aux_loss_coeff) == ((0, 1, 1), 32, 0.0)
    plain = ModelConfig.from_hf(models["plain"])
    assert (plain.qk_layernorm, plain.kv_channels, plain.rotary_percent, plain.moe_router_topk) == (False, 32, 0.25, 2)
    assert (plain.moe_router_num_groups, plain.moe_router_topk_scaling_factor) == (None, None)
    no_bias = json.loads((models["plain"] / "config.json").read_text())
    assert not ModelConfig.from_hf({**no_bias, "attention_bias": False}).add_qkv_bias


def test_each_config_has_at_most_one_family() -> None:
    """GLM-4.5 holds exactly the non-MLA MoE models with an ungated shared expert and the biased sigmoid router;
    family_of asserts that no two families claim a model."""
    moe = {"num_moe_experts": 4, "ffn_hidden_size": 32, "moe_ffn_hidden_size": 32, "moe_router_topk": 2}
    sigmoid = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    found = set()
    for bias, norm, shared, gate, router in itertools.product([False, True], repeat=5):
        fields = {**moe, "add_qkv_bias": bias, "qk_layernorm": norm, **(sigmoid if router else {})}
        if shared:
            fields.update(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=gate)
        elif gate:
            continue
        adapter = family_of(tiny_gpt(**fields))
        name = None if adapter is None else type(adapter).__name__
        assert (name == "Glm4Moe") == (shared and not gate and router), fields
        found.add(name)
    assert {"Glm4Moe", "Qwen3MoE", "Qwen2MoE", "Mixtral", None} == found


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"norm_topk_prob": False}, "Glm4MoeForCausalLM with norm_topk_prob=False and num_experts_per_tok=4"),
        ({"topk_group": 1}, "Glm4MoeForCausalLM with num_experts_per_tok=4 and topk_group=1"),
        ({"n_shared_experts": 0}, "Glm4MoeForCausalLM with n_shared_experts=0"),
        ({"first_k_dense_replace": 3}, "Glm4MoeForCausalLM with first_k_dense_replace=3"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn'"),
        ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ],
)
def test_unsupported_glm_settings_are_named(models: dict[str, Path], change: dict, match: str) -> None:
    config = json.loads((models["qk_norm"] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**config, **change})


def test_partial_rope_stays_refused_elsewhere(models: dict[str, Path]) -> None:
    """Only GLM's attention honours partial_rotary_factor: on export, rotary_percent needs its family."""
    from lightning_megatron.gpt.hf.config import check_exportable

    with pytest.raises(ValueError, match=r"rotary_percent=0.5: no HF counterpart"):
        check_exportable(tiny_gpt(rotary_percent=0.5))
    glm = ModelConfig.from_hf(models["plain"])
    assert type(check_exportable(glm)).__name__ == "Glm4Moe"


def test_mtp_layers_are_skipped_with_one_warning(one_process: dict, models: dict[str, Path], tmp_path: Path) -> None:
    """The checkpoint's MTP layer is skipped, with one warning naming it; a layer past those config.json names is
    still refused (the config is another model's)."""
    assert one_process["plain"]["mtp"] == []
    (warning,) = one_process["qk_norm"]["mtp"]
    assert "Glm4MoeForCausalLM: skipping num_nextn_predict_layers=1" in warning
    assert "model.layers.3..3" in warning
    assert any(n.startswith("model.layers.3.") for n in load_file(models["qk_norm"] / "model.safetensors"))
    written = json.loads((one_process["qk_norm"]["export"].path / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 0  # the export holds no MTP layer
    copy = shutil.copytree(models["qk_norm"], tmp_path / "no_mtp")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"tensors this config.json does not explain: model.layers.3.eh_proj"):
        MegatronLMModule.from_hf(copy, seq_length=SEQ)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_process_matches_transformers(name: str, one_process: dict, models: dict, tokens: torch.Tensor) -> None:
    logits, loss, _ = hf_forward(models[name], tokens)
    got = one_process[name]
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)


LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0, **LLAMA3}],
    ids=["linear", "llama3"],
)
def test_scaled_partial_rope_matches_transformers(rope: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """The shared RoPE scalings on the rotated part of each head: transformers scales the frequencies of those dims,
    as Megatron's RotaryEmbedding does with rotary_percent."""
    rope = {**rope, "rope_theta": 5000.0, "partial_rotary_factor": 0.5}
    path = make_model(tmp_path / "model", **{**VARIANTS["qk_norm"], "rope_parameters": rope})
    module = MegatronLMModule.from_hf(path, seq_length=SEQ)
    assert module.config.rotary_percent == 0.5
    logits = torch.cat(cpu_trainer().predict(module, DataLoader(tokens, batch_size=4)))
    torch.testing.assert_close(logits, hf_forward(path, tokens)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_loads_in_transformers_with_our_logits(name: str, one_process: dict, tokens: torch.Tensor) -> None:
    export = one_process[name]["export"]
    logits, _, _ = hf_forward(export.path, tokens)
    torch.testing.assert_close(one_process[name]["logits"], logits, rtol=1e-4, atol=1e-4)
    biases = [n for n in export.tensors if n.endswith("mlp.gate.e_score_correction_bias")]
    assert biases == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]  # the MoE layers
    assert not any(n.startswith("model.layers.3.") for n in export.tensors)  # no MTP layer to export


def test_a_model_not_from_hf_is_written_as_glm(models: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """A GLM-shaped ModelConfig model (random weights) gets a generated config.json, partial RoPE and router
    included, that transformers loads with our logits."""
    export = Export(tmp_path / "out")
    module = MegatronLMModule(ModelConfig.from_hf(models["qk_norm"], seq_length=SEQ))
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, DataLoader(tokens, batch_size=4)))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert (written["n_group"], written["topk_group"], written["first_k_dense_replace"]) == (4, 2, 1)
    assert (written["use_qk_norm"], written["attention_bias"], written["num_nextn_predict_layers"]) == (True, True, 0)
    torch.testing.assert_close(hf_forward(tmp_path / "out", tokens)[0], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_training_follows_transformers_and_adamw(name: str, models: dict) -> None:
    """Three steps of full fine-tuning step for step. transformers never moves the correction bias; Megatron moves
    it after every step unless moe_router_bias_update_rate=0, which keeps it as loaded.

    Adam's eps is 1e-6: a gradient element that sums to ~1e-9 (float32 cancellation noise, which differs between two
    correct implementations) would otherwise get an update of anywhere up to lr from Adam's first step."""
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.0}
    want, got, model, module = train_both(models[name], settings, {"moe_router_bias_update_rate": 0.0})
    assert len(set(want)) == 3
    assert got == pytest.approx(want, rel=1e-4)
    bias = module.chunks[0].decoder.layers[1].mlp.router.expert_bias
    assert torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias)  # as loaded, on both sides


def test_a_bf16_export_keeps_the_correction_bias_in_float32(models: dict[str, Path], tokens: torch.Tensor,
                                                             tmp_path: Path) -> None:  # fmt: skip
    """As the HF checkpoints and transformers keep it: it only ranks experts, by differences bf16 would round."""
    import lightning as L

    class Save(L.Callback):
        def on_predict_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
            module.save_hf(tmp_path / "bf16", dtype=torch.bfloat16)

    module = MegatronLMModule.from_hf(models["plain"], seq_length=SEQ)
    cpu_trainer(callbacks=[Save()]).predict(module, DataLoader(tokens, batch_size=4))
    written = load_file(tmp_path / "bf16" / "model.safetensors")
    bias = {name: t.dtype for name, t in written.items() if name.endswith("e_score_correction_bias")}
    assert bias
    assert set(bias.values()) == {torch.float32}
    assert {t.dtype for name, t in written.items() if name not in bias} == {torch.bfloat16}
