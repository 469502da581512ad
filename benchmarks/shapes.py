"""The model shapes of benchmarks/throughput.py, its sliding-window options, and the attention FLOPs that windowed
layers need (benchmarks/attention.py counts its windows the same way).

Windows are given as models state them, ``sliding_window`` N: a query attends itself and the N - 1 tokens before it
(Gemma 3: 1024, GPT-OSS: 128), which is ``ModelConfig.window_size = (N - 1, 0)``, as the Hugging Face import maps
``sliding_window`` (lightning_megatron/gpt/hf/families/gpt_oss.py). The standard MFU count charges every layer the
causal attention of the whole sequence (6 x hidden x seq per token); :func:`needed_attention_flops` charges a windowed
layer only the (query, key) pairs inside its window.
"""

from __future__ import annotations

import argparse
from typing import Any

SHAPES = {
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=2048),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632),
    "3b": dict(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192),
    "moe1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                  num_moe_experts=32, moe_router_topk=8, moe_ffn_hidden_size=768),
    # moe1b's attention alone with DeepSeek-V3's (Multi-Latent Attention: q latent 768, kv latent 512, heads of
    # 128 + 64 query/key and 128 value dims, latent norms), the MoE the same: MLA's cost against GQA's.
    "mla_moe1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                      num_moe_experts=32, moe_router_topk=8, moe_ffn_hidden_size=768, multi_latent_attention=True,
                      q_lora_rank=768, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                      qk_layernorm=True),
    # A DeepSeek-V3-like stack cut to one GPU: MLA (q latent 1536, kv latent 512, 128 + 64 / 128), the first layer
    # dense, then 64 routed experts of ffn 1408, top-6, the sigmoid router with its bias, two shared experts.
    "dsv3_1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                    num_moe_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408, multi_latent_attention=True,
                    q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                    qk_layernorm=True, moe_layer_freq=(0,) + (1,) * 15, moe_shared_expert_intermediate_size=2816,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    # A GPT-OSS-like stack cut to one GPU, moe1b's sizes otherwise (16 heads of 128, no grouped keys/values, RoPE):
    # the fields the GPT-OSS import sets -- sliding window 128 on alternate layers (the first windowed), learnable
    # sinks, a bias on every linear (q/k/v, o, the router, each expert's fc1 and fc2), the clamped GLU
    # (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), the softmax over the top-k logits -- and 32 experts, top-4.
    "gptoss1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                     num_moe_experts=32, moe_router_topk=4, moe_ffn_hidden_size=768, window_size=(127, 0),
                     window_attn_skip_freq=2, softmax_type="learnable", add_bias_linear=True,
                     activation="quick_gelu", glu_linear_offset=1.0, activation_func_clamp_value=7.0),
    "qwen3moe": dict(num_layers=8, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                     qk_layernorm=True, ffn_hidden_size=6144, num_moe_experts=128, moe_router_topk=8,
                     moe_ffn_hidden_size=768, vocab_size=151936),
}  # fmt: skip
VOCAB = 32000


def add_window_arguments(p: argparse.ArgumentParser) -> None:
    """``--window N`` and ``--window-every K``: sliding windows on the shape's layers (variants a and b)."""
    p.add_argument(
        "--window", type=int, default=None, metavar="N",
        help="sliding-window attention of N tokens (the query and the N - 1 before it: HF's sliding_window, "
        "ModelConfig.window_size=(N - 1, 0)) on the layers --window-every picks; replaces the shape's own window",
    )  # fmt: skip
    p.add_argument(
        "--window-every", type=int, default=None, metavar="K",
        help="with --window: every K-th layer full attention, the others windowed (ModelConfig.window_attn_skip_freq"
        "=K; Gemma 3's 5:1 is 6); without it every layer is windowed",
    )  # fmt: skip


def window_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--window`` / ``--window-every``, or None."""
    if args.window is None:
        return "--window-every needs --window N" if args.window_every is not None else None
    if args.window < 1:
        return f"--window {args.window}: a window of N >= 1 tokens (the query itself and the N - 1 before it)"
    if args.window_every is not None and args.window_every < 2:
        return f"--window-every {args.window_every}: K >= 2 (every K-th layer full; leave it out: all windowed)"
    return None


def window_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields of ``--window`` / ``--window-every`` (none without ``--window``)."""
    if args.window is None:
        return {}
    return {"window_size": (args.window - 1, 0), "window_attn_skip_freq": args.window_every}


def attended_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs of causal attention over ``seq`` tokens, each query seeing itself and at most ``window``
    keys before it (Megatron's ``window_size[0]``; None: all before it)."""
    if window is None or window >= seq - 1:
        return seq * (seq + 1) // 2
    return (window + 1) * (window + 2) // 2 + (seq - 1 - window) * (window + 1)


def needed_attention_flops(windowed: tuple[bool, ...], hidden: int, seq: int, window: int | None) -> int:
    """Attention FLOPs per token of training with the windows: the standard term (6 x hidden x seq) for each full
    layer, scaled for each windowed layer by the share of the causal (query, key) pairs its window keeps."""
    full = 6 * hidden * seq
    share = attended_pairs(seq, window) / attended_pairs(seq, None)
    return round(sum(full * share if is_windowed else full for is_windowed in windowed))


def attention_row(fields: dict[str, Any], windowed: tuple[bool, ...], seq: int, flops_per_token: int) -> dict[str, Any]:
    """A throughput row's attention variants (``fields``: the ModelConfig fields of the run; ``windowed``: each
    layer's window, ``attention_variants.window_layers``) and, with windows, the FLOPs per token they need. The row's
    ``mfu`` keeps the standard count, ``flops_per_token``: every layer's attention causal over the whole sequence."""
    row: dict[str, Any] = {
        "window_size": fields.get("window_size"), "window_attn_skip_freq": fields.get("window_attn_skip_freq"),
        "softmax_type": fields.get("softmax_type", "vanilla"), "flops_per_token": flops_per_token,
    }  # fmt: skip
    if fields.get("window_size") is None:
        return row
    layers, hidden = fields["num_layers"], fields["hidden_size"]
    needed = needed_attention_flops(windowed, hidden, seq, fields["window_size"][0])
    return {
        **row, "sliding_window": fields["window_size"][0] + 1, "windowed_layers": sum(windowed),
        "flops_per_token_needed": flops_per_token - 6 * layers * hidden * seq + needed,
        "flops_count": "mfu: the standard count, every layer 6 x hidden x seq; flops_per_token_needed: each "
        "windowed layer's term scaled by the share of causal (query, key) pairs inside its window",
    }  # fmt: skip


def shape(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields of ``--shape`` (vocabulary 32,000 unless the shape has its own), ``--num-layers``,
    ``--window`` / ``--window-every``."""
    fields = {"vocab_size": VOCAB, **SHAPES[args.shape], **window_fields(args)}
    if args.num_layers is None:
        return fields
    if isinstance(pattern := fields.get("moe_layer_freq"), tuple):  # a per-layer pattern: its first layers
        fields["moe_layer_freq"] = pattern[: args.num_layers]
    return {**fields, "num_layers": args.num_layers}
