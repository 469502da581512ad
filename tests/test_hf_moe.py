"""Hugging Face mixture-of-experts models in and out: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4.5 and GPT-OSS
(tiny random models written with ``save_pretrained``; nothing is downloaded).

Against ``transformers`` in float32 with eager attention: logits, validation loss and log-probs at one process (in
this process), at EP=2, TP=2 and PP=2 (two 2-process worker runs); three training steps follow ``transformers`` +
``torch.optim.AdamW``; the export is the HF checkpoint, and a trained export loads in ``transformers`` with our logits.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, MegatronValueModule, ModelConfig
from lightning_megatron.gpt.hf.mapping import family, hf_weight_shapes
from tests.conftest import child_env, run_forked

SEQ = 16
BASE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
}  # fmt: skip
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # Layer 1 dense (mlp_only_layers), renormalised top-2 of 4 experts, q/k norms.
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 16}),
    # A gated shared expert, top-2 kept unrenormalised, q/k/v biases, tied embeddings.
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                                     "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # Multi-Latent Attention with a q latent, layer 0 dense, then 8 experts in 4 groups (top-4 of the best 2 groups),
    # one shared expert, the sigmoid router with its correction bias and scaling factor.
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
                                         "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                                         "norm_topk_prob": True, "q_lora_rank": 24, "kv_lora_rank": 32,
                                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                                         "num_key_value_heads": 4}),
    # GLM-4.5: the same MoE part on GQA attention with q/k/v biases, q/k norms and RoPE on half of each head.
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                   "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                   "routed_scaling_factor": 2.5, "norm_topk_prob": True, "head_dim": 16,
                                   "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True}),
    # GPT-OSS: q/k/v/o biases and sinks, a window of 4 then full attention, YaRN, biased router and experts.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                 "head_dim": 16, "sliding_window": 4, "swiglu_limit": 0.5,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 8}}),
}  # fmt: skip
FAMILY = {"qwen3_moe": "Qwen3MoE", "qwen2_moe": "Qwen2MoE", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3",
          "glm4_moe": "Glm4Moe", "gpt_oss": "GptOss"}  # fmt: skip
SIGMOID_ROUTER = ("deepseek_v3", "glm4_moe")  # the correction bias, which transformers' training leaves as loaded


def make_hf_model(arch: str, path: Path, **extra: Any) -> Path:
    config_name, overrides = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**BASE, **overrides, **extra})
    return save_randomised(config, path, sigmoid_router=arch in SIGMOID_ROUTER)


def save_randomised(config: Any, path: Path, sigmoid_router: bool = False) -> Path:
    """A random model of ``config`` (seed 0) written to ``path``, its norms, biases (GPT-OSS's experts' too) and
    buffers (the correction bias) randomised so that a wrong mapping shows; a sigmoid router's weights too (scores
    far from ties)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1 and biases at 0
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if (tensor.ndim == 1 or name.endswith("_proj_bias")) and "inv_freq" not in name:
                tensor.copy_(torch.randn_like(tensor) * 0.2 + (1.0 if "norm" in name else 0.0))
            elif name.endswith("mlp.gate.weight") and sigmoid_router:
                tensor.copy_(torch.randn_like(tensor))
    model.save_pretrained(path)
    return path


def hf_model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def hf_forward(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Logits, loss and the log-probability of each next token (HF's shift)."""
    with torch.no_grad():
        out = hf_model(path)(input_ids=tokens, labels=tokens)
    logprobs = torch.log_softmax(out.logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return out.logits, float(out.loss), logprobs


def train_both(path: Path, settings: dict[str, Any], overrides: dict[str, Any] | None = None) -> tuple:
    """Three steps of full fine-tuning from the HF checkpoint at ``path`` on the same 12 rows, 4 a step: transformers +
    ``torch.optim.AdamW(**settings)``, and ``from_hf`` under the strategy with the same settings (no clipping, no
    warm-up, constant LR; ``overrides``: ModelConfig fields). Each side's losses in step order, then the trained
    transformers model and module."""
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(3))
    want, model = hf_adamw_steps(path, samples, settings)
    module = MegatronLMModule.from_hf(path, seq_length=SEQ, clip_grad=0.0, warmup_steps=0, decay_style="constant",
                                      config_overrides=overrides, **settings)  # fmt: skip
    got: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            got.append(float(outputs["loss"]))

    trainer = _trainer(2, max_steps=3, callbacks=[Record()], use_distributed_sampler=False)
    trainer.fit(module, DataLoader(samples, batch_size=4))
    return want, got, model, module


def hf_adamw_steps(path: Path, samples: torch.Tensor, settings: dict[str, Any]) -> tuple[list[float], Any]:
    """transformers + ``torch.optim.AdamW(**settings)`` from the HF checkpoint at ``path``, one step per 4 rows of
    ``samples``: the losses in step order and the trained model."""
    model = hf_model(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), **settings)
    losses = []
    for batch in samples.split(4):
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    return losses, model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {arch: make_hf_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


def _trainer(micro_batch_size: int = 2, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=micro_batch_size), logger=False,
        enable_progress_bar=False, enable_model_summary=False, **{"enable_checkpointing": False, **kwargs},
    )  # fmt: skip


class Export(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}

    def on_predict_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        self.tensors = {name: t.clone() for name, t in module.export_hf_weights()}
        self.buckets = [pair for b in module.export_hf_weights(bucket_bytes=20_000) for pair in b]
        module.save_hf(self.path)


@pytest.fixture(scope="module")
def one_process(models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = {}
    for arch, path in models.items():
        module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = Export(tmp_path_factory.mktemp("saved") / arch)
        loader = DataLoader(tokens, batch_size=4)
        logits = torch.cat(_trainer(callbacks=[export]).predict(module, loader))
        val_loss = _trainer().validate(module, loader)[0]["val_loss"]
        module.prediction = "logprobs"
        logprobs = torch.cat([p["logprobs"] for p in _trainer().predict(module, loader)])
        results[arch] = {
            "logits": logits,
            "val_loss": val_loss,
            "logprobs": logprobs,
            "export": export,
            "module": module,
        }
    return results


def test_config_from_hf_maps_each_moe_architecture(models: dict[str, Path]) -> None:
    qwen3 = ModelConfig.from_hf(models["qwen3_moe"])
    assert (qwen3.num_moe_experts, qwen3.moe_router_topk, qwen3.moe_ffn_hidden_size) == (4, 2, 32)
    assert (qwen3.ffn_hidden_size, qwen3.moe_layer_freq, qwen3.moe_router_pre_softmax) == (96, (1, 0), False)
    assert qwen3.qk_layernorm
    assert not qwen3.add_qkv_bias
    qwen2 = ModelConfig.from_hf(models["qwen2_moe"])
    assert (qwen2.moe_shared_expert_intermediate_size, qwen2.moe_shared_expert_gate) == (48, True)
    assert qwen2.moe_router_pre_softmax
    assert qwen2.add_qkv_bias
    assert qwen2.moe_layer_freq == 1
    mixtral = ModelConfig.from_hf(models["mixtral"])
    assert (mixtral.num_moe_experts, mixtral.moe_ffn_hidden_size, mixtral.moe_router_pre_softmax) == (4, 32, False)
    for arch, path in models.items():
        assert type(family(ModelConfig.from_hf(path))).__name__ == FAMILY[arch]
        assert ModelConfig.from_hf(path).moe_aux_loss_coeff == 0.0  # HF adds it only with output_router_logits


def test_unsupported_hf_moe_settings_are_named(models: dict[str, Path]) -> None:
    config = json.loads((models["mixtral"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 is not supported"):
        ModelConfig.from_hf({**config, "router_jitter_noise": 0.1})
    aux = ModelConfig.from_hf({**config, "output_router_logits": True, "router_aux_loss_coef": 0.02})
    assert aux.moe_aux_loss_coeff == pytest.approx(0.02 * 2 / 2)  # x top-k / MoE layers: Megatron's per-layer loss
    qwen2 = json.loads((models["qwen2_moe"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=0 is not supported; a positive size"):
        ModelConfig.from_hf({**qwen2, "shared_expert_intermediate_size": 0})


def test_qwen_moe_configs_without_biases_or_with_sparse_steps_map(models: dict[str, Path]) -> None:
    """Qwen2-MoE's ``qkv_bias=False`` (no q/k/v biases, in and out) and ``decoder_sparse_step`` (every n-th layer
    MoE, transformers' rule: layer i is sparse iff (i + 1) % step == 0 and it is not in ``mlp_only_layers``)."""
    qwen2 = json.loads((models["qwen2_moe"] / "config.json").read_text())
    config = ModelConfig.from_hf({**qwen2, "qkv_bias": False})
    assert not config.add_qkv_bias
    adapter = family(config)
    assert type(adapter).__name__ == "Qwen2MoE"
    assert adapter.hf_config_kwargs(config)["qkv_bias"] is False
    assert not any(name.endswith("q_proj.bias") for name in hf_weight_shapes(config))
    qwen3 = json.loads((models["qwen3_moe"] / "config.json").read_text())
    four = {**qwen3, "num_hidden_layers": 4, "mlp_only_layers": []}
    assert ModelConfig.from_hf({**four, "decoder_sparse_step": 2}).moe_layer_freq == (0, 1, 0, 1)
    assert ModelConfig.from_hf({**four, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe_layer_freq == (
        0,
        1,
        0,
        0,
    )
    assert ModelConfig.from_hf({**four, "decoder_sparse_step": 1}).moe_layer_freq == 1


@pytest.mark.parametrize("arch", list(ARCHS))
def test_one_process_matches_transformers(arch: str, one_process: dict, models: dict, tokens: torch.Tensor) -> None:
    logits, loss, logprobs = hf_forward(models[arch], tokens)
    got = one_process[arch]
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(got["logprobs"][:, : SEQ - 1], logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_is_the_hf_checkpoint(arch: str, one_process: dict, models: dict, tokens: torch.Tensor) -> None:
    """Per-tensor and bucketed exports, save_hf and the family's to_hf/from_hf all give back the HF files."""
    original = load_file(models[arch] / "model.safetensors")
    export = one_process[arch]["export"]
    tied = {"lm_head.weight"} if arch == "qwen2_moe" else set()
    assert export.tensors.keys() - tied == original.keys()
    assert list(export.tensors) == list(hf_weight_shapes(one_process[arch]["module"].config))
    for name, tensor in original.items():
        assert torch.equal(export.tensors[name], tensor), name
    assert [n for n, _ in export.buckets] == list(export.tensors)
    written = load_file(export.path / "model.safetensors")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[n], t) for n, t in original.items())
    module = one_process[arch]["module"]
    chunk = module.chunks[0]
    params = {name: p.detach() for name, p in [*chunk.named_parameters(), *chunk.named_buffers()]}  # expert_bias
    adapter = family(module.config)
    assert all(torch.equal(t, params[n]) for n, t in adapter.from_hf(original, module.config).items())
    assert all(torch.equal(t, original[n]) for n, t in adapter.to_hf(params, module.config).items())


def test_a_moe_model_not_from_hf_is_written_in_its_family(tmp_path: Path, tokens: torch.Tensor) -> None:
    """A ModelConfig-built Qwen3-MoE-shaped model gets a generated config.json that transformers loads."""
    from lightning_megatron import tiny_gpt

    config = tiny_gpt(num_layers=2, vocab_size=128, num_query_groups=2, seq_length=SEQ, qk_layernorm=True,
                      num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1))  # fmt: skip
    export = Export(tmp_path / "out")
    logits = torch.cat(_trainer(callbacks=[export]).predict(MegatronLMModule(config), DataLoader(tokens, batch_size=4)))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["mlp_only_layers"]) == (["Qwen3MoeForCausalLM"], [0])
    torch.testing.assert_close(hf_forward(tmp_path / "out", tokens)[0], logits, rtol=1e-4, atol=1e-4)


AUX_COEF = 0.05
ONE_MOE_LAYER = {"qwen3_moe": {}, "qwen2_moe": {"mlp_only_layers": [1]}, "mixtral": {"num_hidden_layers": 1}}
"""Each family with one MoE layer, where Megatron's per-layer aux loss is HF's, pooled over the layers."""


@pytest.mark.parametrize(
    ("arch", "aux"),
    [(arch, aux) for arch in ARCHS for aux in (False, True) if arch in ONE_MOE_LAYER or not aux],  # HF: aux of some
    ids=lambda value: {False: "aux_off", True: "aux_on"}.get(value, value) if isinstance(value, bool) else value,
)
def test_training_follows_transformers_and_adamw(arch: str, aux: bool, models: dict, tmp_path: Path) -> None:
    """Three steps of full fine-tuning step for step: the aux loss off (HF without output_router_logits), and on
    with router_aux_loss_coef (each family with one MoE layer, where Megatron's per-layer loss is HF's pooled one).

    With the aux loss on, the batch is one micro-batch (Megatron's "aux_loss" is each micro-batch's, HF's the
    batch's), and Megatron normalises the routers' loss gradient by the loss tokens of the batch, as the
    language-model loss, having weighted it by the routed tokens: S / (S - 1) more than HF's (the last token of a
    row has no label), so HF runs with its coefficient times S / (S - 1). DeepSeek-V3 and GLM-4.5 (no aux loss in
    transformers) train with their correction bias fixed, as transformers' step leaves it
    (``moe_router_bias_update_rate=0``)."""
    path = models[arch]
    if aux:
        extra = {**ONE_MOE_LAYER[arch], "output_router_logits": True, "router_aux_loss_coef": AUX_COEF}
        path = make_hf_model(arch, tmp_path / arch, **extra)
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(3))
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    model = hf_model(path).train()
    if aux:
        model.router_aux_loss_coef = AUX_COEF * SEQ / (SEQ - 1)
    optimizer = torch.optim.AdamW(model.parameters(), **settings)
    want, want_aux = [], []
    for batch in samples.split(4):
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lm_loss = out.loss - (model.router_aux_loss_coef * out.aux_loss if aux else 0.0)
        want.append(float(lm_loss))
        want_aux.append(float(AUX_COEF * out.aux_loss) if aux else None)
    overrides = {"moe_router_bias_update_rate": 0.0} if arch in SIGMOID_ROUTER else None
    module = MegatronLMModule.from_hf(path, seq_length=SEQ, clip_grad=0.0, warmup_steps=0, decay_style="constant",
                                      config_overrides=overrides, **settings)  # fmt: skip
    assert module.config.moe_aux_loss_coeff == (AUX_COEF * 2 if aux else 0.0)  # x top-k / one MoE layer
    got, got_aux = [], []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            got.append(float(outputs["loss"]))
            aux_loss = trainer.callback_metrics.get("moe_aux_loss")
            got_aux.append(None if aux_loss is None else float(aux_loss))

    trainer = _trainer(4 if aux else 2, max_steps=3, callbacks=[Record()], use_distributed_sampler=False)
    trainer.fit(module, DataLoader(samples, batch_size=4))
    assert len(set(want)) == 3
    assert got == pytest.approx(want, rel=1e-4)
    assert got_aux == (pytest.approx(want_aux, rel=1e-4) if aux else want_aux)  # the logged coefficient x loss


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_value_module_on_an_moe_checkpoint(arch: str, models: dict, tokens: torch.Tensor) -> None:
    """The critic imports the MoE body (not its LM head): values = head(final hidden states of transformers)."""
    module = MegatronValueModule.from_hf(models[arch], seq_length=SEQ)
    values = torch.cat(_trainer().predict(module, DataLoader(tokens, batch_size=4)))
    assert values.shape == tokens.shape
    head = module.chunks[0].output_layer
    with torch.no_grad():
        hidden = hf_model(models[arch]).model(input_ids=tokens).last_hidden_state  # after the final norm
        want = (hidden @ head.weight.float().T + head.bias.float()).squeeze(-1)
    torch.testing.assert_close(values, want, rtol=1e-4, atol=1e-4)


ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}

# One 2-process run: each architecture at expert, tensor and pipeline parallelism (qwen3_moe's dense layer 1 on its own
# stage at PP=2, qwen2_moe's tied embeddings on both stages); the same HF checkpoints as the one-process tests.
LAYOUTS = {
    "qwen3_moe_ep2": {"arch": "qwen3_moe", "ep": 2}, "qwen3_moe_tp2": {"arch": "qwen3_moe", "tp": 2},
    "qwen3_moe_pp2": {"arch": "qwen3_moe", "pp": 2}, "qwen2_moe_ep2": {"arch": "qwen2_moe", "ep": 2},
    "qwen2_moe_pp2": {"arch": "qwen2_moe", "pp": 2}, "mixtral_tp2": {"arch": "mixtral", "tp": 2},
    "mixtral_ep2": {"arch": "mixtral", "ep": 2}, "deepseek_v3_ep2": {"arch": "deepseek_v3", "ep": 2},
    "deepseek_v3_tp2": {"arch": "deepseek_v3", "tp": 2}, "deepseek_v3_pp2": {"arch": "deepseek_v3", "pp": 2},
    "glm4_moe_ep2": {"arch": "glm4_moe", "ep": 2}, "glm4_moe_tp2": {"arch": "glm4_moe", "tp": 2},
    "glm4_moe_pp2": {"arch": "glm4_moe", "pp": 2}, "gpt_oss_ep2": {"arch": "gpt_oss", "ep": 2},
    "gpt_oss_tp2": {"arch": "gpt_oss", "tp": 2}, "gpt_oss_pp2": {"arch": "gpt_oss", "pp": 2},
    # Full training with the experts (and their biases) split over expert tensor parallelism, checkpointed at step 2
    "gpt_oss_tp2_sp_trained": {"arch": "gpt_oss", "tp": 2, "sp": True, "train_steps": 3, "grad_norms": True,
                               "ckpt": True},
    # LoRA on every linear: attention, the experts (one adapter per expert and projection), the shared expert
    "qwen2_moe_ep2_lora": {"arch": "qwen2_moe", "ep": 2, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0,
                                                                                    "seed": 3}, "peft": False},
    # LoRA on the experts split over expert-parallel ranks, exported as a PEFT adapter (no dense MLPs: PEFT can name
    # the experts' adapters apart)
    "mixtral_ep2_lora": {"arch": "mixtral", "ep": 2, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0, "seed": 5}},
    # LoRA on every linear with the experts split over expert tensor parallelism, checkpointed at step 2
    "mixtral_tp2_lora": {"arch": "mixtral", "tp": 2, "sp": True, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0,
                                                                                           "seed": 4}, "ckpt": True},
    # LoRA on GPT-OSS's experts (their biases frozen) split over expert tensor parallelism: fc1's B by rows, which
    # PEFT interleaves (gate, up, gate, ...)
    "gpt_oss_tp2_lora": {"arch": "gpt_oss", "tp": 2, "sp": True, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0,
                                                                                           "seed": 6}},
    # Full fine-tuning of MLA + MoE at TP=2 with SP, as transformers + AdamW (no clipping or warm-up, constant LR, the
    # correction bias fixed as transformers leaves it)
    "deepseek_v3_tp2_train": {"arch": "deepseek_v3", "tp": 2, "sp": True, "train_steps": 3, "sampler": False,
                              "overrides": {"moe_router_bias_update_rate": 0.0},
                              "optim": {**ADAMW, "clip_grad": 0.0, "decay_style": "constant"}},
}  # fmt: skip


@pytest.fixture(scope="module")
def layouts(models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_moe_layouts")
    torch.save(tokens, tmp / "tokens.pt")
    torch.save([], tmp / "packed.pt")
    jobs = [{**job, "model": str(models[job["arch"]]), "logprobs": True, "save": str(tmp / f"saved-{name}"),
             "ckpt": str(tmp / f"ckpt-{name}") if job.get("ckpt") else None}
            for name, job in LAYOUTS.items()]  # fmt: skip
    outs = [tmp / "result0", tmp / "result1"]  # job i: in run i % 2 (of two side by side), its (i // 2)-th
    runs = [{"devices": 2, "tokens": str(tmp / "tokens.pt"), "packed": str(tmp / "packed.pt"), "out": str(out),
             "jobs": jobs[half::2]} for half, out in enumerate(outs)]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each run's ranks wait on each other: both cores busy
        list(pool.map(lambda args: run_forked("hf_worker:main", args, 2, tmp, child_env(CUDA_VISIBLE_DEVICES=""),
                                              expect=Path(f"{args['out']}.rank1.json")), runs))  # fmt: skip
    ranks = [[json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)] for out in outs]
    logits = [[torch.load(f"{outs[i % 2]}.job{i // 2}.rank{r}.pt") for r in range(2)] for i in range(len(LAYOUTS))]
    return {name: {"ranks": [ranks[i % 2][r][i // 2] for r in range(2)], "logits": logits[i],
                   "save": Path(jobs[i]["save"]), "ckpt": jobs[i]["ckpt"]}
            for i, name in enumerate(LAYOUTS)}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name, job in LAYOUTS.items() if "train_steps" not in job])
def test_layouts_match_transformers(name: str, layouts: dict, models: dict, tokens: torch.Tensor) -> None:
    """Validation loss, logits and log-probs equal transformers' on every rank, and the export (experts gathered
    from their expert-parallel ranks, shards from their tensor-parallel ones) is the HF checkpoint."""
    job = LAYOUTS[name]
    arch, data_parallel = job["arch"], 2 // (job.get("tp", 1) * job.get("pp", 1))
    logits, loss, logprobs = hf_forward(models[arch], tokens)
    shapes = {n: list(t.shape) for n, t in load_file(models[arch] / "model.safetensors").items()}
    for rank, result in enumerate(layouts[name]["ranks"]):
        rows = slice(rank % data_parallel, None, data_parallel)  # the distributed sampler's rows of this DP rank
        assert result["val_loss"] == pytest.approx(loss, rel=1e-5), rank
        torch.testing.assert_close(layouts[name]["logits"][rank], logits[rows], rtol=1e-4, atol=1e-4)
        got = torch.tensor(result["logprobs"])[:, : SEQ - 1]
        torch.testing.assert_close(got, logprobs[rows], rtol=1e-4, atol=1e-5)
        tied = {"lm_head.weight"} if arch == "qwen2_moe" else set()
        assert {n: s for n, s in result["export_shapes"].items() if n not in tied} == shapes
        assert result["export_max_diff"] == 0.0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_recorded_routing_is_what_transformers_chooses(arch: str, models: dict, tokens: torch.Tensor) -> None:
    """Routing replay records, per MoE layer and token, the experts the HF model routes to on the same weights."""
    overrides = {"moe_enable_routing_replay": True}
    module = MegatronLMModule.from_hf(models[arch], seq_length=SEQ, config_overrides=overrides)
    recorded: list[torch.Tensor] = []

    class Record(L.Callback):
        def on_validation_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            recorded.append(pl_module.record_routing(tokens))

    _trainer(callbacks=[Record()]).validate(module, DataLoader(tokens, batch_size=4))
    chosen = hf_routing(hf_model(models[arch]), tokens, module.config.moe_router_topk)
    sparse = [i for i, moe in enumerate(module.config.moe_layers) if moe]
    assert len(chosen) == len(sparse) > 0
    for layer, want in zip(sparse, chosen, strict=True):
        assert torch.equal(recorded[0][:, layer].sort(dim=-1).values, want), layer


def hf_routing(model: Any, tokens: torch.Tensor, topk: int) -> list[torch.Tensor]:
    """The experts transformers routes each token to, per MoE layer, sorted: [B, S, top-k]. Routers that return
    their choice (DeepSeek-V3's sigmoid + correction bias + groups) are read; softmax routers' top-k logits taken."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: picked.append(out[2])) for r in routers]
    with torch.no_grad():
        router_logits = model(input_ids=tokens, output_router_logits=not routers).router_logits
    for hook in hooks:
        hook.remove()
    chosen = picked or [logits.topk(topk, dim=-1).indices for logits in router_logits]  # [B * S, top-k] per layer
    return [c.sort(dim=-1).values.view(tokens.shape[0], SEQ, topk) for c in chosen]


def _trained_as_one_process(layout: dict, one: dict, one_logits: torch.Tensor, data_parallel: int) -> None:
    """Every rank of a two-process LoRA layout trained as ``one`` process did: the same three distinct losses and
    validation loss, only the adapters trainable, and its data-parallel rank's rows of the logits."""
    assert len(set(one["train_losses"])) == 3
    for rank, result in enumerate(layout["ranks"]):
        assert result["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5), rank
        assert result["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), rank
        assert result["trainable"] == ["lora_A", "lora_B"]
        rows = slice(rank % data_parallel, None, data_parallel)  # DP=1: every row
        torch.testing.assert_close(layout["logits"][rank], one_logits[rows], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
def test_mla_moe_trains_at_tp2_with_sp_as_transformers_and_adamw(layouts: dict, models: dict,
                                                                tokens: torch.Tensor) -> None:  # fmt: skip
    """DeepSeek-V3 (MLA with a query latent, a dense layer, experts with a shared one) trains three steps at TP=2 with
    sequence parallelism as transformers + AdamW does, and its validation loss after them is the trained HF model's:
    every head's share of the RoPE key's gradient counts, not only the heads of the rank holding its columns."""
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(0))  # hf_worker's rows
    want, model = hf_adamw_steps(models["deepseek_v3"], samples, ADAMW)
    with torch.no_grad():
        trained_loss = float(model.eval()(input_ids=tokens, labels=tokens).loss)
    assert len(set(want)) == 3
    for rank, result in enumerate(layouts["deepseek_v3_tp2_train"]["ranks"]):
        assert result["train_losses"] == pytest.approx(want, rel=1e-4), rank
        assert result["val_loss"] == pytest.approx(trained_loss, rel=1e-4), rank


@pytest.mark.multiprocess
def test_lora_on_experts_at_ep2_equals_one_process(layouts: dict, models: dict, tokens: torch.Tensor,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """LoRA on every linear of an MoE model, experts split over two ranks, trains as one process does; only the
    adapters change; the merged export loads in transformers with the trained model's logits."""
    import hf_worker

    # One process takes both ranks' batches at once: the same global batches (Lightning's sampler deals the same
    # shuffled order to one rank in batches of 8 as to two in batches of 4).
    job = {**LAYOUTS["qwen2_moe_ep2_lora"], "ep": 1, "batch_size": 8, "model": str(models["qwen2_moe"]),
           "save": str(tmp_path / "one")}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, tokens, [])
    ep2 = layouts["qwen2_moe_ep2_lora"]
    _trained_as_one_process(ep2, one, one_logits, data_parallel=2)
    merged = hf_forward(ep2["save"], tokens)[0]  # the adapters merged into the experts' and the others' weights
    torch.testing.assert_close(merged, one_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, hf_forward(models["qwen2_moe"], tokens)[0], atol=1e-3)  # the adapters moved
    assert all(result["buckets"]["equal"] for result in ep2["ranks"])  # bucketed = per tensor, experts gathered


@pytest.mark.multiprocess
def test_a_peft_adapter_of_experts_at_ep2_gives_the_merged_logits(layouts: dict, models: dict,
                                                                  tokens: torch.Tensor) -> None:  # fmt: skip
    """Expert adapters trained with the experts split over two ranks: the PEFT adapter (each expert's pieces joined
    from its rank) on the untouched HF base gives the logits of the merged export, as do the bucketed exports."""
    import peft

    ep2 = layouts["mixtral_ep2_lora"]
    merged = hf_forward(ep2["save"], tokens)[0]
    for rank, rank_logits in enumerate(ep2["logits"]):  # EP=2 with DP=2: each rank predicts its sampler's rows
        torch.testing.assert_close(rank_logits, merged[rank::2], rtol=1e-4, atol=1e-4)
    adapter = load_file(Path(f"{ep2['save']}-adapter") / "adapter_model.safetensors")
    assert any("experts.base_layer.lora_B" in name for name in adapter)  # the experts' fused gate_up adapters
    base = hf_model(models["mixtral"])
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, f"{ep2['save']}-adapter").eval()(input_ids=tokens).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, hf_forward(models["mixtral"], tokens)[0], atol=1e-3)  # the adapters moved
    assert all(result["buckets"]["equal"] for result in ep2["ranks"])


@pytest.mark.multiprocess
def test_lora_on_experts_at_tp2_equals_one_process(layouts: dict, models: dict, tokens: torch.Tensor,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """LoRA on every linear of an MoE model, the experts split over expert tensor parallelism (TP=2 with SP: fc1's B
    split by rows, [gate; up] half by half, fc2's A by columns), trains as one process does; the merged export and
    the PEFT adapter equal one process's; its checkpoint at step 2 resumes at TP=1 to the same step 3."""
    import hf_worker

    job = {**LAYOUTS["mixtral_tp2_lora"], "tp": 1, "sp": False, "model": str(models["mixtral"]),
           "save": str(tmp_path / "one"), "ckpt": None}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, tokens, [])
    tp2 = layouts["mixtral_tp2_lora"]
    _trained_as_one_process(tp2, one, one_logits, data_parallel=1)
    assert all(result["buckets"]["equal"] for result in tp2["ranks"])  # bucketed = per tensor, gathered over TP
    torch.testing.assert_close(hf_forward(tp2["save"], tokens)[0], one_logits, rtol=1e-4, atol=1e-4)  # merged
    ours, theirs = (
        load_file(Path(f"{path}-adapter") / "adapter_model.safetensors") for path in (tp2["save"], job["save"])
    )
    assert ours.keys() == theirs.keys()
    assert any("experts.base_layer.lora_B" in name for name in ours)  # the experts' fused gate_up adapters
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    resumed, _ = hf_worker.run_job(1, {**job, "resume": str(Path(tp2["ckpt"]) / "epoch=0-step=2.ckpt"),
                                       "save": str(tmp_path / "resumed")}, tokens, [])  # fmt: skip
    assert resumed["train_losses"] == pytest.approx(one["train_losses"][2:], rel=1e-5)


@pytest.mark.multiprocess
def test_lora_on_gpt_oss_experts_at_tp2_equals_one_process(layouts: dict, models: dict, tokens: torch.Tensor,
                                                           tmp_path: Path) -> None:  # fmt: skip
    """LoRA on GPT-OSS (experts with biases, the clamped GLU, HF's interleaved gate/up columns) at TP=2 with SP: trains
    as one process does; the merged export and the PEFT adapter (fc1's B gathered over TP, then interleaved) equal
    one process's, and the merged export gives the logits in transformers."""
    import hf_worker

    job = {**LAYOUTS["gpt_oss_tp2_lora"], "tp": 1, "sp": False, "model": str(models["gpt_oss"]),
           "save": str(tmp_path / "one")}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, tokens, [])
    tp2 = layouts["gpt_oss_tp2_lora"]
    _trained_as_one_process(tp2, one, one_logits, data_parallel=1)
    torch.testing.assert_close(hf_forward(tp2["save"], tokens)[0], one_logits, rtol=1e-4, atol=1e-4)  # merged
    ours, theirs = (
        load_file(Path(f"{path}-adapter") / "adapter_model.safetensors") for path in (tp2["save"], job["save"])
    )
    assert ours.keys() == theirs.keys()
    assert any("experts.base_layer.lora_B" in name for name in ours)  # the experts' gate_up_proj adapters
    # fc1's A gets its gradient summed over TP in another order; where an element's gradient is near 0, AdamW's
    # step (lr 1e-2) turns that rounding into ~1e-5: 1e-4 (a missing or doubled gradient is off by ~1e-2).
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.multiprocess
def test_gpt_oss_trains_at_tp2_sp_as_one_process(layouts: dict, models: dict, tokens: torch.Tensor,
                                                 tmp_path: Path) -> None:  # fmt: skip
    """GPT-OSS fully trained at TP=2 with SP -- the experts split over expert tensor parallelism: fc1's bias split
    like its rows (gate and up halves), fc2's whole on each rank and added once; the sinks split by heads -- follows
    one process: the losses, every parameter's gradient norm at every step on every rank (a replicated one's from
    that rank's copy: fc2's bias gets its gradient on both ranks), the validation loss and logits, which the trained
    export gives in transformers; its checkpoint at step 2 resumes at TP=1 to the same step 3."""
    import hf_worker

    job = {**LAYOUTS["gpt_oss_tp2_sp_trained"], "tp": 1, "sp": False, "model": str(models["gpt_oss"]),
           "save": str(tmp_path / "one"), "ckpt": None}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, tokens, [])
    tp2 = layouts["gpt_oss_tp2_sp_trained"]
    assert len(set(one["train_losses"])) == 3
    biases = {name.rsplit("mlp.")[-1] for name in one["grad_norms"][0]}
    assert {"experts.linear_fc1.bias", "experts.linear_fc2.bias"} <= biases  # the expert biases' norms are compared
    for rank, result in enumerate(tp2["ranks"]):
        assert result["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5), rank
        assert result["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), rank
        assert len(result["grad_norms"]) == 3
        # Summed in another order, and AdamW moves small gradients by the full step: 1e-3 (a gradient missing on a
        # rank, or counted twice, is off by 100%).
        for got, want in zip(result["grad_norms"], one["grad_norms"], strict=True):
            assert got == pytest.approx(want, rel=1e-3), rank
        torch.testing.assert_close(tp2["logits"][rank], one_logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(hf_forward(tp2["save"], tokens)[0], one_logits, rtol=1e-3, atol=1e-3)  # the export
    resumed, _ = hf_worker.run_job(1, {**job, "resume": str(Path(tp2["ckpt"]) / "epoch=0-step=2.ckpt"),
                                       "save": str(tmp_path / "resumed")}, tokens, [])  # fmt: skip
    assert resumed["train_losses"] == pytest.approx(one["train_losses"][2:], rel=1e-5)


def test_expert_adapter_checkpoints_hold_the_adapters_and_resume_exactly(models: dict, tmp_path: Path) -> None:
    """An MoE model from HF with LoRA on its experts: the checkpoint holds the adapters (per expert, on the global
    expert axis) and their optimizer state, not the frozen experts; resuming continues the curve exactly."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from megatron.core.dist_checkpointing import load_tensors_metadata

    samples = torch.randint(0, 128, (4 * 4, SEQ), generator=torch.Generator().manual_seed(6))
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["linear_fc1", "linear_fc2"]}

    def fit(root: Path, ckpt_path: str | None = None) -> dict[int, float]:
        losses: dict[int, float] = {}

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
                losses[trainer.global_step] = float(outputs["loss"])

        module = MegatronLMModule.from_hf(models["mixtral"], seq_length=SEQ, lr=5e-2, lora=lora)
        saver = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
        trainer = _trainer(max_steps=4, callbacks=[Record(), saver], enable_checkpointing=True)
        trainer.fit(module, DataLoader(samples, batch_size=4), ckpt_path=ckpt_path)
        return losses

    full = fit(tmp_path / "run")
    assert len(set(full.values())) == 4
    checkpoint = tmp_path / "run" / "epoch=0-step=2.ckpt"
    keys = load_tensors_metadata(checkpoint).keys()
    experts = sorted(k for k in keys if "experts" in k and "optimizer" not in k)
    assert experts == ["decoder.layers.mlp.experts.experts.linear_fc1.lora_A.gate_up_proj",
                       "decoder.layers.mlp.experts.experts.linear_fc1.lora_B.gate_up_proj",
                       "decoder.layers.mlp.experts.experts.linear_fc2.lora_A.down_proj",
                       "decoder.layers.mlp.experts.experts.linear_fc2.lora_B.down_proj"]  # fmt: skip
    assert load_tensors_metadata(checkpoint)[experts[0]].global_shape == (2, 4, 4, 64)  # layers, experts, rank, hidden
    resumed = fit(tmp_path / "again", ckpt_path=str(checkpoint))
    assert resumed == {step: full[step] for step in (3, 4)}


def test_expert_adapters_go_to_peft_and_back(models: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """Trained adapters on every linear of an MoE model with a shared expert written as a PEFT adapter (attention's as
    target_modules; each expert's on HF's fused experts and the shared expert's by their path as target_parameters,
    since PEFT reads an MoE model's gate_proj/up_proj/down_proj targets as its experts') give our logits in PEFT, and
    load back here; an adapter of the experts without the shared expert is refused by name."""
    import peft

    arch, lora = "qwen2_moe", {"rank": 4, "alpha": 8.0, "seed": 1}
    module = MegatronLMModule.from_hf(models[arch], seq_length=SEQ, lr=5e-2, lora=lora)
    samples = torch.randint(0, 128, (8, SEQ), generator=torch.Generator().manual_seed(8))

    class Save(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            pl_module.save_hf(tmp_path / "adapter", adapter=True)

    _trainer(max_steps=2, callbacks=[Save()]).fit(module, DataLoader(samples, batch_size=4))
    loader = DataLoader(tokens, batch_size=4)
    ours = torch.cat(_trainer().predict(module, loader))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    shared = [f"mlp.shared_expert.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *shared]
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(models[arch]), tmp_path / "adapter")(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, hf_forward(models[arch], tokens)[0], atol=1e-3)  # the adapters moved the logits
    back = MegatronLMModule.from_hf(models[arch], seq_length=SEQ, adapter=tmp_path / "adapter")
    assert back.lora.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    torch.testing.assert_close(torch.cat(_trainer().predict(back, loader)), ours, rtol=1e-5, atol=1e-5)

    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": [
        "gate_up_proj", "down_proj", "shared_expert.gate_proj.weight", "down_proj.weight"]}))  # fmt: skip
    with pytest.raises(ValueError, match=r"leave out \['mlp.shared_expert.up_proj.weight'\]: LoRA here adapts"):
        MegatronLMModule.from_hf(models[arch], seq_length=SEQ, adapter=tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["weight"]}))
    with pytest.raises(ValueError, match=r"\['weight'\]; only a list of an MoE model's MLP projections"):
        MegatronLMModule.from_hf(models[arch], seq_length=SEQ, adapter=tmp_path / "adapter")


def test_dropout_on_moe_mlp_adapters_has_no_peft_form(models: dict, tmp_path: Path) -> None:
    """PEFT's adapters on parameters (an MoE model's MLP adapters) take no dropout: such a PEFT export is refused."""
    module = MegatronLMModule.from_hf(models["qwen3_moe"], seq_length=SEQ, lora={"rank": 4, "dropout": 0.1})

    class Save(L.Callback):
        def on_predict_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            pl_module.save_hf(tmp_path / "adapter", adapter=True)

    with pytest.raises(ValueError, match=r"dropout=0.1\) on an MoE model's MLPs.*take no dropout.*save_hf\(path\)"):
        _trainer(callbacks=[Save()]).predict(module, DataLoader(torch.zeros(4, SEQ, dtype=torch.long), batch_size=4))
