"""LoRA in and out of Hugging Face PEFT at one process (CPU, fp32; TP=2: tests/test_hf_layouts.py): an adapter made by
``peft`` loads into our module with PEFT's logits and trains step for step like PEFT + ``torch.optim.AdamW``; ours
saves as a PEFT adapter that ``peft`` loads (and unloads back to the untouched base), as merged weights that
``transformers`` loads, and streams in buckets equal to the per-tensor export."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import LoRAConfig, MegatronLMFromHF, MegatronLMModule, MegatronStrategy, SaveHF
from tests.hf_dense_models import SEQ, hf_forward, make_hf_model, make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _trainer(**kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        **kwargs,
    )  # fmt: skip


def _hf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model("llama", tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def peft_adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(base, tmp_path_factory.mktemp("peft") / "adapter")


@pytest.fixture(scope="module")
def qv_adapter(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PEFT's Llama default: q_proj and v_proj only (k, fused with them in linear_qkv, gets no adapter)."""
    return make_peft_adapter(base, tmp_path_factory.mktemp("peft") / "qv", targets=("q_proj", "v_proj"))


def _peft_logits(base: Path, adapter: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(_hf(base), adapter).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_a_peft_adapter_loads_with_peft_logits(base: Path, peft_adapter: Path, tokens: torch.Tensor) -> None:
    module = MegatronLMModule.from_hf(base, seq_length=SEQ, adapter=peft_adapter)
    assert module.lora == LoRAConfig(rank=4, alpha=8.0, dropout=0.0)  # the adapter's settings, all four linears
    logits = torch.cat(_trainer().predict(module, DataLoader(tokens, batch_size=4)))
    torch.testing.assert_close(logits, _peft_logits(base, peft_adapter, tokens), rtol=1e-4, atol=1e-4)
    from_yaml = MegatronLMFromHF(str(base), seq_length=SEQ, adapter=str(peft_adapter))  # the CLI's spelling
    torch.testing.assert_close(torch.cat(_trainer().predict(from_yaml, DataLoader(tokens, batch_size=4))), logits)


def test_an_adapter_on_some_projections_of_a_fused_linear(base: Path, qv_adapter: Path, tmp_path: Path) -> None:
    tokens = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))
    module = MegatronLMModule.from_hf(base, seq_length=SEQ, adapter=qv_adapter)
    assert module.lora.target_modules == ("q_proj", "v_proj")
    logits = torch.cat(_trainer().predict(module, DataLoader(tokens, batch_size=4)))
    assert sorted({n.split(".")[-1] for n, _ in module.named_parameters() if ".lora_" in n}) == ["q_proj", "v_proj"]
    torch.testing.assert_close(logits, _peft_logits(base, qv_adapter, tokens), rtol=1e-4, atol=1e-4)


# "qv" also clips (clip 0.05, below every step's norm): Megatron's clipping, the norm kept on the device, against
# torch.nn.utils.clip_grad_norm_.
@pytest.mark.parametrize(("which", "clip"), [("all", 0.0), ("qv", 0.05)])
def test_lora_trains_step_for_step_like_peft_and_adamw(
    which: str, clip: float, base: Path, request: pytest.FixtureRequest
) -> None:
    peft_adapter = request.getfixturevalue("peft_adapter" if which == "all" else "qv_adapter")
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(3))
    settings = {"lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    model = peft.PeftModel.from_pretrained(_hf(base), peft_adapter, is_trainable=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, **settings)
    want, norms = [], []
    for batch in samples.split(4):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trained, clip if clip else float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        want.append(float(loss))

    module = MegatronLMModule.from_hf(
        base, seq_length=SEQ, adapter=peft_adapter, clip_grad=clip, warmup_steps=0, decay_style="constant", **settings
    )  # fmt: skip
    got: list[float] = []
    got_norms: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            got.append(float(outputs["loss"]))
            if clip:
                got_norms.append(float(trainer.callback_metrics["grad_norm"]))

    trainer = _trainer(max_steps=3, callbacks=[Record()], use_distributed_sampler=False)  # PEFT's order
    trainer.fit(module, DataLoader(samples, batch_size=4))
    assert len(set(want)) == 3
    assert got == pytest.approx(want, rel=1e-5)
    if clip:
        assert min(norms) > clip  # every step clipped
        assert got_norms == pytest.approx(norms, rel=1e-5)  # Megatron's norm, before clipping


class Export(L.Callback):
    """At the end of training: merged and adapter directories, the per-tensor, bucketed and adapter streams."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        self.tensors = dict(module.export_hf_weights())
        self.buckets = [[(n, t.clone()) for n, t in b] for b in module.export_hf_weights(bucket_bytes=100_000)]
        self.base = dict(module.export_hf_weights(merged=False))
        self.adapters = dict(module.export_hf_weights(lora_only=True))
        module.save_hf(self.root / "merged")


# Gemma 3 and 2: tied embeddings, (1 + w) norms before and after each sublayer, scaled embeddings, GeGLU (Gemma 2:
# soft-capped attention scores and logits).
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2"])
def test_trained_adapters_export_merged_and_as_peft(arch: str, base: Path, tokens: torch.Tensor,
                                                    tmp_path: Path) -> None:  # fmt: skip
    """Adapters trained here: the bucketed, base-only and adapter-only exports; the merged export loads in
    ``transformers`` and the PEFT adapter in ``peft`` with our logits (and unloads to the untouched base), and the
    adapter loads back here with them."""
    base = base if arch == "llama" else make_hf_model(arch, tmp_path / arch)
    lora = LoRAConfig(rank=4, alpha=8.0, seed=1)
    module = MegatronLMModule.from_hf(base, seq_length=SEQ, lr=5e-2, warmup_steps=0, lora=lora)
    export = Export(tmp_path)
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(4))
    saver = SaveHF(str(tmp_path / "adapter"), adapter=True)
    _trainer(max_steps=3, callbacks=[export, saver]).fit(module, DataLoader(samples, batch_size=4))
    ours = torch.cat(_trainer().predict(module, DataLoader(tokens, batch_size=4)))

    # Buckets: the same tensors in the same order, each bucket within 100,000 bytes unless one tensor is bigger.
    flat = [pair for bucket in export.buckets for pair in bucket]
    assert [n for n, _ in flat] == list(export.tensors)
    assert len(export.buckets) < len(export.tensors) / 3
    assert all(torch.equal(t, export.tensors[n]) for n, t in flat)
    for bucket in export.buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= 100_000
    # merged=False: the untouched base; lora_only: the adapter file's tensors
    hf_base = _hf(base).state_dict()
    assert all(torch.equal(t, hf_base[n]) for n, t in export.base.items())
    assert not torch.equal(export.tensors["model.layers.0.self_attn.q_proj.weight"], export.base[
        "model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == export.adapters.keys()
    assert all(torch.equal(saved[n], t) for n, t in export.adapters.items())
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(ALL))

    merged_logits, _ = hf_forward(tmp_path / "merged", tokens)
    torch.testing.assert_close(merged_logits, ours, rtol=1e-4, atol=1e-4)
    model = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, merged_logits, rtol=1e-4, atol=1e-4)
    unloaded = model.unload().state_dict()  # the base comes back unchanged
    assert unloaded.keys() == hf_base.keys()
    assert all(torch.equal(unloaded[n], t) for n, t in hf_base.items())
    back = MegatronLMModule.from_hf(base, seq_length=SEQ, adapter=tmp_path / "adapter")
    torch.testing.assert_close(torch.cat(_trainer().predict(back, DataLoader(tokens, batch_size=4))), ours)


def _adapter_with(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_adapter_errors(base: Path, peft_adapter: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\] are not projections of a decoder layer"):
        MegatronLMModule.from_hf(base, adapter=_adapter_with(peft_adapter, tmp_path / "a", target_modules=["lm_head"]))
    with pytest.raises(ValueError, match=r"target_modules \['model.layers.0.self_attn.q_proj'\] name modules by"):
        MegatronLMModule.from_hf(base, adapter=_adapter_with(
            peft_adapter, tmp_path / "c", target_modules=["model.layers.0.self_attn.q_proj"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"alora_invocation_tokens=\[1, 2\] is not supported: plain LoRA"):
        MegatronLMModule.from_hf(base, adapter=_adapter_with(peft_adapter, tmp_path / "d", alora_invocation_tokens=[1,
                                 2]))  # fmt: skip
    with pytest.raises(ValueError, match=r"use_dora=True is not supported"):
        MegatronLMModule.from_hf(base, adapter=_adapter_with(peft_adapter, tmp_path / "b", use_dora=True))
    with pytest.raises(ValueError, match=r"LoRAConfig\(rank=8\) differs from the adapter .* \(rank=4\)"):
        MegatronLMModule.from_hf(base, adapter=peft_adapter, lora=LoRAConfig(rank=8))
    other = make_hf_model("mistral", tmp_path / "mistral")  # 2 layers, not 4
    with pytest.raises(ValueError, match=r"layers.2.mlp.down_proj.lora_A.weight is \(4, 96\) there and not a tensor"):
        MegatronLMModule.from_hf(other, adapter=peft_adapter)
    with pytest.raises(FileNotFoundError, match=r"is not a PEFT adapter directory"):
        MegatronLMModule.from_hf(base, adapter=tmp_path)
    module = MegatronLMModule.from_hf(base, seq_length=SEQ)
    with pytest.raises(ValueError, match=r"SaveHF\(adapter=True\) writes LoRA adapters, and this module has none"):
        SaveHF("unused", adapter=True).setup(None, module, "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save_hf\(adapter=True\) writes LoRA adapters; this module has none"):
        module.save_hf("unused", adapter=True)
    with pytest.raises(ValueError, match=r"lora_only=True streams LoRA adapters; this module has none"):
        module.export_hf_weights(lora_only=True)
    with pytest.raises(ValueError, match=r"bucket_bytes=0 must be a positive number of bytes"):
        module.export_hf_weights(bucket_bytes=0)
    tuned = MegatronLMModule.from_hf(base, adapter=peft_adapter, lora={"dropout": 0.1, "seed": 3})  # these only
    assert (tuned.lora.rank, tuned.lora.alpha, tuned.lora.dropout, tuned.lora.seed) == (4, 8.0, 0.1, 3)
    with pytest.raises(ValueError, match=r"merged=False with lora_only=True"):
        tuned.export_hf_weights(lora_only=True, merged=False)
