"""Test checkpoints of GPT-OSS (nothing is downloaded): the tiny random float ``GptOssForCausalLM`` of
``tests/test_hf_gpt_oss.py``, and MXFP4 checkpoints made from a float one with plain torch as GPT-OSS ships them
(``*_blocks`` uint8 ``[E, out, in / 32, 16]``, ``*_scales`` e8m0 ``[E, out, in / 32]``, in a second file named by an
index; layer 1's experts left in float32 and listed in ``modules_to_not_convert``), with the dequantized reference.

A helper module, not a test module: ``tests/test_hf_gpt_oss.py``, ``tests/test_hf_gpt_oss_mxfp4.py`` and the shared
MoE launch (``tests/hf_moe_models.py``) import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file

from tests.quantized_files import write_quantized

GPT_OSS: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "swiglu_limit": 0.5,  # small, so that the clamps bite
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 8,
    },  # fmt: skip
}
UNCONVERTED = "model.layers.1.mlp.experts"  # listed in modules_to_not_convert: its experts stay float32
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def make_gpt_oss(path: Path, **overrides: Any) -> Path:
    """A random float GPT-OSS of ``GPT_OSS`` (``overrides``: config fields; seed 0) written to ``path``."""
    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # biases, sinks and norms start at 0 / 1: randomise them so that a wrong mapping shows
        for name, tensor in model.named_parameters():
            if tensor.ndim == 1 or name.endswith("_bias"):
                tensor.copy_(torch.randn_like(tensor) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[E, in, out]`` expert weight -> (blocks, scales) as GPT-OSS stores it: per 32 values along ``in``
    one power-of-two scale ``2 ** (floor(log2 amax) - 2)`` (the OCP MX rule; 127-biased in a byte) and the nearest
    e2m1 value of each (saturating at 6), packed two to a byte, the first in the low nibble."""
    groups = w.transpose(1, 2).reshape(w.shape[0], w.shape[2], -1, 32).double()  # [E, out, in / 32, 32]
    exponent = torch.floor(torch.log2(groups.abs().amax(-1))) - 2
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs().clamp(max=6.0)[..., None] - FP4.double()).abs().argmin(-1)
    codes = magnitude + 8 * torch.signbit(scaled)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.to(torch.uint8), (exponent + 127).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks, scales) -> the float32 ``[E, in, out]`` weight they store."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [E, out, in / 32, 32]
    values = torch.where(codes >= 8, -1.0, 1.0) * FP4[codes % 8] * torch.exp2(scales.double() - 127)[..., None]
    return values.flatten(-2).transpose(1, 2).float().contiguous()


def make_mxfp4(source: Path, path: Path) -> tuple[Path, Path]:
    """``source`` (a float GPT-OSS whose expert inputs are multiples of 32) with its experts' projections in MXFP4
    (blocks and scales in a second file, named by an index; layer 1's left float), and the reference: ``source`` with
    those weights replaced by their dequantized values, beside ``path`` (``<name>_dequantized``)."""
    tensors = load_file(source / "model.safetensors")
    weights, packed, reference = {}, {}, dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(PACKED) and not name.startswith(UNCONVERTED):
            packed[name + "_blocks"], packed[name + "_scales"] = quantize_mxfp4(tensor)
            reference[name] = dequantize_mxfp4(packed[name + "_blocks"], packed[name + "_scales"])
        else:
            weights[name] = tensor
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": [*NOT_CONVERTED, UNCONVERTED]}
    return write_quantized(source, path, (weights, packed), quantization, reference)
