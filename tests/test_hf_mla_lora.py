"""LoRA on a Multi-Latent Attention model (tiny random DeepSeek-V3 checkpoints of :mod:`tests.test_hf_moe`; nothing
is downloaded): adapters on MLA's projections and the MLPs train, export merged and as a PEFT adapter that ``peft``
loads with our logits, and read back; the down projections are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import LoRAConfig, MegatronLMModule
from tests.conftest import child_env, run_forked
from tests.test_hf_moe import SEQ, Export, _trainer, hf_forward, hf_model, make_hf_model

# The latent query of DeepSeek-V3 (q_lora_rank=24: q_a_proj, q_b_proj) and a direct one (DeepSeek-V2-Lite: q_proj).
QUERY = {"latent": 24, "direct": None}
OVERRIDES = {"moe_router_bias_update_rate": 0.0}  # the router's correction bias stays as transformers has it


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla_lora")
    return {name: make_hf_model("deepseek_v3", root / name, q_lora_rank=rank) for name, rank in QUERY.items()}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


def _trained(base: Path, lora: LoRAConfig, tokens: torch.Tensor, save: L.Callback | None = None) -> MegatronLMModule:
    """A module on ``base`` whose adapters took two steps (``save`` runs at the end of training)."""
    module = MegatronLMModule.from_hf(base, seq_length=SEQ, lora=lora, lr=1e-2, warmup_steps=0,
                                      config_overrides=OVERRIDES)  # fmt: skip
    _trainer(max_steps=2, callbacks=[save] if save else []).fit(module, DataLoader(tokens, batch_size=4))
    return module


def test_lora_on_every_deepseek_linear_trains_and_merges(bases: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """The default targets adapt every linear that takes adapters -- MLA's up projections and output projection, the
    dense layer, the shared expert and the experts: two steps move the logits, and the merged export loads in
    transformers with the trained module's logits."""
    module = _trained(bases["latent"], LoRAConfig(rank=4, alpha=8.0, seed=1), tokens)
    trained = {name.split("self_attention.")[1] for name, p in module.named_parameters()
               if "layers.1.self_attention." in name and p.requires_grad and p.abs().sum() > 0}  # fmt: skip
    assert trained == {f"{linear}.lora_{f}.{part}" for linear, part in (("linear_q_up_proj", "q_b_proj"),
                       ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")) for f in "AB"}  # fmt: skip
    export = Export(tmp_path / "merged")
    logits = torch.cat(_trainer(callbacks=[export]).predict(module, DataLoader(tokens, batch_size=4)))
    torch.testing.assert_close(hf_forward(export.path, tokens)[0], logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, hf_forward(bases["latent"], tokens)[0], atol=1e-3)  # the adapters moved them


@pytest.mark.parametrize("query", list(QUERY))
def test_mla_adapters_go_to_peft_and_back(query: str, bases: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """Trained adapters on MLA's projections (``linear_qkv`` naming its query/key/value ones) written as a PEFT
    adapter give our logits in PEFT on the untouched base, and load back here with the same logits."""
    import peft

    class Save(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
            pl_module.save_hf(tmp_path / "adapter", adapter=True)

    lora = LoRAConfig(rank=4, alpha=8.0, seed=2, target_modules=("linear_qkv", "linear_proj"))
    module = _trained(bases[query], lora, tokens, Save())
    loader = DataLoader(tokens, batch_size=4)
    ours = torch.cat(_trainer().predict(module, loader))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    q = "q_b_proj" if query == "latent" else "q_proj"
    assert config["target_modules"] == [q, "kv_b_proj", "o_proj"]
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(bases[query]), tmp_path / "adapter")(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, hf_forward(bases[query], tokens)[0], atol=1e-3)  # the adapters moved the logits
    back = MegatronLMModule.from_hf(bases[query], seq_length=SEQ, adapter=tmp_path / "adapter")
    linear = "linear_q_up_proj" if query == "latent" else "linear_q_proj"
    assert back.lora.target_modules == (linear, "linear_kv_up_proj", "linear_proj")
    torch.testing.assert_close(torch.cat(_trainer().predict(back, loader)), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_mla_adapters_at_tp2_sp_train_and_export(bases: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """Adapters on MLA's projections at TP=2 with sequence parallelism (the up projections' B split by rows, the
    output projection's A by columns) train; the merged export (shards gathered) loads in transformers, and the PEFT
    adapter in peft, with the logits of both ranks."""
    import peft

    lora = {"rank": 4, "alpha": 8.0, "seed": 3, "target_modules": ["linear_qkv", "linear_proj"]}
    job = {"model": str(bases["latent"]), "train_steps": 3, "lora": lora, "tp": 2, "sp": True, "overrides": OVERRIDES,
           "save": str(tmp_path / "tp2")}  # fmt: skip
    torch.save(tokens, tmp_path / "tokens.pt")
    torch.save([], tmp_path / "packed.pt")
    out = tmp_path / "result"
    args = {"devices": 2, "tokens": str(tmp_path / "tokens.pt"), "packed": str(tmp_path / "packed.pt"),
            "out": str(out), "jobs": [job]}  # fmt: skip
    env = child_env(CUDA_VISIBLE_DEVICES="")
    run_forked("hf_worker:main", args, 2, tmp_path, env, expect=Path(f"{out}.rank1.json"))
    merged = hf_forward(tmp_path / "tp2", tokens)[0]
    assert not torch.allclose(merged, hf_forward(bases["latent"], tokens)[0], atol=1e-3)  # the adapters moved them
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(hf_model(bases["latent"]), tmp_path / "tp2-adapter")(input_ids=tokens)
    torch.testing.assert_close(adapted.logits, merged, rtol=1e-4, atol=1e-4)
    for rank in range(2):
        result = json.loads(Path(f"{out}.rank{rank}.json").read_text())[0]
        assert len(set(result["train_losses"])) == 3
        assert result["trainable"] == ["lora_A", "lora_B"]
        assert result["buckets"]["equal"]  # bucketed = per tensor, gathered over TP
        torch.testing.assert_close(torch.load(f"{out}.job0.rank{rank}.pt"), merged, rtol=1e-4, atol=1e-4)


def test_mla_targets_that_take_no_adapters_are_named(bases: dict) -> None:
    """MLA's down projections (Megatron picks their sharding by their exact class) and the projections a model lacks
    are refused, naming the targets that work."""
    for down in ("linear_kv_down_proj", "q_a_proj"):
        with pytest.raises(ValueError, match=rf"down projections \['{down}'\].*'linear_q_up_proj' \('q_b_proj'"):
            LoRAConfig(target_modules=("linear_proj", down))
    lacking = {"latent": ("k_proj", "linear_q_up_proj"), "direct": ("q_b_proj", "linear_q_proj")}
    for query, (missing, works) in lacking.items():
        with pytest.raises(ValueError, match=rf"names \['{missing}'\], which this model does not have.*'{works}'"):
            MegatronLMModule.from_hf(bases[query], seq_length=SEQ, lora=LoRAConfig(target_modules=(missing,)))
