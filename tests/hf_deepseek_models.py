"""The tiny random Hugging Face DeepSeek-V3 models of the DeepSeek tests (``DeepseekV3ForCausalLM`` written with
``save_pretrained``; nothing is downloaded): Multi-Latent Attention with and without a query latent, YaRN with
DeepSeek's mscale pair or plain RoPE, a dense first layer, shared experts and the sigmoid router with its correction
bias, groups and scaling factor (``VARIANTS``), for ``tests/test_hf_deepseek.py`` and ``tests/test_hf_fp8_blocks.py``.

A helper module, not a test module: test modules import its names; it imports no test module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from tests.hf_moe_models import save_randomised

YARN = {
    "rope_type": "yarn",
    "rope_theta": 5000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "q_lora_yarn": {"q_lora_rank": 24, "rope_parameters": YARN},
    # Plain RoPE of another base (rotary_base must reach MLA's own rotary embedding).
    "q_lora_rope": {"q_lora_rank": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 2000.0}},
    # A direct query projection (DeepSeek-V2-Lite / Moonlight style): q_proj, no query latent or its norm.
    "direct_q": {"q_lora_rank": None, "rope_parameters": YARN},
}


def make_model(path: Path, **overrides: Any) -> Path:
    """A random DeepSeek-V3 of ``BASE`` with ``overrides`` (config fields) written to ``path``."""
    config = transformers.DeepseekV3Config(**{**BASE, **overrides})
    return save_randomised(config, path, sigmoid_router=True)
