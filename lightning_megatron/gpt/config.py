"""Model description for a Megatron-Core GPT decoder, kept apart from how it is parallelised.

`ModelConfig` is what a user writes (YAML / LightningCLI); the strategy decides TP/PP/VPP/CP/EP/SP
and dtypes, checks them with `validate_parallel` *before* building anything, and only then calls
`to_transformer_config(**parallel)` (the layer specs come from `lightning_megatron.gpt.specs`). Field names
follow Megatron's `TransformerConfig` so that configs read the same as Megatron-LM's; the exception is
`norm_epsilon` (Megatron-LM's CLI name, `layernorm_epsilon` on `TransformerConfig`).
"""

import functools
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch.nn.functional as F
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from lightning_megatron.gpt import attention_variants as variants
from lightning_megatron.gpt.config_checks import (
    check_cuda_graphs,
    check_graph_layout,
    check_recompute,
    check_sequence,
    check_stages,
    check_tensor_split,
)
from lightning_megatron.gpt.gemma import check_gemma
from lightning_megatron.gpt.mla import check_mla, check_mla_parallel, mla_fields
from lightning_megatron.gpt.moe.config import build_with_expert_biases, check_moe, check_moe_parallel, moe_layer_pattern
from lightning_megatron.gpt.plan import Kernels, Resolved
from lightning_megatron.gpt.transformer import LOCAL_BACKEND, fused_mla_rope_fits, kernel_fields
from lightning_megatron.gpt.yarn import check_yarn, yarn_attributes
from lightning_megatron.parallel.sizes import ParallelSizes
from lightning_megatron.validation import check_choice, check_positive_int, divisors

__all__ = ["ModelConfig", "tiny_gpt"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
                "quick_gelu": quick_gelu}  # fmt: skip

# ModelConfig fields that TransformerConfig has under the same name. vocab_size, seq_length, position
# embedding, rotary and tied-embedding settings are GPTModel arguments instead (see gpt_model_kwargs).
_SAME_NAME_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "normalization", "apply_residual_connection_post_layernorm", "hidden_dropout", "attention_dropout",
    "add_bias_linear", "add_qkv_bias", "gated_linear_unit", "qk_layernorm", "init_method_std",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "num_moe_experts", "moe_router_topk",
    "moe_enable_routing_replay", "layernorm_zero_centered_gamma", "glu_linear_offset", "activation_func_clamp_value",
)  # fmt: skip
# MoE fields passed to TransformerConfig under the same name (MoE models only; moe_layer_freq and moe_grouped_gemm
# are converted).
_MOE_FIELDS = (
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
)  # fmt: skip


@dataclass(kw_only=True)
class ModelConfig:
    """A GPT decoder (Llama-style defaults: RMSNorm, RoPE, SwiGLU, no bias, untied embeddings)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Transformer hidden size (model width)."""
    num_attention_heads: int
    """Number of query attention heads."""
    vocab_size: int
    """Vocabulary size (rows of the embedding / output layer); must divide by the tensor-parallel size."""
    seq_length: int
    """Maximum sequence length the model is built for (GPTModel's max_sequence_length)."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means num_attention_heads (plain MHA)."""
    kv_channels: int | None = None
    """Per-head projection size; None means hidden_size // num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP hidden size; None means 4 * hidden_size."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """Normalization layer type."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm (TransformerConfig.layernorm_epsilon)."""
    apply_residual_connection_post_layernorm: bool = False
    """Use the original BERT residual ordering (residual taken after the norm)."""
    hidden_dropout: float = 0.0
    """Dropout probability on the transformer hidden state."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities."""
    position_embedding_type: Literal["rope", "yarn", "learned_absolute", "none"] = "rope"
    """Position embedding: rotary, rotary with YaRN scaling (GPT-OSS; rotary_base, rotary_scaling_factor to
    mscale_all_dim and yarn_correction_range_round_to_int below), learned absolute, or none."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates, in (0, 1]."""
    rotary_base: int = 10000
    """RoPE base period (theta)."""
    rope_scaling: bool = False
    """Llama-3.x RoPE frequency scaling (HF rope_type 'llama3'), as Megatron implements it: low/high frequency
    factors 1 and 4 and an original context of 8192 tokens; the factor is rope_scaling_factor."""
    rope_scaling_factor: float = 8.0
    """Llama-3.x RoPE scaling factor (8 for Llama 3.1, 32 for Llama 3.2); used only with rope_scaling=True."""
    seq_len_interpolation_factor: float | None = None
    """Linear RoPE position interpolation (HF rope_type 'linear'): positions are divided by this factor; None
    disables it."""
    add_bias_linear: bool = False
    """Add a bias to every linear layer (QKV, attention output, both MLP layers)."""
    add_qkv_bias: bool = False
    """Add a bias to the QKV projection only (e.g. Qwen2)."""
    gated_linear_unit: bool = True
    """Gated MLP (GLU); with activation='silu' this is SwiGLU, with 'gelu' GeGLU."""
    activation: Literal["silu", "gelu", "gelu_tanh", "quick_gelu"] = "silu"
    """MLP non-linearity ('gelu_tanh': GELU's tanh approximation, Gemma's ``gelu_pytorch_tanh``; 'quick_gelu':
    ``x * sigmoid(1.702 x)``, GPT-OSS's gate)."""
    glu_linear_offset: float = 0.0
    """Added to the GLU's linear half before the product (Megatron's field; GPT-OSS: 1, ``(up + 1) * act(gate)``)."""
    activation_func_clamp_value: float | None = None
    """GLU clamp (Megatron's field; GPT-OSS's swiglu_limit): gate clamped above, linear half to [-v, v]."""
    qk_layernorm: bool = False
    """Normalize queries and keys per head before attention."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer weights."""
    init_method_std: float = 0.02
    """Std of the normal initialization of weights (output layers are scaled by depth)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation: 'full' layers, 'selective' (core attention only), or None (off)."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With recompute_granularity='full': 'uniform' chunks of layers or the first 'block' layers per stage."""
    recompute_num_layers: int | None = None
    """With recompute_granularity='full': layers per chunk ('uniform') or per pipeline stage ('block')."""
    num_moe_experts: int | None = None
    """Number of MoE experts per layer; None builds a dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to (MoE only)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert MLP; None means ffn_hidden_size (MoE only)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: 'softmax' over the experts, or 'sigmoid' per expert (DeepSeek-V3), whose k chosen scores are
    divided by their sum when moe_router_topk > 1 (MoE only)."""
    moe_router_pre_softmax: bool = False
    """How softmax routing forms the k weights (Megatron's ``topk_routing_with_score_function``). False: top-k over the
    router logits, then a softmax over those k -- the renormalised top-k (Mixtral; Qwen3-MoE with
    ``norm_topk_prob=True``). True: a softmax over all experts, then the top-k probabilities as they are, not
    renormalised (Qwen2-MoE; Qwen3-MoE with ``norm_topk_prob=False``); the form in which top-1 softmax routing has
    a gradient. Softmax only: Megatron ignores it for sigmoid scores (MoE only)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the sigmoid scores when choosing the
    top-k (not to the weights), moved after every optimizer step by moe_router_bias_update_rate towards the experts
    that got fewer tokens in the global batch; a buffer saved in checkpoints. Needs score function 'sigmoid'."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update per global batch (DeepSeek-V3's 1e-3); with moe_router_enable_expert_bias.
    0 keeps the bias as loaded (as ``transformers`` fine-tunes: its training step leaves the bias unchanged)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2/V3): the experts form this many equal groups (e.g. the EP size, or the nodes
    of the EP group); each token picks moe_router_group_topk groups, by the sum of its top (moe_router_topk //
    moe_router_group_topk) scores in each, and its moe_router_topk experts among theirs. None: no groups."""
    moe_router_group_topk: int | None = None
    """Groups each token routes to, with moe_router_num_groups (set both or neither)."""
    moe_router_topk_scaling_factor: float | None = None
    """Factor on the k routing weights once formed (DeepSeek-V3's ``routed_scaling_factor``, 2.5); None: 1."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    """The load-balancing loss moe_aux_loss_coeff weights: 'aux_loss' over each micro-batch's tokens (Switch,
    GShard), 'seq_aux_loss' per sequence (DeepSeek-V2/V3), 'global_aux_loss' with the expert loads of the whole
    global batch (Qwen3-MoE's global-batch balancing), or 'none'."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss each MoE layer adds to the gradient (e.g. 1e-2 to 1e-3; 0: off). Logged
    every training step as ``moe_aux_loss`` (:mod:`lightning_megatron.gpt.moe.router`)."""
    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss (ST-MoE: the squared logsumexp of the router logits, averaged over tokens),
    e.g. 1e-3; None: off. Logged every training step as ``moe_z_loss``."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared expert MLP every token goes through besides its routed experts (several shared
    experts: their number times the size of one; Qwen2-MoE, DeepSeek); None: no shared expert."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a per-token sigmoid gate (Qwen2-MoE's ``shared_expert_gate``, a
    hidden_size -> 1 projection); needs moe_shared_expert_intermediate_size."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE (Megatron's semantics): an int k makes layer i (0-based) MoE iff i % k == 0 (1: every
    layer); a tuple of 0/1, one per layer, says it layer by layer. The others are dense MLPs of ffn_hidden_size
    (e.g. DeepSeek's leading dense layers: (0, 1, 1, ...))."""
    moe_grouped_gemm: bool | None = None
    """How the experts compute: None -- grouped GEMMs (one kernel per projection for all of a rank's experts) where
    the device has them, a loop over the experts elsewhere; True -- grouped GEMMs required (refused where there are
    none); False -- always the loop. The same experts module, parameters and checkpoints in all three cases."""
    kernels: Kernels = "auto"
    """Which kernels build the layers. 'torch': the torch-native fast path (SDPA/flash core attention, a fused
    vocabulary-parallel cross entropy, and on GPU Megatron's torch.compile'd SwiGLU/GeGLU and bias-dropout-add);
    'te': Megatron's Transformer Engine spec (GPU, needs transformer_engine); 'local': Megatron's reference
    torch spec (unfused attention; no packed batches, no context parallelism); 'auto': 'te' if Transformer Engine
    imports, else 'torch', on GPU, and 'torch' on CPU (uncompiled there) -- and 'torch' for models imported with
    from_hf, whose weight mapping targets the torch-native layer names. All give the same model and the same
    checkpoints."""
    gradient_accumulation_fusion: bool | None = None
    """Accumulate each parallel linear's weight gradient straight into its fp32 ``main_grad`` with one
    fp32-output GEMM (what Megatron's flag of this name does with apex, here without it). None: on with the
    'torch' kernels on GPU (torch >= 2.11), off elsewhere; True: also with 'local' and on CPU (an upcast GEMM
    there, slower: for tests); False: Megatron's unfused path. Same numerics up to rounding; same checkpoints."""
    fp8: str | None = None
    """The parallel linears of the transformer layers run their three GEMMs in fp8 without Transformer Engine
    (torch._scaled_mm; each tensor scaled by its own amax per GEMM), in one of Megatron's fp8 formats: 'hybrid'
    (e4m3 activations and weights, e5m2 output gradients) or 'e4m3' (e4m3 for all three; its loss comes closer to
    bf16's, see docs/layouts-and-speed.md). Master weights, optimizer and checkpoints stay those of a bf16 run; the
    LM head stays bf16. The weights' fp8 casts are kept for a step's later micro-batches: 2 bytes per weight
    element of GPU memory until teardown. Needs a GPU with fp8 tensor cores (Ada/Hopper or later) and kernels
    'torch' or 'local'. Experimental: faster than bf16 only with ``cuda_graphs=True``, and its loss trails bf16's
    (README). None: no fp8."""
    cuda_graphs: bool = False
    """Capture each transformer layer's forward and backward as CUDA graphs in the first training step of a fit
    (Megatron-Core's own per-layer graphs, ``TransformerConfig.cuda_graph_impl='local'``) and replay them: the host
    launches one graph per layer instead of its hundreds of kernels. For small models whose steps wait on the host.
    GPU only; dense models without dropout or recompute, at pp=1 and cp=1; every micro-batch (inference too) of
    rows of exactly ``seq_length`` tokens, not packed. The same checkpoints as without; to run such a checkpoint
    elsewhere, ``load_from_checkpoint(path, config=dataclasses.replace(config, cuda_graphs=False))``."""
    multi_latent_attention: bool = False
    """Multi-Latent Attention (DeepSeek-V2/V3, Kimi-K2; Megatron's ``MLASelfAttention``): keys and values
    up-projected per head from one latent of kv_lora_rank per token, plus a RoPE slice shared by the heads
    (docs/huggingface.md, "Multi-Latent Attention"). The fields below to mscale_all_dim are its settings."""
    q_lora_rank: int | None = None
    """Rank of the query's down-projection (DeepSeek-V3: 1536); None: a direct query projection (V2-Lite)."""
    kv_lora_rank: int = 512
    """Rank of the key/value latent (DeepSeek-V3: 512)."""
    qk_head_dim: int = 128
    """Per-head query/key size without RoPE (HF's qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key size that RoPE rotates (HF's qk_rope_head_dim); the key's part is shared by the heads."""
    v_head_dim: int = 128
    """Per-head value size."""
    rope_type: Literal["rope", "yarn"] = "yarn"
    """MLA's RoPE: 'rope' (rotary_base, rotary_percent) or 'yarn' (the fields below, DeepSeek-V3's)."""
    rotary_scaling_factor: float = 40.0
    """YaRN scaling factor (HF rope_scaling 'factor')."""
    original_max_position_embeddings: int = 4096
    """YaRN's original context length."""
    beta_fast: float = 32.0
    """YaRN beta_fast."""
    beta_slow: float = 1.0
    """YaRN beta_slow."""
    mscale: float = 1.0
    """YaRN mscale (the RoPE cos/sin correction, with mscale_all_dim)."""
    mscale_all_dim: float = 0.0
    """YaRN mscale_all_dim: the softmax scale is 1/sqrt(qk_head_dim + qk_pos_emb_head_dim) times its mscale squared."""
    yarn_correction_range_round_to_int: bool = True
    """YaRN ramp ends rounded to whole dimensions (HF's ``truncate``; GPT-OSS: False); position_embedding_type yarn."""
    window_size: tuple[int, int] | None = None
    """Sliding-window causal attention (Megatron's field): ``(W, 0)`` attends a query to itself and the W tokens before
    it (HF's ``sliding_window`` is W + 1); None: off (docs/layouts-and-speed.md, "Attention variants")."""
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    """Which layers have the window (Megatron's field): None all; an int N: layers N, 2N, ... (1-based) full, the
    others windowed (Gemma 3: 6, GPT-OSS: 2); a tuple of 0/1 per layer, 1 = windowed (HF's ``layer_types``)."""
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """Attention sinks (Megatron's field): 'learnable' a trained logit per head in every softmax, its column dropped
    (GPT-OSS; parameter ``core_attention.softmax_offset``); 'off-by-one' a logit of 0; 'vanilla' none."""
    softmax_scale: float | None = None
    """Attention score scale (Megatron's field); None: 1/sqrt(kv_channels). Gemma's query_pre_attn_scalar q: q**-0.5."""
    attn_logit_softcapping: float | None = None
    """``c * tanh(scores / c)`` on the scaled scores (Gemma 2; no Megatron field); None: off. Kernels 'torch' only."""
    layernorm_zero_centered_gamma: bool = False
    """RMSNorm gains stored as w and applied as 1 + w (Megatron's field; Gemma's RMSNorm). RMSNorm, not 'te'."""
    post_sublayer_norms: bool = False
    """A norm on the output of attention and of the MLP before each residual add (Gemma 2/3); dense layers."""
    scale_embeddings: bool = False
    """Multiply the embeddings by sqrt(hidden_size), rounded to their dtype (Gemma)."""
    final_logit_softcapping: float | None = None
    """``c * tanh(logits / c)`` on the output logits, before the loss, log-probs and predictions (Gemma 2)."""
    local_rotary_base: int | None = None
    """RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq; no scaling); None: rotary_base."""
    moe_enable_routing_replay: bool = False
    """Let batches carry the expert routing to use (``batch["routing"]``, e.g. recorded at rollout by
    ``MegatronLMModule.record_routing`` or an inference engine) instead of the router's own top-k (MoE only)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            check_positive_int(name, getattr(self, name))
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size", "num_moe_experts", "moe_ffn_hidden_size"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_choice("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        check_choice("activation", self.activation, tuple(_ACTIVATIONS))
        positions = ("rope", "yarn", "learned_absolute", "none")
        check_choice("position_embedding_type", self.position_embedding_type, positions)
        check_yarn(self)
        check_choice("kernels", self.kernels, ("auto", "torch", "te", "local"))
        check_choice("fp8", self.fp8, (None, "hybrid", "e4m3"))
        if self.fp8 is not None and self.kernels == "te":
            raise ValueError(
                f"fp8={self.fp8!r} is the torch-native fp8 path; with kernels='te' use Transformer Engine's own fp8 "
                "(Trainer(precision='transformer-engine')) and leave fp8=None"
            )
        check_cuda_graphs(self)
        for name in ("norm_epsilon", "init_method_std", "rotary_base", "rope_scaling_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.seq_len_interpolation_factor is not None and self.seq_len_interpolation_factor <= 0:
            raise ValueError(
                f"seq_len_interpolation_factor={self.seq_len_interpolation_factor} must be > 0, or None to disable"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1); use 0.0 to disable dropout")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1]; 1.0 rotates whole heads")

        heads, groups = self.num_attention_heads, self.effective_num_query_groups
        if heads % groups != 0:
            raise ValueError(
                f"num_attention_heads={heads} must be divisible by num_query_groups={groups}; "
                f"pick num_query_groups among {divisors(heads)}"
            )
        # Megatron silently floors hidden/heads; a non-integer head dim is almost always a typo.
        if self.kv_channels is None and self.hidden_size % heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={heads} when "
                f"kv_channels is None; pick num_attention_heads among {divisors(self.hidden_size)} "
                "or set kv_channels explicitly"
            )
        check_recompute(self)
        self._check_moe()
        check_mla(self)
        variants.check_variants(self)
        check_gemma(self)

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> Self:
        """The model of a Hugging Face config (a ``PretrainedConfig``, a config.json dict or a model directory).

        Causal LMs of the families in ``gpt/hf/families/``: dense Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text);
        mixture of experts Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and GLM-4.5
        (:func:`lightning_megatron.gpt.hf.fields.model_fields` says what maps to what). Keyword arguments override
        fields; ``seq_length`` defaults to ``max_position_embeddings`` (capped by a sliding attention window the
        family does not build).
        """
        from lightning_megatron.gpt.hf.fields import model_fields

        fields = model_fields(hf_config, seq_length=overrides.pop("seq_length", None))
        return cls(**{**fields, **overrides})

    def _check_moe(self) -> None:
        if isinstance(self.moe_layer_freq, list):  # YAML / JSON give lists
            self.moe_layer_freq = tuple(self.moe_layer_freq)
        check_moe(self)
        if self.moe_enable_routing_replay and self.num_moe_experts is None:
            raise ValueError(
                "moe_enable_routing_replay=True replays expert routing, but num_moe_experts=None is a dense model "
                "with no router; set num_moe_experts or moe_enable_routing_replay=False"
            )
        if self.moe_enable_routing_replay and self.recompute_granularity is not None:
            raise ValueError(
                f"moe_enable_routing_replay=True with recompute_granularity={self.recompute_granularity!r}: "
                "replaying routing inside recomputed backward passes is not supported; use recompute_granularity=None"
            )

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each (0-based, global) layer is an MoE layer (all False for a dense model)."""
        if self.num_moe_experts is None:
            return (False,) * self.num_layers
        return moe_layer_pattern(self.num_layers, self.moe_layer_freq)

    @property
    def attention_variants(self) -> bool:
        """Whether some layer runs a sliding window, sinks or soft-capping (the 'torch' kernels' variant path)."""
        return variants.has_variants(self)

    @property
    def activation_fusable(self) -> bool:
        """Whether Megatron has a fused kernel for this MLP activation: SwiGLU, GeGLU and bias+GeLU (plain GeLU
        without a bias has none)."""
        if self.activation in ("gelu_tanh", "quick_gelu"):  # Megatron's dense MLP fuses F.gelu and F.silu only
            return False
        return self.gated_linear_unit or (self.activation == "gelu" and self.add_bias_linear)

    @property
    def effective_num_query_groups(self) -> int:
        """KV heads actually built (num_query_groups, defaulting to num_attention_heads)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def effective_kv_channels(self) -> int:
        """Per-head dimension actually built."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def effective_ffn_hidden_size(self) -> int:
        """MLP hidden size actually built."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    def validate_parallel(self, sizes: ParallelSizes) -> None:
        """Check that this model can be split by ``sizes`` (which checked themselves); raise ValueError otherwise."""
        check_tensor_split(self, sizes.tp)
        check_stages(self, sizes.pp, sizes.vpp)
        check_moe_parallel(self, sizes.ep, sizes.tp, sizes.sequence_parallel)
        check_mla_parallel(self, sizes.tp)
        variants.check_variants_parallel(self, sizes.cp)
        check_sequence(self, sizes.tp, sizes.cp, sizes.sequence_parallel)
        check_graph_layout(self, sizes.pp, sizes.cp)

    def to_transformer_config(
        self, kernels: Resolved = "local", compile_fusions: bool = False, **parallel: Any
    ) -> TransformerConfig:
        """Build Megatron's TransformerConfig; `parallel` (TP/PP/dtypes/...) is passed through unchanged.

        ``kernels`` is the resolved kernel set (:func:`lightning_megatron.gpt.plan.resolve`); with ``'torch'``,
        ``compile_fusions`` turns on Megatron's compiled fusions on GPU (``gpt.transformer.kernel_fields``).
        """
        model: dict[str, Any] = {name: getattr(self, name) for name in _SAME_NAME_FIELDS}
        mla_yarn = fused_mla_rope_fits(self, parallel.get("context_parallel_size", 1))
        rope, fusable = self.position_embedding_type == "rope", self.activation_fusable
        model.update(kernel_fields(kernels, compile_fusions, rope=rope, activation_fusable=fusable, mla_yarn=mla_yarn))
        if self.num_moe_experts is not None and self.add_bias_linear:
            # Megatron's grouped-experts module asserts this fusion off when experts have biases (GPT-OSS); the
            # unfused bias-dropout-add computes the same sum.
            model["bias_dropout_fusion"] = False
        model["layernorm_epsilon"] = self.norm_epsilon
        model["activation_func"] = _ACTIVATIONS[self.activation]
        if self.cuda_graphs:
            model["cuda_graph_impl"] = "local"  # Megatron's graphs, built without Transformer Engine
        if self.num_moe_experts is not None:
            # Passed explicitly: Megatron warns when it has to fall back to ffn_hidden_size itself.
            model["moe_ffn_hidden_size"] = self.moe_ffn_hidden_size or self.effective_ffn_hidden_size
            model.update({name: getattr(self, name) for name in _MOE_FIELDS})
            freq = self.moe_layer_freq
            model["moe_layer_freq"] = freq if isinstance(freq, int) else [int(flag) for flag in freq]
            # The experts module reads it: grouped GEMMs where the device has them (None, True) or the loop (False).
            model["moe_grouped_gemm"] = self.moe_grouped_gemm is not False
            # The token dispatcher is a parallel setting: the strategy picks it (lightning_megatron.gpt.moe.router).
        model.update(mla_fields(self))
        model.update(variants.variant_fields(self))
        clash = sorted(model.keys() & parallel.keys())
        if clash:
            raise ValueError(f"{clash} are model fields; set them on ModelConfig, not as parallel settings")
        # MLA's fields exist on Megatron's MLATransformerConfig only.
        config_class = MLATransformerConfig if self.multi_latent_attention else TransformerConfig
        return yarn_attributes(self, build_with_expert_biases(config_class, {**LOCAL_BACKEND, **model, **parallel}))

    def gpt_model_kwargs(self, kernels: Resolved = "local") -> dict[str, Any]:
        """Arguments of GPTModel(...) that live outside TransformerConfig.

        With ``kernels='torch'`` and RoPE, the rotary embedding is applied inside :class:`SDPAttention` (fused),
        so the GPTModel is built without its own: ``position_embedding_type='none'``; RoPE has no parameters,
        so the parameters and checkpoints are the same.
        """
        rope_in_attention = kernels == "torch" and self.position_embedding_type == "rope"
        return {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.seq_length,
            "position_embedding_type": "none" if rope_in_attention else self.position_embedding_type,
            "rotary_percent": self.rotary_percent,
            "rotary_base": self.rotary_base,
            "share_embeddings_and_output_weights": self.share_embeddings_and_output_weights,
            # RoPE scalings only when set, so that unscaled models build exactly as before.
            **({"rope_scaling": True, "rope_scaling_factor": self.rope_scaling_factor} if self.rope_scaling else {}),
            **(
                {"seq_len_interpolation_factor": self.seq_len_interpolation_factor}
                if self.seq_len_interpolation_factor is not None
                else {}
            ),
        }


def tiny_gpt(**overrides: Any) -> ModelConfig:
    """A ~200k-parameter GPT for tests and CPU smoke runs; keyword arguments override any field. With
    ``multi_latent_attention=True``, MLA sizes of its scale (q/k heads 16 + 8, v heads 16, latent 32)."""
    base: dict[str, Any] = dict(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256, seq_length=32
    )
    if overrides.get("multi_latent_attention"):
        base.update(kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope")
    return ModelConfig(**{**base, **overrides})
