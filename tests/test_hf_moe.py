"""Hugging Face mixture-of-experts models in and out at one process: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3,
GLM-4.5 and GPT-OSS (the tiny random models of ``tests/hf_moe_models.py``; nothing is downloaded).

Against ``transformers`` in float32 with eager attention: logits, validation loss and log-probs (in this process);
three training steps follow ``transformers`` + ``torch.optim.AdamW``; the export is the HF checkpoint; routing replay
records the experts transformers chooses; expert adapters checkpoint, resume and go to PEFT and back. The same
models at EP=2, TP=2 and PP=2: ``tests/test_hf_moe_layouts.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronValueModule, ModelConfig
from lightning_megatron.gpt.hf.mapping import family, hf_weight_shapes
from tests.hf_moe_models import (
    ARCHS,
    FAMILY,
    SEQ,
    SIGMOID_ROUTER,
    Export,
    cpu_trainer,
    hf_forward,
    hf_model,
    make_hf_model,
)


@pytest.fixture(scope="module")
def one_process(moe_models: dict[str, Path], hf_tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = {}
    for arch, path in moe_models.items():
        module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = Export(tmp_path_factory.mktemp("saved") / arch)
        loader = DataLoader(hf_tokens, batch_size=4)
        logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
        val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
        module.prediction = "logprobs"
        logprobs = torch.cat([p["logprobs"] for p in cpu_trainer().predict(module, loader)])
        results[arch] = {
            "logits": logits,
            "val_loss": val_loss,
            "logprobs": logprobs,
            "export": export,
            "module": module,
        }
    return results


def test_config_from_hf_maps_each_moe_architecture(moe_models: dict[str, Path]) -> None:
    qwen3 = ModelConfig.from_hf(moe_models["qwen3_moe"])
    assert (qwen3.num_moe_experts, qwen3.moe_router_topk, qwen3.moe_ffn_hidden_size) == (4, 2, 32)
    assert (qwen3.ffn_hidden_size, qwen3.moe_layer_freq, qwen3.moe_router_pre_softmax) == (96, (1, 0), False)
    assert qwen3.qk_layernorm
    assert not qwen3.add_qkv_bias
    qwen2 = ModelConfig.from_hf(moe_models["qwen2_moe"])
    assert (qwen2.moe_shared_expert_intermediate_size, qwen2.moe_shared_expert_gate) == (48, True)
    assert qwen2.moe_router_pre_softmax
    assert qwen2.add_qkv_bias
    assert qwen2.moe_layer_freq == 1
    mixtral = ModelConfig.from_hf(moe_models["mixtral"])
    assert (mixtral.num_moe_experts, mixtral.moe_ffn_hidden_size, mixtral.moe_router_pre_softmax) == (4, 32, False)
    for arch, path in moe_models.items():
        assert type(family(ModelConfig.from_hf(path))).__name__ == FAMILY[arch]
        assert ModelConfig.from_hf(path).moe_aux_loss_coeff == 0.0  # HF adds it only with output_router_logits


def test_unsupported_hf_moe_settings_are_named(moe_models: dict[str, Path]) -> None:
    config = json.loads((moe_models["mixtral"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 is not supported"):
        ModelConfig.from_hf({**config, "router_jitter_noise": 0.1})
    aux = ModelConfig.from_hf({**config, "output_router_logits": True, "router_aux_loss_coef": 0.02})
    assert aux.moe_aux_loss_coeff == pytest.approx(0.02 * 2 / 2)  # x top-k / MoE layers: Megatron's per-layer loss
    qwen2 = json.loads((moe_models["qwen2_moe"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=0 is not supported; a positive size"):
        ModelConfig.from_hf({**qwen2, "shared_expert_intermediate_size": 0})


def test_qwen_moe_configs_without_biases_or_with_sparse_steps_map(moe_models: dict[str, Path]) -> None:
    """Qwen2-MoE's ``qkv_bias=False`` (no q/k/v biases, in and out) and ``decoder_sparse_step`` (every n-th layer
    MoE, transformers' rule: layer i is sparse iff (i + 1) % step == 0 and it is not in ``mlp_only_layers``)."""
    qwen2 = json.loads((moe_models["qwen2_moe"] / "config.json").read_text())
    config = ModelConfig.from_hf({**qwen2, "qkv_bias": False})
    assert not config.add_qkv_bias
    adapter = family(config)
    assert type(adapter).__name__ == "Qwen2MoE"
    assert adapter.hf_config_kwargs(config)["qkv_bias"] is False
    assert not any(name.endswith("q_proj.bias") for name in hf_weight_shapes(config))
    qwen3 = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
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
def test_one_process_matches_transformers(
    arch: str, one_process: dict, moe_models: dict, hf_tokens: torch.Tensor
) -> None:
    logits, loss, logprobs = hf_forward(moe_models[arch], hf_tokens)
    got = one_process[arch]
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(got["logprobs"][:, : SEQ - 1], logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_is_the_hf_checkpoint(arch: str, one_process: dict, moe_models: dict, hf_tokens: torch.Tensor) -> None:
    """Per-tensor and bucketed exports, save_hf and the family's to_hf/from_hf all give back the HF files."""
    original = load_file(moe_models[arch] / "model.safetensors")
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


def test_a_moe_model_not_from_hf_is_written_in_its_family(tmp_path: Path, hf_tokens: torch.Tensor) -> None:
    """A ModelConfig-built Qwen3-MoE-shaped model gets a generated config.json that transformers loads."""
    from lightning_megatron import tiny_gpt

    config = tiny_gpt(num_layers=2, vocab_size=128, num_query_groups=2, seq_length=SEQ, qk_layernorm=True,
                      num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1))  # fmt: skip
    export = Export(tmp_path / "out")
    loader = DataLoader(hf_tokens, batch_size=4)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(MegatronLMModule(config), loader))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["mlp_only_layers"]) == (["Qwen3MoeForCausalLM"], [0])
    torch.testing.assert_close(hf_forward(tmp_path / "out", hf_tokens)[0], logits, rtol=1e-4, atol=1e-4)


AUX_COEF = 0.05
ONE_MOE_LAYER = {"qwen3_moe": {}, "qwen2_moe": {"mlp_only_layers": [1]}, "mixtral": {"num_hidden_layers": 1}}
"""Each family with one MoE layer, where Megatron's per-layer aux loss is HF's, pooled over the layers."""


@pytest.mark.parametrize(
    ("arch", "aux"),
    [(arch, aux) for arch in ARCHS for aux in (False, True) if arch in ONE_MOE_LAYER or not aux],  # HF: aux of some
    ids=lambda value: {False: "aux_off", True: "aux_on"}.get(value, value) if isinstance(value, bool) else value,
)
def test_training_follows_transformers_and_adamw(arch: str, aux: bool, moe_models: dict, tmp_path: Path) -> None:
    """Three steps of full fine-tuning step for step: the aux loss off (HF without output_router_logits), and on
    with router_aux_loss_coef (each family with one MoE layer, where Megatron's per-layer loss is HF's pooled one).

    With the aux loss on, the batch is one micro-batch (Megatron's "aux_loss" is each micro-batch's, HF's the
    batch's), and Megatron normalises the routers' loss gradient by the loss tokens of the batch, as the
    language-model loss, having weighted it by the routed tokens: S / (S - 1) more than HF's (the last token of a
    row has no label), so HF runs with its coefficient times S / (S - 1). DeepSeek-V3 and GLM-4.5 (no aux loss in
    transformers) train with their correction bias fixed, as transformers' step leaves it
    (``moe_router_bias_update_rate=0``)."""
    path = moe_models[arch]
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

    trainer = cpu_trainer(4 if aux else 2, max_steps=3, callbacks=[Record()], use_distributed_sampler=False)
    trainer.fit(module, DataLoader(samples, batch_size=4))
    assert len(set(want)) == 3
    assert got == pytest.approx(want, rel=1e-4)
    assert got_aux == (pytest.approx(want_aux, rel=1e-4) if aux else want_aux)  # the logged coefficient x loss


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_value_module_on_an_moe_checkpoint(arch: str, moe_models: dict, hf_tokens: torch.Tensor) -> None:
    """The critic imports the MoE body (not its LM head): values = head(final hidden states of transformers)."""
    module = MegatronValueModule.from_hf(moe_models[arch], seq_length=SEQ)
    values = torch.cat(cpu_trainer().predict(module, DataLoader(hf_tokens, batch_size=4)))
    assert values.shape == hf_tokens.shape
    head = module.chunks[0].output_layer
    with torch.no_grad():
        hidden = hf_model(moe_models[arch]).model(input_ids=hf_tokens).last_hidden_state  # after the final norm
        want = (hidden @ head.weight.float().T + head.bias.float()).squeeze(-1)
    torch.testing.assert_close(values, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_recorded_routing_is_what_transformers_chooses(arch: str, moe_models: dict, hf_tokens: torch.Tensor) -> None:
    """Routing replay records, per MoE layer and token, the experts the HF model routes to on the same weights."""
    overrides = {"moe_enable_routing_replay": True}
    module = MegatronLMModule.from_hf(moe_models[arch], seq_length=SEQ, config_overrides=overrides)
    recorded: list[torch.Tensor] = []

    class Record(L.Callback):
        def on_validation_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            recorded.append(pl_module.record_routing(hf_tokens))

    cpu_trainer(callbacks=[Record()]).validate(module, DataLoader(hf_tokens, batch_size=4))
    chosen = hf_routing(hf_model(moe_models[arch]), hf_tokens, module.config.moe_router_topk)
    sparse = [i for i, moe in enumerate(module.config.moe_layers) if moe]
    assert len(chosen) == len(sparse) > 0
    for layer, want in zip(sparse, chosen, strict=True):
        assert torch.equal(recorded[0][:, layer].sort(dim=-1).values, want), layer


def hf_routing(model: Any, hf_tokens: torch.Tensor, topk: int) -> list[torch.Tensor]:
    """The experts transformers routes each token to, per MoE layer, sorted: [B, S, top-k]. Routers that return
    their choice (DeepSeek-V3's sigmoid + correction bias + groups) are read; softmax routers' top-k logits taken."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: picked.append(out[2])) for r in routers]
    with torch.no_grad():
        router_logits = model(input_ids=hf_tokens, output_router_logits=not routers).router_logits
    for hook in hooks:
        hook.remove()
    chosen = picked or [logits.topk(topk, dim=-1).indices for logits in router_logits]  # [B * S, top-k] per layer
    return [c.sort(dim=-1).values.view(hf_tokens.shape[0], SEQ, topk) for c in chosen]


def test_expert_adapter_checkpoints_hold_the_adapters_and_resume_exactly(moe_models: dict, tmp_path: Path) -> None:
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

        module = MegatronLMModule.from_hf(moe_models["mixtral"], seq_length=SEQ, lr=5e-2, lora=lora)
        saver = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
        trainer = cpu_trainer(max_steps=4, callbacks=[Record(), saver], enable_checkpointing=True)
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


def test_expert_adapters_go_to_peft_and_back(moe_models: dict, hf_tokens: torch.Tensor, tmp_path: Path) -> None:
    """Trained adapters on every linear of an MoE model with a shared expert written as a PEFT adapter (attention's as
    target_modules; each expert's on HF's fused experts and the shared expert's by their path as target_parameters,
    since PEFT reads an MoE model's gate_proj/up_proj/down_proj targets as its experts') give our logits in PEFT, and
    load back here; an adapter of the experts without the shared expert is refused by name."""
    import peft

    arch, lora = "qwen2_moe", {"rank": 4, "alpha": 8.0, "seed": 1}
    module = MegatronLMModule.from_hf(moe_models[arch], seq_length=SEQ, lr=5e-2, lora=lora)
    samples = torch.randint(0, 128, (8, SEQ), generator=torch.Generator().manual_seed(8))

    class Save(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            pl_module.save_hf(tmp_path / "adapter", adapter=True)

    cpu_trainer(max_steps=2, callbacks=[Save()]).fit(module, DataLoader(samples, batch_size=4))
    loader = DataLoader(hf_tokens, batch_size=4)
    ours = torch.cat(cpu_trainer().predict(module, loader))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    shared = [f"mlp.shared_expert.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *shared]
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    base = hf_model(moe_models[arch])
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=hf_tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, hf_forward(moe_models[arch], hf_tokens)[0], atol=1e-3)  # the adapters moved them
    back = MegatronLMModule.from_hf(moe_models[arch], seq_length=SEQ, adapter=tmp_path / "adapter")
    assert back.lora.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    torch.testing.assert_close(torch.cat(cpu_trainer().predict(back, loader)), ours, rtol=1e-5, atol=1e-5)

    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": [
        "gate_up_proj", "down_proj", "shared_expert.gate_proj.weight", "down_proj.weight"]}))  # fmt: skip
    with pytest.raises(ValueError, match=r"leave out \['mlp.shared_expert.up_proj.weight'\]: LoRA here adapts"):
        MegatronLMModule.from_hf(moe_models[arch], seq_length=SEQ, adapter=tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["weight"]}))
    with pytest.raises(ValueError, match=r"\['weight'\]; only a list of an MoE model's MLP projections"):
        MegatronLMModule.from_hf(moe_models[arch], seq_length=SEQ, adapter=tmp_path / "adapter")


def test_dropout_on_moe_mlp_adapters_has_no_peft_form(moe_models: dict, tmp_path: Path) -> None:
    """PEFT's adapters on parameters (an MoE model's MLP adapters) take no dropout: such a PEFT export is refused."""
    module = MegatronLMModule.from_hf(moe_models["qwen3_moe"], seq_length=SEQ, lora={"rank": 4, "dropout": 0.1})

    class Save(L.Callback):
        def on_predict_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            pl_module.save_hf(tmp_path / "adapter", adapter=True)

    with pytest.raises(ValueError, match=r"dropout=0.1\) on an MoE model's MLPs.*take no dropout.*save_hf\(path\)"):
        cpu_trainer(callbacks=[Save()]).predict(module, DataLoader(torch.zeros(4, SEQ, dtype=torch.long), batch_size=4))
