"""Hugging Face Gemma 3 (text) in and out (a tiny random ``Gemma3ForCausalLM`` written with ``save_pretrained``;
nothing is downloaded): sliding-window (window 4, shorter than the 16-token rows) and full layers with their own RoPE
bases, q/k norms, the four norms of each layer with Gemma's ``1 + w`` gain, embeddings scaled by sqrt(hidden),
tanh-GELU GeGLU, tied embeddings and ``query_pre_attn_scalar``.

Against ``transformers`` in float32 with eager attention at one process: validation loss and logits; the export
(from the HF source, and generated for a model built from a ``ModelConfig``) loads in ``transformers`` with our
logits; what the model cannot express is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, ModelConfig, tiny_gpt
from lightning_megatron.gpt.hf.config import check_exportable
from lightning_megatron.gpt.hf.mapping import family
from lightning_megatron.gpt.hf.registry import family_of
from tests.hf_moe_models import Export, cpu_trainer, hf_forward, train_both

SEQ = 16
BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 24,
    "sliding_window": 4,
    # Sliding, full, sliding, full: both kinds, each with its RoPE base.
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    },
}


def make_model(path: Path, **overrides: Any) -> Path:
    config = transformers.Gemma3TextConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # Gemma's norm gains start at 0 (1 + w = 1): randomise them so a wrong mapping shows
        for name, tensor in model.named_parameters():
            if tensor.ndim == 1:
                tensor.copy_(torch.randn_like(tensor) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("hf_gemma") / "gemma3")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def one_process(model_path: Path, tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    module = MegatronLMModule.from_hf(model_path, seq_length=SEQ)
    export = Export(tmp_path_factory.mktemp("saved") / "gemma3")
    loader = DataLoader(tokens, batch_size=4)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
    val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
    return {"logits": logits, "val_loss": val_loss, "export": export, "module": module}


def test_config_from_hf_maps_gemma3(model_path: Path) -> None:
    config = ModelConfig.from_hf(model_path, seq_length=SEQ)
    assert type(family(config)).__name__ == "Gemma3"
    assert (config.window_size, config.window_attn_skip_freq) == ((3, 0), (1, 0, 1, 0))
    assert (config.rotary_base, config.local_rotary_base, config.seq_len_interpolation_factor) == (500, 10000, 2.0)
    assert config.softmax_scale == pytest.approx(24**-0.5)
    assert (config.activation, config.qk_layernorm, config.share_embeddings_and_output_weights) == (
        "gelu_tanh",
        True,
        True,
    )
    gemma = (config.layernorm_zero_centered_gamma, config.post_sublayer_norms, config.scale_embeddings)
    assert gemma == (True, True, True)
    assert config.kv_channels == 16


def test_one_process_matches_transformers(one_process: dict, model_path: Path, tokens: torch.Tensor) -> None:
    logits, loss, _ = hf_forward(model_path, tokens)
    torch.testing.assert_close(one_process["logits"], logits, rtol=1e-4, atol=1e-4)
    assert one_process["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_export_loads_in_transformers_with_our_logits(one_process: dict, tokens: torch.Tensor) -> None:
    export = one_process["export"]
    assert "model.layers.0.post_feedforward_layernorm.weight" in export.tensors
    logits, _, _ = hf_forward(export.path, tokens)
    torch.testing.assert_close(one_process["logits"], logits, rtol=1e-4, atol=1e-4)


def test_a_model_not_from_hf_is_written_as_gemma3(model_path: Path, tokens: torch.Tensor, tmp_path: Path) -> None:
    """A Gemma-shaped ModelConfig model (random weights) gets a generated config.json that transformers loads with
    our logits; with attention soft-capping, which transformers' Gemma 3 does not apply, it has no architecture."""
    with pytest.raises(ValueError, match="no HF architecture holds"):
        check_exportable(ModelConfig.from_hf(model_path, seq_length=SEQ, attn_logit_softcapping=5.0))
    config = ModelConfig.from_hf(model_path, seq_length=SEQ)
    export = Export(tmp_path / "out")
    module = MegatronLMModule(config)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, DataLoader(tokens, batch_size=4)))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Gemma3ForCausalLM"]
    assert (written["sliding_window"], written["query_pre_attn_scalar"]) == (4, 24)
    assert written["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    torch.testing.assert_close(hf_forward(tmp_path / "out", tokens)[0], logits, rtol=1e-4, atol=1e-4)


def test_gemma_configs_have_exactly_one_family(model_path: Path) -> None:
    gemma = ModelConfig.from_hf(model_path, seq_length=SEQ)
    assert type(family_of(gemma)).__name__ == "Gemma3"
    assert family_of(tiny_gpt(qk_layernorm=True, scale_embeddings=True)) is None  # partly Gemma: no architecture
    assert type(family_of(tiny_gpt(qk_layernorm=True))).__name__ == "Qwen3"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "text model alone is not implemented"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types="),
    ],
)
def test_unsupported_gemma_settings_are_named(model_path: Path, change: dict, match: str) -> None:
    config = json.loads((model_path / "config.json").read_text())
    assert ModelConfig.from_hf({**config, "final_logit_softcapping": 30.0}).final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**config, **change})


def test_gemma_fields_refused_where_not_built() -> None:
    with pytest.raises(ValueError, match="local_rotary_base=500 with kernels='local'"):
        tiny_gpt(window_size=(3, 0), local_rotary_base=500, kernels="local")
    with pytest.raises(ValueError, match="post_sublayer_norms=True with kernels='te'"):
        tiny_gpt(post_sublayer_norms=True, kernels="te")
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma=True with normalization='LayerNorm'"):
        tiny_gpt(layernorm_zero_centered_gamma=True, normalization="LayerNorm")


def test_training_follows_transformers_and_adamw(model_path: Path) -> None:
    """Three steps of full fine-tuning step for step with transformers + torch.optim.AdamW (the post norms, the
    (1 + w) gains, the scaled embeddings and both RoPE bases all get gradients)."""
    want, got, _, _ = train_both(model_path, {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})
    assert len(set(want)) == 3
    assert got == pytest.approx(want, rel=1e-4)


# Gemma 2: no q/k norms, one RoPE, soft-capped attention scores and output logits (caps small enough to bite).
GEMMA2 = {
    **{k: v for k, v in BASE.items() if k != "rope_parameters"},
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
}


def test_gemma2_matches_transformers_with_both_softcaps(tokens: torch.Tensor, tmp_path: Path) -> None:
    """Logits, loss and log-probs (all after the final logit soft-capping) equal transformers'; the export loads in
    transformers with our logits; without the caps the logits would differ (the caps bite)."""
    config = transformers.Gemma2Config(**GEMMA2)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        for tensor in (t for t in model.parameters() if t.ndim == 1):
            tensor.copy_(torch.randn_like(tensor) * 0.3)
    model.save_pretrained(tmp_path / "gemma2")
    ours = ModelConfig.from_hf(tmp_path / "gemma2", seq_length=SEQ)
    assert type(family(ours)).__name__ == "Gemma2"
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping, ours.qk_layernorm) == (2.0, 3.0, False)
    assert ours.local_rotary_base is None
    module = MegatronLMModule.from_hf(tmp_path / "gemma2", seq_length=SEQ)
    export = Export(tmp_path / "saved")
    loader = DataLoader(tokens, batch_size=4)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
    val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
    module.prediction = "logprobs"
    logprobs = torch.cat([p["logprobs"] for p in cpu_trainer().predict(module, loader)])
    want_logits, want_loss, want_logprobs = hf_forward(tmp_path / "gemma2", tokens)
    assert want_logits.abs().max() <= 3.0  # capped
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert val_loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(logprobs[:, : SEQ - 1], want_logprobs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hf_forward(export.path, tokens)[0], logits, rtol=1e-4, atol=1e-4)
    assert json.loads((export.path / "config.json").read_text())["final_logit_softcapping"] == 3.0
