"""Hugging Face in and out: Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 / Gemma 2 import, export and round trips (CPU,
tiny random models written with ``save_pretrained``; nothing is downloaded).

Parity is against ``transformers`` in float32 with eager attention: logits from ``trainer.predict`` and the loss
from ``trainer.validate`` on the same tokens, for every architecture at one process, TP=2 and PP=2 (Llama with
PP=2 x VPP=2), and at TP=2 x PP=2 for Qwen3 and Llama (VPP=2), in one 2-process and one 4-process worker run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ModelConfig, pack_sequences, tiny_gpt
from lightning_megatron.gpt.hf.config import check_exportable
from lightning_megatron.gpt.hf.mapping import family, hf_weight_shapes
from tests.conftest import child_env, run_forked

SEQ = 16
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
}  # fmt: skip
BASE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 16384, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
}  # fmt: skip
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # 8 heads in 4 groups: two query groups (of two heads) per tensor-parallel rank at TP=2.
    "llama": ("LlamaConfig", {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                              "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": 64, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 10000.0}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),  # head_dim != hidden / heads
    # Sliding (window 4 of the 16 tokens) and full layers, each with its RoPE base; post norms, (1 + w) gains.
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                                    "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0},
                                                        "full_attention": {"rope_type": "linear",
                                                                           "rope_theta": 500.0, "factor": 2.0}}}),
    # Gemma 3's layer without q/k norms, one RoPE, soft-capped attention scores and logits (caps that bite).
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                                "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
}  # fmt: skip


def make_hf_model(arch: str, path: Path) -> Path:
    config_name, overrides = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise them so that a wrong mapping shows
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return path


def make_peft_adapter(base: Path, path: Path, targets: tuple[str, ...] | None = None) -> Path:
    """An adapter made by ``peft`` (default: on every projection), with B away from its zero init (so it changes
    logits)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = targets or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(path)
    return path


def hf_forward(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
    return out.logits, float(out.loss)


# Documents packed first-fit into 4 rows of SEQ tokens: [9, 7], [12, 4], [5, 10, one pad token], [3, 13].
PACKED_LENGTHS = (9, 7, 12, 4, 5, 10, 3, 13)


def packed_documents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=generator) for n in PACKED_LENGTHS]


def hf_per_document(path: Path) -> tuple[float, torch.Tensor]:
    """``transformers`` on each document alone: the token-weighted loss, and the log-probs laid out like the packed
    rows' ``logprobs`` (position t: log p(token t+1); 0 at each document's last token and on padding)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    rows = pack_sequences(packed_documents(), SEQ)
    want = torch.zeros(len(rows), SEQ)
    total, count = 0.0, 0
    with torch.no_grad():
        for r, row in enumerate(rows):
            starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [SEQ]
            for start, stop in zip(starts[:-1], starts[1:], strict=True):
                doc = row["input_ids"][start:stop]
                if row["labels"][start + 1 : stop].eq(-100).all():
                    continue  # the padding document
                logprobs = model(input_ids=doc[None]).logits[0].log_softmax(-1)
                picked = logprobs[:-1].gather(-1, doc[1:, None]).squeeze(-1)  # [n-1]
                want[r, start : stop - 1] = picked
                total, count = total - float(picked.sum()), count + len(doc) - 1
    return total / count, want


def hf_state_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


def _trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
        enable_progress_bar=False, enable_model_summary=False, **{"enable_checkpointing": False, **kwargs},
    )  # fmt: skip


class ExportAndSave(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.shapes: dict[str, tuple[int, ...]] = {}

    def on_predict_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        self.shapes = {name: tuple(t.shape) for name, t in module.export_hf_weights()}
        module.save_hf(self.path)


@pytest.fixture(scope="module")
def one_process(models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every architecture at one process: predict (exporting and saving at its end) and validate."""
    results = {}
    for arch, path in models.items():
        module = MegatronLMModule.from_hf(path, seq_length=SEQ)
        export = ExportAndSave(tmp_path_factory.mktemp("saved") / arch)
        loader = DataLoader(tokens, batch_size=4)
        logits = torch.cat(_trainer(callbacks=[export]).predict(module, loader))
        val_loss = _trainer().validate(module, loader)[0]["val_loss"]
        results[arch] = {"logits": logits, "val_loss": val_loss, "export": export, "module": module}
    return results


# ------------------------------------------------------------------------------------------- config mapping
def test_config_from_hf_maps_each_architecture(models: dict[str, Path]) -> None:
    llama = ModelConfig.from_hf(models["llama"])
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads, llama.num_query_groups) == (4, 64, 8, 4)
    assert (llama.kv_channels, llama.ffn_hidden_size, llama.vocab_size, llama.norm_epsilon) == (8, 96, 128, 1e-6)
    assert (llama.rotary_base, llama.rope_scaling, llama.rope_scaling_factor) == (500000, True, 8.0)
    assert llama.seq_length == 16384
    assert not llama.share_embeddings_and_output_weights
    assert not llama.add_qkv_bias
    assert not llama.qk_layernorm
    mistral = ModelConfig.from_hf(models["mistral"])
    assert mistral.seq_len_interpolation_factor == 2.0
    assert mistral.seq_length == 64  # capped by the sliding window
    qwen2 = ModelConfig.from_hf(json.loads((models["qwen2"] / "config.json").read_text()), seq_length=SEQ)
    assert qwen2.add_qkv_bias
    assert qwen2.share_embeddings_and_output_weights
    assert qwen2.seq_length == SEQ
    qwen3 = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(models["qwen3"]), hidden_dropout=0.1)
    assert qwen3.qk_layernorm
    assert qwen3.kv_channels == 32
    assert qwen3.hidden_dropout == 0.1
    assert not qwen3.add_qkv_bias


# ------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("arch", list(ARCHS))
def test_one_process_matches_transformers(arch: str, one_process: dict, models: dict, tokens: torch.Tensor) -> None:
    logits, loss = hf_forward(models[arch], tokens)
    got = one_process[arch]
    assert got["logits"].shape == (4, SEQ, 128)
    torch.testing.assert_close(got["logits"], logits, rtol=1e-4, atol=1e-4)
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_llama3_rope_frequencies_match_transformers(one_process: dict, models: dict) -> None:
    # At 16 tokens the scaled low frequencies barely move the logits: compare the frequencies themselves.
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    chunk = one_process["llama"]["module"].chunks[0]
    # The torch-native attention (kernels "auto" on CPU too) applies RoPE inside: its table's RotaryEmbedding.
    inv_freq = chunk.decoder.layers[0].self_attention.core_attention.rope.embedding.inv_freq
    torch.testing.assert_close(inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    unscaled = 1.0 / 500000 ** (torch.arange(0, 8, 2).float() / 8)  # head_dim 8
    assert not torch.allclose(inv_freq, unscaled)  # the scaling is in effect


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_names_and_shapes_are_the_hf_state_dict(arch: str, one_process: dict, models: dict) -> None:
    want = hf_state_shapes(models[arch])
    assert one_process[arch]["export"].shapes == want
    assert hf_weight_shapes(one_process[arch]["module"].config) == want


@pytest.mark.parametrize("arch", list(ARCHS))
def test_untrained_round_trip_is_exact(arch: str, one_process: dict, models: dict, tokens: torch.Tensor) -> None:
    saved = one_process[arch]["export"].path
    original, written = load_file(models[arch] / "model.safetensors"), load_file(saved / "model.safetensors")
    assert set(written) == set(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((saved / "config.json").read_text()) == json.loads((models[arch] / "config.json").read_text())
    assert hf_forward(saved, tokens)[1] == hf_forward(models[arch], tokens)[1]  # transformers loads it unchanged


@pytest.mark.parametrize("arch", list(ARCHS))
def test_family_adapter_converts_whole_state_dicts(arch: str, one_process: dict, models: dict) -> None:
    """The family's to_hf / from_hf (one process, whole state dicts) agree with the model that import built and
    that matches transformers' logits: from_hf of the HF file is its state dict, to_hf of its state dict the file."""
    module = one_process[arch]["module"]
    adapter = family(module.config)
    families = {"llama": "Llama", "mistral": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma3",
                "gemma2": "Gemma2"}  # fmt: skip
    assert type(adapter).__name__ == families[arch]
    original = load_file(models[arch] / "model.safetensors")
    params = {name: p.detach() for name, p in module.chunks[0].named_parameters()}
    converted = adapter.from_hf(original, module.config)
    assert converted.keys() == params.keys()
    for name, tensor in converted.items():
        assert torch.equal(tensor, params[name]), name
    back = adapter.to_hf(params, module.config)
    assert list(back) == [name for name in hf_weight_shapes(module.config, include_tied=False)]
    tied = {"lm_head.weight"} if module.config.share_embeddings_and_output_weights else set()
    assert back.keys() == original.keys() - tied
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name


def test_no_family_holds_qkv_biases_with_qk_norms() -> None:
    with pytest.raises(ValueError, match=r"no HF architecture holds a model with add_qkv_bias=True, qk_layernorm=True"):
        check_exportable(tiny_gpt(add_qkv_bias=True, qk_layernorm=True))


GENERATED = {
    "Qwen2ForCausalLM": {"add_qkv_bias": True, "share_embeddings_and_output_weights": True},
    "Qwen3ForCausalLM": {"qk_layernorm": True, "kv_channels": 32},
    "LlamaForCausalLM": {"rope_scaling": True, "rotary_base": 500000},
}


@pytest.mark.parametrize("arch", list(GENERATED))
def test_save_hf_of_a_model_not_from_hf(arch: str, tmp_path: Path, tokens: torch.Tensor) -> None:
    """A ModelConfig-built model is written with a generated config.json that transformers loads."""
    config = tiny_gpt(num_layers=2, vocab_size=128, num_query_groups=2, seq_length=SEQ, **GENERATED[arch])
    export = ExportAndSave(tmp_path / "out")
    logits = torch.cat(_trainer(callbacks=[export]).predict(MegatronLMModule(config), DataLoader(tokens, batch_size=4)))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [arch]
    torch.testing.assert_close(hf_forward(tmp_path / "out", tokens)[0], logits, rtol=1e-4, atol=1e-4)


def test_models_without_an_hf_counterpart_are_not_exported() -> None:
    with pytest.raises(ValueError, match=r"normalization='LayerNorm', add_bias_linear=True: no HF counterpart"):
        check_exportable(tiny_gpt(normalization="LayerNorm", add_bias_linear=True))


def test_sharded_hf_checkpoint(models: dict, one_process: dict, tmp_path: Path, tokens: torch.Tensor) -> None:
    transformers.AutoModelForCausalLM.from_pretrained(models["qwen2"]).save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    module = MegatronLMModule.from_hf(tmp_path, seq_length=SEQ)
    val_loss = _trainer().validate(module, DataLoader(tokens, batch_size=4))[0]["val_loss"]
    assert val_loss == one_process["qwen2"]["val_loss"]


def test_packed_rows_match_each_document_alone(models: dict) -> None:
    """One process: packed rows give transformers' per-document loss and log-probs, and our own run of the same
    documents unpacked (one per row, padded with ignored labels) gives the same loss."""
    want_loss, want_logprobs = hf_per_document(models["llama"])
    module = MegatronLMModule.from_hf(models["llama"], seq_length=SEQ, config_overrides={"kernels": "torch"})
    rows = DataLoader(pack_sequences(packed_documents(), SEQ), batch_size=4)
    assert _trainer().validate(module, rows)[0]["val_loss"] == pytest.approx(want_loss, rel=1e-5)
    unpacked = []
    for doc in packed_documents():
        pad = SEQ - len(doc)
        labels = torch.cat([doc, torch.full((pad,), -100)])
        unpacked.append({"input_ids": torch.cat([doc, torch.zeros(pad, dtype=torch.long)]), "labels": labels})
    loss = _trainer().validate(module, DataLoader(unpacked, batch_size=8))[0]["val_loss"]
    assert loss == pytest.approx(want_loss, rel=1e-5)
    module.prediction = "logprobs"
    got = torch.cat([p["logprobs"] for p in _trainer().predict(module, rows)])
    torch.testing.assert_close(got, want_logprobs, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- TP=2 / PP=2
LORA = {"rank": 4, "alpha": 8.0, "seed": 3}
JOBS = {
    "llama_tp2": {"arch": "llama", "tp": 2, "packed": True},
    "llama_cp2": {"arch": "llama", "cp": 2, "packed": True},
    "mistral_tp2": {"arch": "mistral", "tp": 2},
    "qwen2_tp2": {"arch": "qwen2", "tp": 2},
    "qwen3_tp2": {"arch": "qwen3", "tp": 2},
    "llama_pp2_vpp2": {"arch": "llama", "pp": 2, "vpp": 2, "packed": True},
    "mistral_pp2": {"arch": "mistral", "pp": 2},
    "qwen2_pp2": {"arch": "qwen2", "pp": 2},  # tied embeddings: the last stage holds a copy
    "qwen3_pp2": {"arch": "qwen3", "pp": 2},
    "gemma3_tp2": {"arch": "gemma3", "tp": 2, "packed": True},  # windows inside documents, split over TP
    "gemma3_pp2": {"arch": "gemma3", "pp": 2},  # tied embeddings, a sliding and a full layer per stage
    "gemma2_tp2": {"arch": "gemma2", "tp": 2},  # the final soft-cap on each rank's vocabulary shard
    "gemma2_pp2": {"arch": "gemma2", "pp": 2},  # ... on the last stage only
    "llama_tp2_trained": {"arch": "llama", "tp": 2, "train_steps": 2},
    # LoRA on the frozen HF weights: the same adapters (seeded) and curve at every layout
    "llama_tp2_sp_lora_trained": {"arch": "llama", "tp": 2, "sp": True, "train_steps": 3, "lora": LORA},
    "llama_pp2_lora_trained": {"arch": "llama", "pp": 2, "train_steps": 3, "lora": LORA},
    "llama_tp2_peft_adapter": {"arch": "llama", "tp": 2, "adapter": "peft-adapter"},  # made by peft (multi)
    # the one-process run's adapter-only checkpoint of step 2 (lora_one_process), resumed with B and A sharded
    "llama_tp2_lora_resumed_trained": {"arch": "llama", "tp": 2, "train_steps": 3, "lora": LORA, "resume": "lora"},
    "qwen3_tp2_pp2": {"arch": "qwen3", "tp": 2, "pp": 2, "devices": 4},
    "llama_tp2_pp2_vpp2": {"arch": "llama", "tp": 2, "pp": 2, "vpp": 2, "devices": 4},
}


def _run_worker(devices: int, names: list[str], models: dict[str, Path], tmp: Path) -> dict[str, dict]:
    """One worker run (ranks forked: tests/forked.py) doing the jobs one Trainer after another."""
    jobs = [{**JOBS[n], "model": str(models[JOBS[n]["arch"]]), "save": str(tmp / f"saved-{n}")} for n in names]
    for job in jobs:
        if "adapter" in job:
            job["adapter"] = str(tmp / job["adapter"])
        if "resume" in job:
            job["resume"] = str(tmp / job["resume"] / "epoch=0-step=2.ckpt")
    out = tmp / f"result{devices}"
    args = {"devices": devices, "tokens": str(tmp / "tokens.pt"), "packed": str(tmp / "packed.pt"), "out": str(out),
            "jobs": jobs}  # fmt: skip
    expect = Path(f"{out}.rank{devices - 1}.json")
    run_forked("hf_worker:main", args, devices, tmp, child_env(CUDA_VISIBLE_DEVICES=""), expect=expect)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]
    return {
        name: {"ranks": [ranks[r][i] for r in range(devices)], "save": Path(jobs[i]["save"]),
               "logits": [torch.load(f"{out}.job{i}.rank{r}.pt") for r in range(devices)]}
        for i, name in enumerate(names)
    }  # fmt: skip


LORA_SAMPLES = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(0))  # as hf_worker's


@pytest.fixture(scope="module")
def multi(models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every job: one 2-process and one 4-process worker run (after the one-process LoRA run they resume from)."""
    tmp = tmp_path_factory.mktemp("multi")
    make_peft_adapter(models["llama"], tmp / "peft-adapter")
    results = {"lora_one_process": _lora_one_process(models["llama"], tokens, tmp / "lora")}
    torch.save(tokens, tmp / "tokens.pt")
    torch.save(pack_sequences(packed_documents(), SEQ), tmp / "packed.pt")
    for devices in (2, 4):
        names = [name for name, job in JOBS.items() if job.get("devices", 2) == devices]
        results.update(_run_worker(devices, names, models, tmp))
    return results


def _total_elements(path: Path) -> int:
    return sum(t.numel() for t in load_file(path / "model.safetensors").values())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in JOBS if "trained" not in n and "adapter" not in n])
def test_tp_pp_match_transformers(name: str, multi: dict, models: dict, tokens: torch.Tensor) -> None:
    job = JOBS[name]
    logits, loss = hf_forward(models[job["arch"]], tokens)
    want = hf_state_shapes(models[job["arch"]])
    shards = job.get("tp", 1) * job.get("pp", 1)
    for got in multi[name]["ranks"]:  # the same loss on every rank
        assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
        # Exported during validation: the source tensors exactly, with HF's names and shapes, on every rank.
        assert got["export_max_diff"] == 0.0
        assert {k: tuple(v) for k, v in got["export_shapes"].items()} == want
        # No rank reads the whole model, only about 1/(tp*pp) of it: its slice of each matrix and its stage's
        # layers (plus replicated norms; with tied embeddings the first and the last stage both read the embedding).
        assert 0.8 / shards < got["elements_read"] / _total_elements(models[job["arch"]]) < 1.2 / shards
    for rank_logits in multi[name]["logits"]:  # full-vocabulary logits on every rank
        torch.testing.assert_close(rank_logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n, job in JOBS.items() if job.get("packed")])
def test_packed_rows_at_tp_pp_cp_match_each_document_alone(name: str, multi: dict, models: dict) -> None:
    want_loss, want_logprobs = hf_per_document(models[JOBS[name]["arch"]])
    for got in multi[name]["ranks"]:  # on every rank
        assert got["packed_val_loss"] == pytest.approx(want_loss, rel=1e-5)
        torch.testing.assert_close(torch.tensor(got["packed_logprobs"]), want_logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
def test_train_at_tp2_save_and_load_in_transformers(multi: dict, models: dict, tokens: torch.Tensor) -> None:
    got = multi["llama_tp2_trained"]
    saved = got["save"]
    assert (saved / "model.safetensors.index.json").is_file()  # small shards in this test: the index is written
    logits, loss = hf_forward(saved, tokens)
    assert loss != pytest.approx(hf_forward(models["llama"], tokens)[1], rel=1e-3)  # the weights did change
    for rank in range(2):
        assert got["ranks"][rank]["val_loss"] == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(got["logits"][rank], logits, rtol=1e-4, atol=1e-4)


def _lora_one_process(base: Path, tokens: torch.Tensor, ckpt_dir: Path) -> dict:
    """LoRA on the HF weights at one process: 3 steps (adapter-only checkpoint at step 2), then validate, predict."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = MegatronLMModule.from_hf(base, seq_length=SEQ, lr=1e-2, warmup_steps=0, lora=LORA)

    class Record(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.values.append(float(outputs["loss"]))

    record, saver = Record(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(max_steps=3, num_sanity_val_steps=0, callbacks=[record, saver], enable_checkpointing=True)
    trainer.fit(module, DataLoader(LORA_SAMPLES, batch_size=4))
    loader = DataLoader(tokens, batch_size=tokens.shape[0])
    val_loss = _trainer().validate(module, loader)[0]["val_loss"]
    return {"train": record.values, "val_loss": val_loss, "logits": torch.cat(_trainer().predict(module, loader))}


@pytest.mark.multiprocess
def test_lora_at_tp2_sp_and_pp2_follows_one_process(multi: dict) -> None:
    """LoRA from the same HF weights and seed: the 1-process curve at TP=2 + SP and at PP=2 (adapters sharded as
    the base, the base frozen), the same validation loss and logits after training; the 1-process adapter-only
    checkpoint of step 2 resumed at TP=2 continues the curve."""
    one = multi["lora_one_process"]
    assert len(set(one["train"])) == 3  # the adapters move (random tokens: the loss need not fall)
    for name in ("llama_tp2_sp_lora_trained", "llama_pp2_lora_trained", "llama_tp2_lora_resumed_trained"):
        steps = slice(2, None) if "resumed" in name else slice(None)
        for rank, got in enumerate(multi[name]["ranks"]):
            assert got["trainable"] == ["lora_A", "lora_B"], (name, rank)
            assert got["train_losses"] == pytest.approx(one["train"][steps], rel=2e-4), (name, rank)
            assert got["val_loss"] == pytest.approx(one["val_loss"], rel=2e-4), (name, rank)
        for rank_logits in multi[name]["logits"]:
            torch.testing.assert_close(rank_logits, one["logits"], rtol=1e-3, atol=1e-3)


@pytest.mark.multiprocess
def test_lora_at_tp2_and_pp2_exports_merged_weights_and_a_peft_adapter(multi: dict, models: dict, tokens) -> None:  # noqa: ANN001
    """The adapters trained at TP=2 + SP (and at PP=2): ``peft`` loads the adapter onto the untouched base with
    the logits of the merged export, which ``transformers`` loads with the module's own logits; bucketed exports
    (one gather / broadcast per bucket) equal the per-tensor one."""
    import peft

    for name in ("llama_tp2_sp_lora_trained", "llama_pp2_lora_trained"):
        got = multi[name]
        merged, _ = hf_forward(got["save"], tokens)
        for rank_logits in got["logits"]:
            torch.testing.assert_close(rank_logits, merged, rtol=1e-4, atol=1e-4)
        base = transformers.AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32,
                                                                 attn_implementation="eager")  # fmt: skip
        with torch.no_grad():
            adapted = peft.PeftModel.from_pretrained(base, f"{got['save']}-adapter").eval()(input_ids=tokens).logits
        torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
        for rank in got["ranks"]:
            buckets = rank["buckets"]
            assert buckets["equal"], (name, buckets)
            assert buckets["count"] < buckets["tensors"] / 3, (name, buckets)
            assert max(buckets["bytes"]) <= 100_000, (name, buckets)


@pytest.mark.multiprocess
def test_a_peft_adapter_at_tp2_gives_peft_logits(multi: dict, models: dict, tokens: torch.Tensor) -> None:
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32,
                                                             attn_implementation="eager")  # fmt: skip
    adapter = multi["llama_tp2_peft_adapter"]["save"].parent / "peft-adapter"
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=tokens).logits
    for rank_logits in multi["llama_tp2_peft_adapter"]["logits"]:
        torch.testing.assert_close(rank_logits, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- errors
def _copy(src: Path, dst: Path, drop: str | None = None, config: dict | None = None) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop}, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = {**json.loads((src / "config.json").read_text()), **(config or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_wrong_architecture(tmp_path: Path) -> None:
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM.*Qwen3ForCausalLM.*Bridge"):
        MegatronLMModule.from_hf(tmp_path)


def test_missing_tensor(models: dict, tmp_path: Path) -> None:
    path = _copy(models["qwen2"], tmp_path / "m", drop="model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(ValueError, match=r"missing from .*model\.safetensors: model\.layers\.1\.self_attn\.k_proj\."):
        MegatronLMModule.from_hf(path)


def test_shapes_that_disagree_with_the_config(models: dict, tmp_path: Path) -> None:
    path = _copy(models["llama"], tmp_path / "m", config={"intermediate_size": 128})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight in .*model\.safetensors has "
                                         r"shape \(96, 64\), but config\.json implies \(128, 64\)"):  # fmt: skip
        MegatronLMModule.from_hf(path)


def test_unexplained_tensors(models: dict, tmp_path: Path) -> None:
    path = _copy(models["llama"], tmp_path / "m", config={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"does not explain: model\.layers\.3\."):
        MegatronLMModule.from_hf(path)


def test_pickled_weights_are_refused(models: dict, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((models["llama"] / "config.json").read_text())
    torch.save(load_file(models["llama"] / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*only safetensors"):
        MegatronLMModule.from_hf(tmp_path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, r"rope_type='yarn'"),
        ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 4096}}, r"llama3 RoPE .*4096"),
        ({"attention_bias": True}, r"attention_bias=True"),
        ({"hidden_act": "relu"}, r"hidden_act='relu'"),
    ],
)
def test_unsupported_config_features(change: dict, match: str, models: dict) -> None:
    cfg = {**json.loads((models["llama"] / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_seq_length_beyond_the_sliding_window(models: dict) -> None:
    with pytest.raises(ValueError, match=r"seq_length=128 exceeds the model's sliding attention window \(64\)"):
        ModelConfig.from_hf(models["mistral"], seq_length=128)


def test_export_outside_a_run_raises(models: dict) -> None:
    module = MegatronLMModule.from_hf(models["llama"], seq_length=SEQ)
    with pytest.raises(RuntimeError, match=r"while the Trainer runs"):
        module.export_hf_weights()
    with pytest.raises(RuntimeError, match=r"while the Trainer runs"):
        module.save_hf("unused")


# Gemma: tied embeddings (the value head replaces the tied LM head), (1 + w) norms before and after each sublayer,
# scaled embeddings; Gemma 2's final soft-cap is the LM head's, not the value head's.
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2"])
def test_value_module_from_hf_uses_the_pretrained_backbone(arch: str, models: dict, tokens: torch.Tensor) -> None:
    """The critic is the HF decoder plus a scalar head: values = head(final hidden states of transformers)."""
    from lightning_megatron import MegatronValueModule

    module = MegatronValueModule.from_hf(models[arch], seq_length=SEQ)
    values = torch.cat(_trainer().predict(module, DataLoader(tokens, batch_size=4)))
    assert values.shape == tokens.shape
    head = module.chunks[0].output_layer
    hf = transformers.AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32,
                                                           attn_implementation="eager")  # fmt: skip
    with torch.no_grad():
        hidden = hf.model(input_ids=tokens).last_hidden_state  # after the final norm
        want = (hidden @ head.weight.float().T + head.bias.float()).squeeze(-1)
    torch.testing.assert_close(values, want, rtol=1e-4, atol=1e-4)
