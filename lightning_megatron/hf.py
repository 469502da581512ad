"""Hugging Face in and out: Llama / Mistral / Qwen2 / Qwen3 causal LMs <-> Megatron-Core ``GPTModel`` chunks.

Import: :func:`model_fields` maps an HF config to :class:`~lightning_megatron.ModelConfig` fields; when the strategy
builds a chunk, :func:`load_chunk` reads from the safetensors files only the slices of each tensor that this
rank's tensor-parallel shard and pipeline / virtual-pipeline layers need (``safe_open(...).get_slice``), so no rank
materialises the full model. Export: :func:`export_weights` streams full HF tensors one at a time (gathered over
tensor parallelism, broadcast from the owning pipeline stage) and ``save_pretrained`` writes them with rank 0; both
live in :mod:`lightning_megatron.hf_export`.

One table, :func:`_chunk_params`, says which HF tensors make each Megatron parameter and how they are split over
tensor-parallel ranks; import and export both read it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from torch import Tensor, nn

from lightning_megatron import pickled
from lightning_megatron.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_BY_MODEL_TYPE = {name.removesuffix("ForCausalLM").lower(): name for name in ARCHITECTURES}
# What Megatron's Llama-3 RoPE scaling hard-codes (RotaryEmbedding._apply_scaling); only its factor is a parameter.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_INDEX, _SINGLE = "model.safetensors.index.json", "model.safetensors"


# ---------------------------------------------------------------------------------------------------- config
def _hf_config(hf_config: Any) -> Any:
    """A transformers ``PretrainedConfig`` from a config, a config.json dict or a model directory."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, str | Path):
        return AutoConfig.from_pretrained(str(hf_config))
    if isinstance(hf_config, Mapping):
        model_type = hf_config.get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise ValueError(_unsupported(f"model_type={model_type!r}"))
        # from_dict fills what config.json leaves out with the architecture's defaults, as transformers does.
        return CONFIG_MAPPING[model_type].from_dict(dict(hf_config))
    raise TypeError(f"hf_config must be a PretrainedConfig, a config.json dict or a directory, got {type(hf_config)}")


def _unsupported(what: str) -> str:
    try:
        import megatron.bridge  # noqa: F401
    except Exception as error:  # any import failure means the same: no bridge here
        bridge = (
            f"Megatron-Bridge's AutoBridge (more architectures) is not importable here ({type(error).__name__}: "
            f"{error}); it needs Transformer Engine and `pip install lightning-megatron[bridge]`"
        )
    else:
        bridge = (
            "megatron.bridge is installed, but from_hf does not delegate to its AutoBridge (it builds Transformer "
            "Engine layer specs, not the local spec this module trains); convert with AutoBridge directly"
        )
    return f"{what} is not supported; supported architectures: {', '.join(ARCHITECTURES)}. {bridge}"


def architecture(hf_config: Any) -> str:
    """The supported architecture name of an HF config; raises ValueError for any other."""
    cfg = _hf_config(hf_config)
    names = list(getattr(cfg, "architectures", None) or [])
    name = names[0] if names else _BY_MODEL_TYPE.get(getattr(cfg, "model_type", ""), "")
    if name not in ARCHITECTURES:
        raise ValueError(_unsupported(f"architecture {name or cfg.model_type!r}"))
    return name


def model_fields(hf_config: Any, *, seq_length: int | None = None) -> dict[str, Any]:
    """:class:`~lightning_megatron.ModelConfig` fields of a Llama / Mistral / Qwen2 / Qwen3 HF config.

    ``seq_length`` defaults to ``max_position_embeddings``, capped by a sliding attention window (the local
    attention is full causal attention, exact only for sequences that fit in the window).
    """
    cfg = _hf_config(hf_config)
    arch = architecture(cfg)
    for flag in ("attention_bias", "mlp_bias"):  # biases on o_proj / the MLP have no Megatron counterpart here
        if getattr(cfg, flag, False):
            raise ValueError(f"{arch} with {flag}=True is not supported (only Qwen2's q/k/v biases are)")
    if cfg.hidden_act not in ("silu", "gelu"):
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; 'silu' or 'gelu'")
    heads = cfg.num_attention_heads
    return {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": getattr(cfg, "num_key_value_heads", None) or heads,
        "kv_channels": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "ffn_hidden_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "seq_length": _seq_length(cfg, seq_length),
        "normalization": "RMSNorm",
        "norm_epsilon": float(cfg.rms_norm_eps),
        "activation": cfg.hidden_act,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": arch == "Qwen2ForCausalLM",
        "qk_layernorm": arch == "Qwen3ForCausalLM",
        "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings),
        "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0)),
        "init_method_std": float(getattr(cfg, "initializer_range", 0.02)),
        **_rope_fields(cfg),
    }


def _seq_length(cfg: Any, requested: int | None) -> int:
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type.startswith("qwen") and not getattr(cfg, "use_sliding_window", False):
        window = None  # Qwen configs carry a window size that only applies with use_sliding_window
    if requested is None:
        return min(cfg.max_position_embeddings, window or cfg.max_position_embeddings)
    if window is not None and requested > window:
        raise ValueError(
            f"seq_length={requested} exceeds the model's sliding attention window ({window}); Megatron's local "
            f"attention here is full causal attention, which equals the windowed one only up to {window} tokens: "
            f"use seq_length <= {window}"
        )
    return requested


def _rope_fields(cfg: Any) -> dict[str, Any]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:  # transformers < 5: rope_theta and rope_scaling
        params = {**(getattr(cfg, "rope_scaling", None) or {}), "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    if params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for HF import")
    theta = float(params.get("rope_theta", 10000.0))
    if not theta.is_integer():
        raise ValueError(f"rope_theta={theta} is not an integer; ModelConfig.rotary_base is an int")
    fields: dict[str, Any] = {"rotary_base": int(theta)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return fields
    if rope_type == "linear":
        return {**fields, "seq_len_interpolation_factor": float(params["factor"])}
    if rope_type == "llama3":
        differ = {k: params.get(k) for k, v in _MEGATRON_LLAMA3.items() if float(params.get(k, v)) != v}
        if differ:
            raise ValueError(
                f"llama3 RoPE scaling with {differ} is not supported: Megatron's implementation fixes "
                f"{_MEGATRON_LLAMA3}"
            )
        return {**fields, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: 'default', 'linear', 'llama3'")


def hf_config_dict(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for a model that was not loaded from HF: Llama, or Qwen2 (q/k/v bias) / Qwen3 (q/k norm)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    check_exportable(config)
    cls, arch = LlamaConfig, "LlamaForCausalLM"
    if config.qk_layernorm:
        cls, arch = Qwen3Config, "Qwen3ForCausalLM"
    elif config.add_qkv_bias:
        cls, arch = Qwen2Config, "Qwen2ForCausalLM"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rope_scaling:
        rope = {**rope, **_MEGATRON_LLAMA3, "rope_type": "llama3", "factor": config.rope_scaling_factor}
    elif config.seq_len_interpolation_factor is not None:
        rope = {**rope, "rope_type": "linear", "factor": config.seq_len_interpolation_factor}
    rope_kwargs: dict[str, Any] = {"rope_parameters": rope}
    if "rope_parameters" not in inspect.signature(cls.__init__).parameters:  # transformers < 5
        scaling = None if rope["rope_type"] == "default" else rope
        rope_kwargs = {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}
    hf = cls(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        intermediate_size=config.effective_ffn_hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.effective_num_query_groups, head_dim=config.effective_kv_channels,
        hidden_act=config.activation, max_position_embeddings=config.seq_length, rms_norm_eps=config.norm_epsilon,
        tie_word_embeddings=config.share_embeddings_and_output_weights, attention_dropout=config.attention_dropout,
        initializer_range=config.init_method_std, architectures=[arch], dtype=dtype, **rope_kwargs,
    )  # fmt: skip
    return hf.to_dict()


def check_exportable(config: ModelConfig) -> None:
    """Raise ValueError unless one of :data:`ARCHITECTURES` can hold this model."""
    unsupported = {
        "normalization": config.normalization != "RMSNorm",
        "position_embedding_type": config.position_embedding_type != "rope",
        "rotary_percent": config.rotary_percent != 1.0,
        "add_bias_linear": config.add_bias_linear,
        "gated_linear_unit": not config.gated_linear_unit,
        "apply_residual_connection_post_layernorm": config.apply_residual_connection_post_layernorm,
        "num_moe_experts": config.num_moe_experts is not None,
        "add_qkv_bias": config.add_qkv_bias and config.qk_layernorm,  # Qwen2 has the biases, Qwen3 the norms
        "seq_len_interpolation_factor": config.rope_scaling and config.seq_len_interpolation_factor is not None,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        values = ", ".join(f"{name}={getattr(config, name)!r}" for name in bad)
        raise ValueError(f"{values}: no HF counterpart among {', '.join(ARCHITECTURES)}")


# ---------------------------------------------------------------------------------------------------- mapping
Kind = Literal["copy", "rows", "cols", "qkv", "gate_up"]
# The dimension each HF tensor of a kind is split along over tensor-parallel ranks (None: replicated).
_SPLIT_DIM: dict[str, int | None] = {"copy": None, "rows": 0, "cols": 1, "qkv": 0, "gate_up": 0}


@dataclass(frozen=True)
class _Param:
    """One Megatron parameter of a chunk and the HF tensors (name, full shape) it is made of."""

    megatron: str
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    kind: Kind


def _layer_params(c: ModelConfig, local: int, layer: int) -> list[_Param]:
    m, att, h = f"decoder.layers.{local}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}."
    hidden, d, ffn = c.hidden_size, c.effective_kv_channels, c.effective_ffn_hidden_size
    q, kv = c.num_attention_heads * d, c.effective_num_query_groups * d
    params = [_Param(m + "self_attention.linear_qkv.weight", _qkv(att, "weight", q, kv, (hidden,)), "qkv")]
    if c.add_qkv_bias:
        params.append(_Param(m + "self_attention.linear_qkv.bias", _qkv(att, "bias", q, kv, ()), "qkv"))
    params.append(_Param(m + "self_attention.linear_proj.weight", ((att + "o_proj.weight", (hidden, q)),), "cols"))
    if c.qk_layernorm:
        params.append(_Param(m + "self_attention.q_layernorm.weight", ((att + "q_norm.weight", (d,)),), "copy"))
        params.append(_Param(m + "self_attention.k_layernorm.weight", ((att + "k_norm.weight", (d,)),), "copy"))
    gate_up = ((h + "mlp.gate_proj.weight", (ffn, hidden)), (h + "mlp.up_proj.weight", (ffn, hidden)))
    params.append(_Param(m + "mlp.linear_fc1.weight", gate_up, "gate_up"))
    params.append(_Param(m + "mlp.linear_fc2.weight", ((h + "mlp.down_proj.weight", (hidden, ffn)),), "cols"))
    params.append(_Param(m + "input_layernorm.weight", ((h + "input_layernorm.weight", (hidden,)),), "copy"))
    post_norm = ((h + "post_attention_layernorm.weight", (hidden,)),)
    params.append(_Param(m + "pre_mlp_layernorm.weight", post_norm, "copy"))
    return params


def _qkv(prefix: str, what: str, q: int, kv: int, rest: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((f"{prefix}{p}_proj.{what}", (n, *rest)) for p, n in (("q", q), ("k", kv), ("v", kv)))


def _chunk_params(c: ModelConfig, *, pre: bool, post: bool, offset: int, num_layers: int) -> list[_Param]:
    """The parameters of one chunk (local layer i is global layer ``offset + i``), in HF state-dict order."""
    embed = ("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    params = [_Param("embedding.word_embeddings.weight", (embed,), "rows")] if pre else []
    for i in range(num_layers):
        params += _layer_params(c, i, offset + i)
    if post:
        params.append(_Param("decoder.final_layernorm.weight", (("model.norm.weight", (c.hidden_size,)),), "copy"))
        tied = c.share_embeddings_and_output_weights
        # Tied: a stage without the embedding keeps its own copy of it as output_layer.weight.
        if not (tied and pre):
            head = embed if tied else ("lm_head.weight", (c.vocab_size, c.hidden_size))
            params.append(_Param("output_layer.weight", (head,), "rows"))
    return params


def hf_weight_shapes(config: ModelConfig, *, include_tied: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the HF state dict, in the order :func:`export_weights` yields them (HF's, except that
    Qwen2's q/k/v biases come after the three weights).

    With tied embeddings, ``lm_head.weight`` (the embedding again) is included only with ``include_tied``, as in
    ``model.state_dict()``; ``save_pretrained`` files leave it out.
    """
    params = _chunk_params(config, pre=True, post=True, offset=0, num_layers=config.num_layers)
    shapes = {name: shape for p in params for name, shape in p.hf}
    if config.share_embeddings_and_output_weights and include_tied:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def _combine(p: _Param, parts: list[Tensor], c: ModelConfig, tp: int) -> Tensor:
    """This rank's shards of p's HF tensors -> its local Megatron tensor."""
    if p.kind == "qkv":
        groups, rest = c.effective_num_query_groups // tp, parts[0].shape[1:]
        # q [groups * heads_per_group * d, *rest], k and v [groups * d, *rest] -> per query group [q; k; v]
        per_group = [t.reshape(groups, -1, *rest) for t in parts]  # [groups, rows_per_group, *rest]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    if p.kind == "gate_up":
        return torch.cat(parts)  # [gate shard; up shard] on every rank
    return parts[0]


def _split_local(p: _Param, local: Tensor, c: ModelConfig, tp: int) -> list[Tensor]:
    """Inverse of :func:`_combine`: one rank's local tensor -> its shards of p's HF tensors."""
    if p.kind == "qkv":
        groups, d, rest = c.effective_num_query_groups // tp, c.effective_kv_channels, local.shape[1:]
        q_rows = c.num_attention_heads // c.effective_num_query_groups * d
        view = local.reshape(groups, q_rows + 2 * d, *rest)  # per query group [its q heads; k; v]
        return [t.reshape(-1, *rest) for t in view.split([q_rows, d, d], dim=1)]
    if p.kind == "gate_up":
        return list(local.chunk(2))
    return [local]


# ---------------------------------------------------------------------------------------------------- import
@dataclass(frozen=True)
class HFCheckpoint:
    """A local HF model directory: its config.json and which safetensors file holds each tensor."""

    path: Path
    """The directory."""
    config: dict[str, Any]
    """config.json as written."""
    files: dict[str, str]
    """Tensor name -> safetensors (or, opted in, PyTorch pickle) file name in ``path``."""

    @classmethod
    def open(cls, path: str | Path, allow_pickle: bool = False) -> HFCheckpoint:
        """Read config.json and the safetensors index (or the single file's header).

        Pickled ``.bin`` weights are refused unless ``allow_pickle=True``; even then they are read with
        ``torch.load(weights_only=True)``, which builds tensors and containers only, never arbitrary objects.
        """
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json")
        if (path / _INDEX).is_file():
            files = dict(json.loads((path / _INDEX).read_text())["weight_map"])
        elif (path / _SINGLE).is_file():
            with safe_open(path / _SINGLE, framework="pt") as f:
                files = dict.fromkeys(f.keys(), _SINGLE)
        else:
            pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            if pickles and allow_pickle:
                return cls(path=path, config=json.loads((path / "config.json").read_text()), files=pickled.files(path))
            if pickles:
                raise ValueError(
                    f"{path} holds PyTorch pickle weights ({', '.join(pickles[:3])}); only safetensors are read by "
                    "default (pickles are read whole on every rank and can run code when loaded). Convert once with "
                    "transformers: AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path), or pass "
                    "allow_pickle=True for a trusted directory (read with torch.load(weights_only=True))"
                )
            raise FileNotFoundError(f"{path} has no {_SINGLE} or {_INDEX}")
        return cls(path=path, config=json.loads((path / "config.json").read_text()), files=files)

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError unless the files hold exactly the tensors ``config`` needs, with the right shapes."""
        want = hf_weight_shapes(config, include_tied=False)
        missing = [name for name in want if name not in self.files]
        if missing:
            where = _INDEX if (self.path / _INDEX).is_file() else _SINGLE
            raise ValueError(
                f"{len(missing)} tensor(s) that {architecture(self.config)} with this config.json needs are missing "
                f"from {self.path / where}: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )
        # Tied checkpoints may still store lm_head; rotary caches are recomputed.
        extra = [n for n in self.files if n not in want and n != "lm_head.weight" and not n.endswith("inv_freq")]
        if extra:
            raise ValueError(
                f"{self.path} has tensors this config.json does not explain: {', '.join(sorted(extra)[:4])}; "
                "is config.json from another model?"
            )
        with self.lazy_tensors() as lazy:
            for name, expected in want.items():  # in model order: the first wrong tensor is the one reported
                if (shape := tuple(lazy(name).get_shape())) != expected:
                    where = self.path / self.files[name]
                    raise ValueError(f"{name} in {where} has shape {shape}, but config.json implies {expected}")

    @contextmanager
    def lazy_tensors(self) -> Iterator[Callable[[str], Any]]:
        """``lazy(name)``: a tensor's lazy safetensors slice (index it to read); each file is opened once."""
        with ExitStack() as stack:
            handles: dict[str, Any] = {}

            def lazy(name: str) -> Any:
                file = self.files[name]
                if file not in handles and file.endswith(pickled.SUFFIXES):
                    handles[file] = pickled.load(self.path / file)
                elif file not in handles:
                    handles[file] = stack.enter_context(safe_open(self.path / file, framework="pt"))
                if isinstance(handles[file], dict):
                    return pickled.Slice(handles[file][name])
                return handles[file].get_slice(name)

            yield lazy


def load_chunk(chunk: nn.Module, checkpoint: HFCheckpoint, config: ModelConfig, vp_stage: int | None) -> None:
    """Copy this rank's shard of the HF tensors into a freshly built ``GPTModel`` chunk (lazy slice reads)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    params = _chunk_params(
        config, pre=chunk.pre_process, post=chunk.post_process,
        offset=get_transformer_layer_offset(chunk.config, vp_stage), num_layers=len(chunk.decoder.layers),
    )  # fmt: skip
    own = dict(chunk.named_parameters())
    unmapped = sorted(set(own) - {p.megatron for p in params})
    if unmapped:  # a parameter left at its random init would silently break parity
        raise RuntimeError(f"no HF tensor maps to {unmapped}; the HF mapping does not cover this model")
    with checkpoint.lazy_tensors() as lazy, torch.no_grad():
        for p in params:
            local = _combine(p, [_read_shard(lazy(name), _SPLIT_DIM[p.kind], rank, tp) for name, _ in p.hf], config, tp)
            target = own[p.megatron]
            if local.shape != target.shape:
                raise ValueError(f"{[n for n, _ in p.hf]} make {p.megatron} {tuple(local.shape)}, not {target.shape}")
            target.copy_(local)


def _read_shard(lazy: Any, dim: int | None, rank: int, tp: int) -> Tensor:
    """Read only rank's contiguous 1/tp block along ``dim`` (all of it when ``dim`` is None)."""
    if dim is None:
        return lazy[:]
    size = lazy.get_shape()[dim] // tp
    block = slice(rank * size, (rank + 1) * size)
    return lazy[block] if dim == 0 else lazy[:, block]
