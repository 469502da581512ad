"""Every ModelConfig knob a GPT user sets builds and trains (one process, in the test process)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens

VARIANTS = {
    "llama_default": {},
    "gqa_qk_norm": {"num_query_groups": 2, "qk_layernorm": True, "kv_channels": 32},
    "gpt2_style": {
        "normalization": "LayerNorm", "activation": "gelu", "gated_linear_unit": False,
        "position_embedding_type": "learned_absolute", "add_bias_linear": True,
        "share_embeddings_and_output_weights": True,
    },
    "post_norm_partial_rope": {"apply_residual_connection_post_layernorm": True, "rotary_percent": 0.5},
    "dropout": {"hidden_dropout": 0.1, "attention_dropout": 0.1},
    "recompute_full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "recompute_selective": {"recompute_granularity": "selective"},
}  # fmt: skip


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.values.append(float(outputs["loss"]))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains(name: str) -> None:
    model = MegatronLMModule(tiny_gpt(**VARIANTS[name]), lr=3e-3, decay_steps=8)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=4), max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )  # fmt: skip
    batch = synthetic_tokens(8, 32, 256, seed=5)
    trainer.fit(model, DataLoader(batch.repeat(8, 1), batch_size=8))  # the same batch every step
    assert all(torch.isfinite(torch.tensor(losses.values))), losses.values
    assert losses.values[-1] < losses.values[0] - 0.2, losses.values


def test_variant_options_reach_megatron() -> None:
    config = tiny_gpt(**VARIANTS["gpt2_style"]).to_transformer_config(tensor_model_parallel_size=1)
    assert config.normalization == "LayerNorm"
    assert config.gated_linear_unit is False
    assert config.add_bias_linear is True
    assert config.activation_func is torch.nn.functional.gelu
