"""The torch-native fast path: flash/SDPA core attention and a fused vocabulary-parallel cross entropy.

Megatron-Core's "local" spec (what runs without Transformer Engine) computes attention as baddbmm + softmax + bmm,
materialising the [B, heads, S, S] scores, and its cross entropy converts the whole micro-batch's logits to
float32. The modules here are drop-in replacements built on PyTorch alone:

* :class:`SDPAttention` -- Megatron's core-attention interface on ``F.scaled_dot_product_attention`` (flash or
  cuDNN kernels on GPU, the math kernel on CPU). With rotary position embeddings it also applies RoPE to the
  queries and keys, as one compiled kernel each on GPU (Megatron's own fused RoPE needs Transformer Engine;
  unfused it is ~8 elementwise kernels per tensor). The GPTModel is then built without its own rotary step
  (``position_embedding_type="none"``: same parameters, same checkpoints, see ``ModelConfig.gpt_model_kwargs``);
* :func:`vocab_parallel_cross_entropy` -- the cross entropy of vocabulary-parallel logits whose reductions and
  gradient are single compiled kernels on GPU: float32 only in registers, the gradient written in the logits'
  dtype (eager PyTorch, with the same math, on CPU).

``ModelConfig.kernels`` chooses between them, Megatron's reference local spec and the Transformer Engine spec.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

Kernels = Literal["auto", "torch", "te", "local"]
Resolved = Literal["torch", "te", "local"]


@functools.cache
def te_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (it needs a CUDA toolchain to install)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken install (missing CUDA libraries) counts as absent
        return False
    return True


def resolve(kernels: Kernels, device_type: str) -> Resolved:
    """The concrete kernel set for ``kernels`` on ``device_type`` ("cuda" or "cpu").

    ``"auto"``: Transformer Engine's spec when it imports, else the torch-native fast path, on GPU; Megatron's
    reference local spec on CPU, where compiled kernels buy nothing and only cost compile time.
    """
    if kernels == "auto":
        if device_type != "cuda":
            return "local"
        return "te" if te_available() else "torch"
    if kernels == "te":
        if not te_available():
            raise ValueError(
                "ModelConfig(kernels='te') needs Transformer Engine (`import transformer_engine.pytorch` failed); "
                "use kernels='torch' (torch-native fast path) or 'auto'"
            )
        if device_type != "cuda":
            raise ValueError("ModelConfig(kernels='te') runs on GPUs only; use kernels='torch' or 'local' on CPU")
    return kernels


@dataclass(frozen=True)
class Rotary:
    """RoPE settings (GPTModel arguments, not TransformerConfig fields) for :class:`SDPAttention`."""

    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    seq_len_interpolation_factor: float | None = None


class SDPAttention(MegatronModule):
    """Megatron's core attention (the ``core_attention`` submodule of ``SelfAttention``) on SDPA.

    Takes Megatron's layout -- query ``[S, B, heads/tp, d]``, key/value ``[S, B, groups/tp, d]`` -- and returns
    ``[S, B, heads/tp * d]``, like ``DotProductAttention``. Causal masking uses SDPA's ``is_causal`` (no mask
    tensor); an explicit boolean mask (True = masked out, Megatron's convention) is honoured too. With ``rotary``
    the module applies RoPE to query and key first (positions 0..S-1, Megatron's ``RotaryEmbedding`` frequencies).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rotary: Rotary | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not split sequences: it needs context_parallel_size=1")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError(
                f"SDPAttention supports softmax_type='vanilla' without window_size (got {config.softmax_type!r}, "
                f"{config.window_size}); use kernels='local'"
            )
        from megatron.core.transformer.enums import AttnMaskType

        self.causal = attn_mask_type == AttnMaskType.causal
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # Megatron's DotProductAttention draws dropout from the model-parallel RNG stream except under SP.
        self.fork_rng = not config.sequence_parallel
        # A plain attribute, not a submodule: no state, and one table for every layer with these settings.
        self.rope = None if rotary is None else _rope_table(rotary, head_dim)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes neither attention_bias nor packed sequences; use kernels='te'")
        seq, batch, heads, _ = query.shape
        if self.rope is not None:
            if key.shape[0] != seq:  # e.g. a KV cache: positions would no longer be 0..S-1 for both
                raise ValueError("SDPAttention applies RoPE at positions 0..S-1: query and key lengths must match")
            cos, sin = self.rope.cos_sin(seq, query.device)  # [S, 1, 1, rotary dims], float32
            rope = _kernel(_rope, query.device)
            query, key = rope(query, cos, sin), rope(key, cos, sin)
        # [S, B, n, d] -> [B, n, S, d]: SDPA's layout (a strided view; the kernels accept it)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        dropout = self.dropout if self.training else 0.0
        context = _sdpa(q, k, v, mask, dropout, self.causal and mask is None, self.softmax_scale, self.fork_rng)
        # [B, n, S, d] -> [S, B, n * d]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, causal: bool, scale: float, fork_rng: bool
) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if dropout == 0.0 or not fork_rng:
        return F.scaled_dot_product_attention(q, k, v, mask, dropout, causal, scale=scale, enable_gqa=gqa)
    from megatron.core import tensor_parallel

    # Heads are split across tensor-parallel ranks: draw the dropout mask from the model-parallel RNG stream
    # (as Megatron's DotProductAttention does) so that each rank's heads get independent masks.
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return F.scaled_dot_product_attention(q, k, v, mask, dropout, causal, scale=scale, enable_gqa=gqa)


class _RopeTable:
    """cos/sin of Megatron's ``RotaryEmbedding`` frequencies per sequence length and device, computed once for all
    layers (Megatron computes them once per model forward; a per-layer ``RotaryEmbedding`` would redo them in every
    layer and its class-wide LRU cache of 32 entries thrashes beyond 32 layers)."""

    def __init__(self, rotary: Rotary, head_dim: int) -> None:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.embedding = RotaryEmbedding(
            kv_channels=head_dim, rotary_percent=rotary.rotary_percent, rotary_base=rotary.rotary_base,
            rope_scaling=rotary.rope_scaling, rope_scaling_factor=rotary.rope_scaling_factor,
            seq_len_interpolation_factor=rotary.seq_len_interpolation_factor, use_cpu_initialization=True,
        )  # fmt: skip
        self.tables: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def cos_sin(self, seq: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (seq, device)
        if key not in self.tables:
            if len(self.tables) >= 64:  # many distinct lengths (variable-length predict): start over
                self.tables.clear()
            with torch.no_grad():
                freqs = self.embedding(seq).to(device)  # [S, 1, 1, rotary dims], float32
            self.tables[key] = (freqs.cos(), freqs.sin())
        return self.tables[key]


@functools.cache
def _rope_table(rotary: Rotary, head_dim: int) -> _RopeTable:
    return _RopeTable(rotary, head_dim)


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``t`` [S, B, n, d] (non-interleaved halves), in float32."""
    rot = cos.shape[-1]
    x = t[..., :rot].float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(t.dtype), t[..., rot:]), dim=-1)


# ---------------------------------------------------------------- cross entropy
def _ce_stats(logits: Tensor, logits_max: Tensor, local_target: Tensor, in_range: Tensor) -> tuple[Tensor, Tensor]:
    """Per position: sum(exp(logit - max)) over this rank's vocabulary slice, and the target's logit (0 if the
    target lies in another rank's slice). Float32 math on ``logits`` of any dtype."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
    return sum_exp, torch.where(in_range, target_logit, 0.0)


def _ce_grad(logits: Tensor, lse: Tensor, local_target: Tensor, in_range: Tensor, grad: Tensor) -> Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad, in the logits' dtype."""
    softmax = (logits.float() - lse.unsqueeze(-1)).exp()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == local_target.unsqueeze(-1)) & in_range.unsqueeze(-1)
    return ((softmax - onehot.float()) * grad.unsqueeze(-1)).to(logits.dtype)


@functools.cache
def _compiled(fn: Any) -> Any:
    # Default dynamic-shape handling: static for the first shape, one dynamic recompile when shapes vary
    # (predict/log-probs over variable lengths), instead of a compile per shape up to dynamo's limit.
    return torch.compile(fn)


def _kernel(fn: Any, device: torch.device) -> Any:
    # Compiled on GPU (one fused kernel per function, no float32 copy of the logits); eager elsewhere.
    return _compiled(fn) if device.type == "cuda" else fn


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        rank = torch.distributed.get_rank(group) if group is not None else 0
        size = group.size() if group is not None else 1
        vocab = logits.shape[-1]
        start = rank * vocab
        in_range = (targets >= start) & (targets < start + vocab)
        local_target = torch.where(in_range, targets - start, 0)
        logits_max = logits.detach().amax(dim=-1).float()
        if size > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        sum_exp, target_logit = _kernel(_ce_stats, logits.device)(logits, logits_max, local_target, in_range)
        if size > 1:
            stats = torch.stack([sum_exp, target_logit])  # one all-reduce for both
            torch.distributed.all_reduce(stats, group=group)
            sum_exp, target_logit = stats[0], stats[1]
        lse = logits_max + sum_exp.log()
        ctx.save_for_backward(logits, lse, local_target, in_range)
        return lse - target_logit

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, lse, local_target, in_range = ctx.saved_tensors
        return _kernel(_ce_grad, logits.device)(logits, lse, local_target, in_range, grad.float()), None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy ``[...]`` of vocabulary-parallel logits ``[..., V/tp]`` (any float dtype) and ``targets``.

    Equal to Megatron's ``tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)`` (value and
    gradient), without a float32 copy of the logits on GPU.
    """
    from megatron.core import parallel_state

    group = None
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
