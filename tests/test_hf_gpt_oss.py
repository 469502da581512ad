"""Hugging Face GPT-OSS in and out (a tiny random ``GptOssForCausalLM`` written with ``save_pretrained``; nothing
is downloaded): attention with q/k/v/o biases and learnable sinks, sliding-window (window 4, shorter than the
16-token rows) and full layers, YaRN RoPE (without truncation, as GPT-OSS ships it), and every layer an MoE of 4
experts, top-2: a router with a bias, a softmax over the top-k, experts with biases and the clamped GLU.

Against ``transformers`` in float32 with eager attention at one process: validation loss and logits; the export
loads in ``transformers`` with our logits (and in MXFP4, as the releases store it); three training steps follow
``transformers`` + ``torch.optim.AdamW``; what the model cannot express is refused by name. Every 1-d parameter
(sinks, biases, norms) is randomised and the clamp limit is small, so that a wrong mapping moves the loss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, ModelConfig
from lightning_megatron.gpt.hf.mapping import family
from lightning_megatron.gpt.hf.registry import family_of
from tests.hf_gpt_oss_models import GPT_OSS, NOT_CONVERTED, PACKED, make_gpt_oss, quantize_mxfp4
from tests.hf_moe_models import Export, cpu_trainer, hf_forward, hf_model, train_both

SEQ = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("hf_gpt_oss") / "gpt_oss")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


class ExportBoth(Export):
    """The float export, and the MXFP4 one beside it."""

    def on_predict_end(self, trainer: Any, module: MegatronLMModule) -> None:  # type: ignore[override]
        super().on_predict_end(trainer, module)
        module.save_hf(self.path.with_name(self.path.name + "_mxfp4"), weight_format="mxfp4")


@pytest.fixture(scope="module")
def one_process(model_path: Path, tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    module = MegatronLMModule.from_hf(model_path, seq_length=SEQ)
    export = ExportBoth(tmp_path_factory.mktemp("saved") / "gpt_oss")
    loader = DataLoader(tokens, batch_size=4)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
    val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
    return {"logits": logits, "val_loss": val_loss, "export": export, "module": module}


def test_config_from_hf_maps_gpt_oss(model_path: Path) -> None:
    config = ModelConfig.from_hf(model_path, seq_length=SEQ)
    assert type(family(config)).__name__ == "GptOss"
    assert type(family_of(config)).__name__ == "GptOss"
    assert (config.window_size, config.window_attn_skip_freq) == ((3, 0), (1, 0))
    assert (config.add_bias_linear, config.add_qkv_bias, config.softmax_type) == (True, False, "learnable")
    assert (config.activation, config.glu_linear_offset, config.activation_func_clamp_value) == ("quick_gelu", 1.0, 0.5)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    assert config.moe_router_pre_softmax is False
    yarn = (config.position_embedding_type, config.rotary_base, config.rotary_scaling_factor)
    assert yarn == ("yarn", 150000, 8.0)
    assert (config.original_max_position_embeddings, config.yarn_correction_range_round_to_int) == (8, False)


def test_one_process_matches_transformers(one_process: dict, model_path: Path, tokens: torch.Tensor) -> None:
    logits, loss, _ = hf_forward(model_path, tokens)
    torch.testing.assert_close(one_process["logits"], logits, rtol=1e-4, atol=1e-4)
    assert one_process["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_export_loads_in_transformers_with_our_logits(one_process: dict, tokens: torch.Tensor) -> None:
    export = one_process["export"]
    assert export.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert "model.layers.1.self_attn.sinks" in export.tensors
    logits, _, _ = hf_forward(export.path, tokens)
    torch.testing.assert_close(one_process["logits"], logits, rtol=1e-4, atol=1e-4)


def test_a_float_gpt_oss_is_written_in_mxfp4_as_released(one_process: dict, model_path: Path) -> None:
    """``weight_format="mxfp4"``: every expert projection in MXFP4, the same bytes as tests/hf_gpt_oss_models.py's
    quantizer gives, the rest as stored, with the releases' modules_to_not_convert."""
    from safetensors.torch import load_file

    saved = one_process["export"].path.with_name("gpt_oss_mxfp4")
    config = json.loads((saved / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    written, floats = load_file(saved / "model.safetensors"), load_file(model_path / "model.safetensors")
    assert len(written) == len(floats) + 4  # each layer's two projections as blocks and scales
    for name, tensor in floats.items():
        if name.endswith(PACKED):
            blocks, scales = quantize_mxfp4(tensor)
            assert torch.equal(written[name + "_blocks"], blocks), name
            assert torch.equal(written[name + "_scales"], scales), name
        else:
            assert torch.equal(written[name], tensor), name


def test_export_of_a_generated_config(model_path: Path, tmp_path: Path) -> None:
    from lightning_megatron.gpt.hf.config import hf_config_dict

    written = hf_config_dict(ModelConfig.from_hf(model_path, seq_length=SEQ))
    assert written["architectures"] == ["GptOssForCausalLM"]
    assert (written["sliding_window"], written["layer_types"]) == (4, GPT_OSS["layer_types"])
    assert written["rope_parameters"] == {**GPT_OSS["rope_parameters"], "rope_type": "yarn"}
    assert (written["swiglu_limit"], written["num_local_experts"], written["intermediate_size"]) == (0.5, 4, 32)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quant_method='fp8'"),
        ({"quantization_config": {"quant_method": "mxfp4", "group_size": 64}}, r"quantization_config\.group_size=64"),
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        ({"attention_bias": False}, "attention_bias=False"),
        ({"layer_types": ["chunked_attention"] * 2}, "layer_types="),
        ({"rope_parameters": {**GPT_OSS["rope_parameters"], "attention_factor": 2.0}}, "attention_factor"),
    ],
)
def test_unsupported_gpt_oss_settings_are_named(model_path: Path, change: dict, match: str) -> None:
    config = json.loads((model_path / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**config, **change})


def test_yarn_fields_refused_where_not_built() -> None:
    from lightning_megatron import tiny_gpt

    with pytest.raises(ValueError, match="rope_scaling=True with position_embedding_type='yarn'"):
        tiny_gpt(position_embedding_type="yarn", rope_scaling=True)


def test_training_follows_transformers_and_adamw(model_path: Path) -> None:
    """Three steps of full fine-tuning step for step with transformers + torch.optim.AdamW (the sinks, the router's
    and the experts' biases get gradients)."""
    want, got, _, _ = train_both(model_path, {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})
    assert len(set(want)) == 3
    assert got == pytest.approx(want, rel=1e-4)


def test_lora_on_the_experts_exports_merged_and_as_peft(one_process: dict, model_path: Path, tokens: torch.Tensor,
                                                        tmp_path: Path) -> None:  # fmt: skip
    """LoRA on GPT-OSS's experts (one adapter per expert on gate_up_proj and on down_proj; the biases frozen and still
    added): the base model's logits at init; after two steps, the merged export (gate_up_proj re-interleaved) and the
    PEFT adapter (target_parameters on the fused experts; B's rows on gate_up_proj interleaved like its columns)
    give our logits in transformers and PEFT, and the adapter loads back here."""
    import lightning as L
    import peft
    from safetensors.torch import load_file

    module = MegatronLMModule.from_hf(model_path, seq_length=SEQ, lr=5e-2, lora={"rank": 4, "alpha": 8.0, "seed": 1})
    loader = DataLoader(tokens, batch_size=4)
    at_init = torch.cat(cpu_trainer().predict(module, loader))
    torch.testing.assert_close(at_init, one_process["logits"], rtol=0, atol=1e-5)

    class Save(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            self.trainable = sorted({n.rsplit(".", 2)[-2] for n, p in pl_module.named_parameters() if p.requires_grad})
            self.experts = [n for n, _ in pl_module.named_parameters() if "experts.linear_fc" in n and "lora_" in n]
            pl_module.save_hf(tmp_path / "merged")
            pl_module.save_hf(tmp_path / "adapter", adapter=True)

    samples = torch.randint(0, 128, (8, SEQ), generator=torch.Generator().manual_seed(8))
    cpu_trainer(max_steps=2, callbacks=[save := Save()]).fit(module, DataLoader(samples, batch_size=4))
    assert save.trainable == ["lora_A", "lora_B"]
    assert len(save.experts) == 8  # 2 layers x fc1/fc2 x A/B
    ours = torch.cat(cpu_trainer().predict(module, loader))
    assert not torch.allclose(ours, one_process["logits"], atol=1e-3)  # the adapters moved the logits
    torch.testing.assert_close(hf_forward(tmp_path / "merged", tokens)[0], ours, rtol=1e-4, atol=1e-4)
    merged, base = load_file(tmp_path / "merged" / "model.safetensors"), load_file(model_path / "model.safetensors")
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    assert torch.equal(merged[bias], base[bias])  # frozen
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(model_path), tmp_path / "adapter")(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    back = MegatronLMModule.from_hf(model_path, seq_length=SEQ, adapter=tmp_path / "adapter")
    torch.testing.assert_close(torch.cat(cpu_trainer().predict(back, loader)), ours, rtol=1e-5, atol=1e-5)
