"""LoRA on a Multi-Latent Attention model (tiny random DeepSeek-V3 checkpoints of :mod:`tests.hf_moe_models`;
nothing is downloaded): adapters on MLA's projections and the MLPs train, export merged and as a PEFT adapter that
``peft`` loads with our logits, and read back.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import LoRAConfig, MegatronLMModule
from tests.conftest import child_env, run_forked
from tests.hf_moe_models import SEQ, Export, cpu_trainer, hf_forward, hf_model, make_hf_model

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
    cpu_trainer(max_steps=2, callbacks=[save] if save else []).fit(module, DataLoader(tokens, batch_size=4))
    return module


class SaveAdapter(L.Callback):
    """The PEFT adapter at the end of training."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: MegatronLMModule) -> None:  # type: ignore[override]
        pl_module.save_hf(self.path, adapter=True)


def test_lora_on_every_deepseek_linear_trains_merges_and_goes_to_peft(bases: dict, tokens: torch.Tensor,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    """The default targets and the down projections (by Megatron's and HF's name) adapt every linear -- MLA's five
    projections, the dense layer, the shared expert and the experts: two steps move the logits; the merged export
    loads in transformers with the trained module's logits, and the PEFT adapter (the dense layer's and shared
    expert's adapters as target_parameters) in peft, and back here."""
    import peft

    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_down_proj", "kv_a_proj_with_mqa")
    lora = LoRAConfig(rank=4, alpha=8.0, seed=1, target_modules=targets)
    module = _trained(bases["latent"], lora, tokens, SaveAdapter(tmp_path / "adapter"))
    trained = {name.split("self_attention.")[1] for name, p in module.named_parameters()
               if "layers.1.self_attention." in name and p.requires_grad and p.abs().sum() > 0}  # fmt: skip
    assert trained == {f"{linear}.lora_{f}.{part}" for linear, part in (
        ("linear_q_down_proj", "q_a_proj"), ("linear_q_up_proj", "q_b_proj"),
        ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj"),
    ) for f in "AB"}  # fmt: skip
    export = Export(tmp_path / "merged")
    loader = DataLoader(tokens, batch_size=4)
    logits = torch.cat(cpu_trainer(callbacks=[export]).predict(module, loader))
    torch.testing.assert_close(hf_forward(export.path, tokens)[0], logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, hf_forward(bases["latent"], tokens)[0], atol=1e-3)  # the adapters moved them

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    mlp = [f"mlp.{block}{part}.weight" for block in ("", "shared_experts.") for part in ("gate_proj", "up_proj",
                                                                                           "down_proj")]  # fmt: skip
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", *mlp]
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(bases["latent"]), tmp_path / "adapter")(input_ids=tokens)
    torch.testing.assert_close(theirs.logits, logits, rtol=1e-4, atol=1e-4)
    back = MegatronLMModule.from_hf(bases["latent"], seq_length=SEQ, adapter=tmp_path / "adapter")
    assert back.lora.target_modules == ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                        "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")  # fmt: skip
    torch.testing.assert_close(torch.cat(cpu_trainer().predict(back, loader)), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query", list(QUERY))
def test_mla_adapters_go_to_peft_and_back(query: str, bases: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """Trained adapters on MLA's projections (``linear_qkv`` naming its query/key/value ones after the latents, the
    key/value down projection named alone) written as a PEFT adapter give our logits in PEFT on the untouched base,
    and load back here with the same logits."""
    import peft

    lora = LoRAConfig(rank=4, alpha=8.0, seed=2, target_modules=("linear_qkv", "linear_proj", "linear_kv_down_proj"))
    module = _trained(bases[query], lora, tokens, SaveAdapter(tmp_path / "adapter"))
    loader = DataLoader(tokens, batch_size=4)
    ours = torch.cat(cpu_trainer().predict(module, loader))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    q = "q_b_proj" if query == "latent" else "q_proj"
    assert config["target_modules"] == [q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(bases[query]), tmp_path / "adapter")(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, hf_forward(bases[query], tokens)[0], atol=1e-3)  # the adapters moved the logits
    back = MegatronLMModule.from_hf(bases[query], seq_length=SEQ, adapter=tmp_path / "adapter")
    linear = "linear_q_up_proj" if query == "latent" else "linear_q_proj"
    assert back.lora.target_modules == (linear, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
    torch.testing.assert_close(torch.cat(cpu_trainer().predict(back, loader)), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_mla_adapters_at_tp2_sp_equal_one_process(bases: dict, tokens: torch.Tensor, tmp_path: Path) -> None:
    """Adapters on all of MLA's projections at TP=2 with sequence parallelism (the down and up projections' B split
    by rows, A whole on each rank with its gradient summed over TP; the output projection's A split by columns)
    train as one process does (the base, latent norms included, is frozen); the merged export (shards gathered)
    loads in transformers, and the PEFT adapter in peft, with the logits of both ranks, and equals one process's;
    the adapter-only checkpoint of step 2 resumes at TP=1 to one process's step 3."""
    import peft

    lora = {"rank": 4, "alpha": 8.0, "seed": 3,
            "target_modules": ["linear_qkv", "linear_proj", "linear_q_down_proj", "linear_kv_down_proj"]}  # fmt: skip
    job = {"model": str(bases["latent"]), "train_steps": 3, "lora": lora, "tp": 2, "sp": True, "overrides": OVERRIDES,
           "save": str(tmp_path / "tp2"), "ckpt": str(tmp_path / "ckpt")}  # fmt: skip
    torch.save(tokens, tmp_path / "tokens.pt")
    torch.save([], tmp_path / "packed.pt")
    out = tmp_path / "result"
    args = {"devices": 2, "tokens": str(tmp_path / "tokens.pt"), "packed": str(tmp_path / "packed.pt"),
            "out": str(out), "jobs": [job]}  # fmt: skip
    env = child_env(CUDA_VISIBLE_DEVICES="")
    run_forked("hf_worker:main", args, 2, tmp_path, env, expect=Path(f"{out}.rank1.json"))
    import hf_worker  # tests/ is on sys.path once run_forked ran

    one_job = {**job, "tp": 1, "sp": False, "save": str(tmp_path / "one"), "ckpt": None}
    one, one_logits = hf_worker.run_job(1, one_job, tokens, [])
    assert len(set(one["train_losses"])) == 3
    merged = hf_forward(tmp_path / "tp2", tokens)[0]
    torch.testing.assert_close(merged, one_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, hf_forward(bases["latent"], tokens)[0], atol=1e-3)  # the adapters moved them
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(hf_model(bases["latent"]), tmp_path / "tp2-adapter")(input_ids=tokens)
    torch.testing.assert_close(adapted.logits, merged, rtol=1e-4, atol=1e-4)
    ours, theirs = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("tp2-adapter", "one-adapter"))
    assert ours.keys() == theirs.keys()
    assert any("kv_a_proj_with_mqa.lora_B" in name for name in ours)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    for rank in range(2):
        result = json.loads(Path(f"{out}.rank{rank}.json").read_text())[0]
        assert result["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5), rank
        assert result["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), rank
        assert result["trainable"] == ["lora_A", "lora_B"]
        assert result["buckets"]["equal"]  # bucketed = per tensor, gathered over TP
        torch.testing.assert_close(torch.load(f"{out}.job0.rank{rank}.pt"), merged, rtol=1e-4, atol=1e-4)
    resumed, _ = hf_worker.run_job(1, {**one_job, "resume": str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"),
                                       "save": str(tmp_path / "resumed")}, tokens, [])  # fmt: skip
    assert resumed["train_losses"] == pytest.approx(one["train_losses"][2:], rel=1e-5)


def test_mla_targets_a_model_lacks_are_named(bases: dict) -> None:
    """The projections a model lacks (a query down projection without a query latent, a key projection of the other
    attention) are refused, naming the targets that work."""
    lacking = {"latent": ("k_proj", "linear_q_up_proj"), "direct": ("q_a_proj", "linear_q_proj")}
    for query, (missing, works) in lacking.items():
        with pytest.raises(ValueError, match=rf"names \['{missing}'\], which this model does not have.*'{works}'"):
            MegatronLMModule.from_hf(bases[query], seq_length=SEQ, lora=LoRAConfig(target_modules=(missing,)))
