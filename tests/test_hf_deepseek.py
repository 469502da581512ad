"""Hugging Face DeepSeek-V3 in and out (tiny random ``DeepseekV3ForCausalLM`` written with ``save_pretrained``;
nothing is downloaded): Multi-Latent Attention with ``q_lora_rank``, YaRN with DeepSeek's mscale pair, a
dense first layer, shared experts and the sigmoid router with its correction bias, groups and scaling factor.

Against ``transformers`` in float32 with eager attention at one process: validation loss and logits; the export
loads in ``transformers`` with our logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, ModelConfig
from lightning_megatron.gpt.hf.mapping import family
from tests.hf_deepseek_models import VARIANTS, YARN, make_model
from tests.hf_moe_models import Export, cpu_trainer, hf_forward

SEQ = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_deepseek")
    return {name: make_model(root / name, **overrides) for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def one_process(models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = {}
    for name, path in models.items():
        module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = Export(tmp_path_factory.mktemp("saved") / name)
        loader = DataLoader(tokens, batch_size=4)
        logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
        val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
        results[name] = {"logits": logits, "val_loss": val_loss, "export": export, "module": module}
    return results


def test_config_from_hf_maps_mla_and_the_router(models: dict[str, Path]) -> None:
    config = ModelConfig.from_hf(models["q_lora_yarn"])
    assert type(family(config)).__name__ == "DeepseekV3"
    assert config.multi_latent_attention
    assert config.qk_layernorm
    mla = (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim)
    assert mla == (24, 32, 16, 8, 12)
    yarn = (config.rope_type, config.rotary_base, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim)
    assert yarn == ("yarn", 5000, 4.0, 0.8, 1.0)
    router = (config.moe_router_score_function, config.moe_router_enable_expert_bias, config.moe_router_num_groups)
    assert router == ("sigmoid", True, 4)
    assert (config.moe_router_group_topk, config.moe_router_topk_scaling_factor) == (2, 2.5)
    assert (config.moe_shared_expert_intermediate_size, config.moe_layer_freq) == (64, (0, 1, 1))
    plain = ModelConfig.from_hf(models["q_lora_rope"])
    assert (plain.q_lora_rank, plain.rope_type, plain.rotary_base) == (16, "rope", 2000)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}, "DeepseekV32ForCausalLM"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}}, "rope_type='linear'"),
        ({"rope_parameters": {**YARN, "mscale": None}}, "mscale=None and mscale_all_dim=1.0"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False and num_experts_per_tok=4"),
        ({"topk_group": 1}, "num_experts_per_tok=4 and topk_group=1"),
        ({"rope_interleave": False}, "rope_interleave=False"),
    ],
)
def test_unsupported_deepseek_settings_are_named(models: dict[str, Path], change: dict, match: str) -> None:
    config = json.loads((models["q_lora_yarn"] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**config, **change})


def test_mtp_layers_are_skipped_with_a_notice(models: dict[str, Path]) -> None:
    config = json.loads((models["q_lora_yarn"] / "config.json").read_text())
    with pytest.warns(UserWarning, match=r"skipping num_nextn_predict_layers=2 .* model.layers.3..4"):
        ModelConfig.from_hf({**config, "num_nextn_predict_layers": 2})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_process_matches_transformers(name: str, one_process: dict, models: dict, tokens: torch.Tensor) -> None:
    logits, loss, _ = hf_forward(models[name], tokens)
    got = one_process[name]
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_loads_in_transformers_with_our_logits(name: str, one_process: dict, tokens: torch.Tensor) -> None:
    export = one_process[name]["export"]
    logits, _, _ = hf_forward(export.path, tokens)
    torch.testing.assert_close(one_process[name]["logits"], logits, rtol=1e-4, atol=1e-4)
    assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in export.tensors)


def test_a_kimi_k2_style_directory_imports_without_remote_code(
    models: dict[str, Path], one_process: dict, tokens: torch.Tensor, tmp_path: Path
) -> None:
    """Kimi-K2's config.json names remote code (``model_type: "kimi_k2"``, an ``auto_map``) and the legacy
    ``rope_scaling`` form on the DeepSeek-V3 architecture: read with transformers' DeepseekV3Config (no remote code
    runs), it is the same model; the export keeps that config.json and copies the remote code files beside it."""
    import shutil

    source = models["q_lora_yarn"]
    kimi = tmp_path / "kimi"
    shutil.copytree(source, kimi)
    config = json.loads((kimi / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        model_type="kimi_k2",
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        rope_theta=rope.pop("rope_theta"),
        rope_scaling={**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"},
    )  # fmt: skip
    (kimi / "config.json").write_text(json.dumps(config))
    for module in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (kimi / module).write_text("raise RuntimeError('remote code must not run')\n")
    assert ModelConfig.from_hf(kimi) == ModelConfig.from_hf(source)
    module = MegatronLMModule.from_hf(kimi, seq_length=SEQ)
    export = Export(tmp_path / "out")
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, DataLoader(tokens, batch_size=4)))
    torch.testing.assert_close(logits, one_process["q_lora_yarn"]["logits"], rtol=1e-5, atol=1e-5)
    written = json.loads((export.path / "config.json").read_text())
    assert (written["model_type"], written["auto_map"]) == ("kimi_k2", config["auto_map"])
    assert (export.path / "configuration_deepseek.py").read_text() == (kimi / "configuration_deepseek.py").read_text()
    original, written_tensors = (load_file(path / "model.safetensors") for path in (source, export.path))
    assert written_tensors.keys() == original.keys()
    assert all(torch.equal(written_tensors[name], tensor) for name, tensor in original.items())
