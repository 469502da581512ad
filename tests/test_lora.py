"""LoRA (lightning_megatron.gpt.lora): configuration errors, frozen base, seeded adapters, training at one process.
(TP=2 + SP and PP=2 against one process, from HF weights: tests/test_hf_layouts.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import LoRAConfig, MegatronLMModule, MegatronStrategy, ParallelSizes, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.gpt.lora.config import is_adapter_param


def test_lora_config_errors() -> None:
    with pytest.raises(ValueError, match=r"rank=0 must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"unknown \['qkv'\]; pick from \['linear_qkv', 'linear_fc1'.*\['q_proj'"):
        LoRAConfig(target_modules=("qkv",))
    with pytest.raises(ValueError, match=r"names \['gate_proj'\], which this model does not have"):
        MegatronLMModule(tiny_gpt(gated_linear_unit=False), lora=LoRAConfig(target_modules=("gate_proj",)))
    with pytest.raises(ValueError, match=r"names \['gate_proj'\] alone on an MoE model.*'linear_fc1'"):
        MegatronLMModule(tiny_gpt(num_moe_experts=4), lora=LoRAConfig(target_modules=("q_proj", "gate_proj")))
    with pytest.raises(ValueError, match=r"alpha=0"):
        LoRAConfig(alpha=0)
    dropped = MegatronLMModule(tiny_gpt(num_moe_experts=4), lora=LoRAConfig(dropout=0.1))  # experts adapted
    with pytest.raises(ValueError, match=r"dropout=0.1\) on the experts.*tp=2.*use dropout=0.0, or tp=1"):
        dropped.validate_parallel(ParallelSizes(tp=2, sequence_parallel=True))
    dropped.validate_parallel(ParallelSizes(ep=4))
    MegatronLMModule(tiny_gpt(num_moe_experts=4), lora=LoRAConfig()).validate_parallel(
        ParallelSizes(tp=2, sequence_parallel=True)
    )
    assert LoRAConfig(target_modules=["linear_qkv"]).target_modules == ("linear_qkv",)  # YAML lists
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        LoRAConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"fp8='hybrid'\): the adapted linears run in bf16"):
        MegatronLMModule(tiny_gpt(fp8="hybrid"), lora=LoRAConfig())


def _fit(lora: LoRAConfig | None, steps: int) -> tuple[MegatronLMModule, list[float], dict]:
    batch = synthetic_tokens(8, 32, 256, seed=4)
    batch[:, 16:] = batch[:, :16]  # learnable: the second half repeats the first
    torch.manual_seed(0)
    module = MegatronLMModule(tiny_gpt(), lr=1e-2, decay_steps=steps, lora=lora)
    losses: list[float] = []
    before: dict = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            before.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=4, seed=11), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, DataLoader(batch.repeat(steps, 1), batch_size=8))
    return module, losses, before


def test_lora_trains_only_the_adapters() -> None:
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    module, losses, before = _fit(lora, steps=8)
    _, base_losses, _ = _fit(None, steps=8)  # the same data order (the sampler shuffles the repeated rows)
    assert losses[0] == pytest.approx(base_losses[0], rel=1e-6)  # B starts at zero: the base model's loss
    assert losses[-1] < losses[0] - 0.2, losses
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable, "no adapter parameters"
    assert all(is_adapter_param(n) for n in trainable), trainable
    # A and B per HF projection (q, k, v, o, gate, up, down: as PEFT) in each of 4 layers
    assert len(trainable) == 2 * 7 * 4
    for name, param in module.named_parameters():
        changed = not torch.equal(param.detach(), before[name])
        assert changed == (name in trainable), name  # the base stays exactly as it was
    optimizer = module.trainer.strategy.optimizers[0]
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert held == sum(module.get_parameter(n).numel() for n in trainable)  # optimizer state for adapters only


def test_adapters_are_seeded_per_layer_and_linear() -> None:
    _, _, before_a = _fit(LoRAConfig(rank=2, seed=5), steps=1)
    _, _, before_b = _fit(LoRAConfig(rank=2, seed=5), steps=1)
    _, _, other = _fit(LoRAConfig(rank=2, seed=6), steps=1)
    names = [n for n in before_a if ".lora_A." in n]
    assert len(names) == 7 * 4
    assert all(torch.equal(before_a[n], before_b[n]) for n in names)  # the same seed: the same adapters
    assert not any(torch.equal(before_a[n], other[n]) for n in names)  # another seed: others
    for i, first in enumerate(names):  # every layer and linear its own draw
        for second in names[i + 1 :]:
            same_shape = before_a[first].shape == before_a[second].shape
            assert not (same_shape and torch.equal(before_a[first], before_a[second])), (first, second)
    assert all(not before_a[n.replace(".lora_A.", ".lora_B.")].any() for n in names)  # B starts at zero


def test_lora_checkpoint_resumes_exactly(tmp_path) -> None:  # noqa: ANN001
    from lightning.pytorch.callbacks import ModelCheckpoint

    batch = synthetic_tokens(32, 32, 256, seed=9)
    lora = LoRAConfig(rank=4, alpha=8.0)

    def run(steps: int, ckpt_path: str | None = None, save: bool = False) -> dict[int, float]:
        torch.manual_seed(0)
        module = MegatronLMModule(tiny_gpt(), lr=1e-2, decay_steps=4, lora=lora)
        losses: dict[int, float] = {}

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
                losses[trainer.global_step] = float(outputs["loss"])

        callbacks = [Record()]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1))
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=4, seed=11), max_steps=steps,
            logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
            enable_checkpointing=save,
        )  # fmt: skip
        trainer.fit(module, DataLoader(batch, batch_size=8), ckpt_path=ckpt_path)
        return losses

    full = run(4, save=True)
    resumed = run(4, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed == {step: full[step] for step in (3, 4)}  # adapters and their optimizer state restored


LORA_RUN = {"lora": {"rank": 4, "alpha": 8.0}, "max_steps": 4, "lr": 5e-2}  # large steps: B far from 0 by step 2


@pytest.fixture(scope="module")
def lora_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.conftest import run_here

    tmp = tmp_path_factory.mktemp("lora")
    one = run_here({**LORA_RUN, "devices": 1, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2}, tmp)
    norm = one["callback_metrics"]["grad_norm"]  # Megatron's norm of the adapters' gradients at the last step
    return {"train": one["train"], "ckpt": str(tmp / "ckpt" / "epoch=0-step=2.ckpt"), "grad_norm": norm}


@pytest.mark.multiprocess
def test_lora_checkpoint_reshards_to_tp2_sp(lora_one_process: dict, tmp_path) -> None:  # noqa: ANN001
    """A one-process LoRA checkpoint (adapters, their optimizer state, the frozen base) resumed at TP=2 + SP,
    where B of column-parallel (gate/up rows of linear_fc1 included) and A of row-parallel linears are sharded,
    continues the one-process curve; with B far from zero, A's tensor-parallel gradients shape steps 3 and 4.
    (TP=2 without SP: test_hf_layouts' adapter-only checkpoint resumed at TP=2.)"""
    from tests.conftest import run_worker

    tp2 = run_worker({**LORA_RUN, "devices": 2, "tp": 2, "sp": True, "resume": lora_one_process["ckpt"]}, tmp_path)
    assert sorted(tp2["train"]) == ["3", "4"]
    for step in ("3", "4"):
        assert tp2["train"][step] == pytest.approx(lora_one_process["train"][step], rel=2e-4), step
    # The gradients themselves: a replicated factor whose per-rank gradient is not summed over TP (column A under
    # SP) would change the norm far more than the two steps' losses.
    assert tp2["callback_metrics"]["grad_norm"] == pytest.approx(lora_one_process["grad_norm"], rel=1e-3)


# ------------------------------------------------------------------------ adapter-only checkpoints (HF base)
def _small_llama(path: Path, seed: int) -> Path:
    """A small Llama whose weights, not the checkpoint format's per-tensor overhead, make a checkpoint's size."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _small_llama(tmp_path_factory.mktemp("base") / "llama", seed=0)


def _hf_fit(module: MegatronLMModule, steps: int, root: Path, ckpt_path: str | None = None) -> dict[int, float]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    samples = torch.randint(0, 128, (4 * 4, 16), generator=torch.Generator().manual_seed(6))
    losses: dict[int, float] = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses[trainer.global_step] = float(outputs["loss"])

    saver = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record(), saver], num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(samples, batch_size=4), ckpt_path=ckpt_path)
    return losses


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_adapter_checkpoints_are_small_resume_exactly_and_load(hf_base: Path, tmp_path: Path) -> None:
    """From HF weights, LoRA checkpoints hold the adapters, their optimizer state and where the base comes from:
    a few % of a full fine-tune's checkpoint; resuming continues the curve; load_from_checkpoint rebuilds the
    module on its base; a module without that base is refused."""
    lora = {"rank": 2, "alpha": 4.0}
    full = _hf_fit(MegatronLMModule.from_hf(hf_base, seq_length=16, lr=5e-2, lora=lora), 4, tmp_path / "lora")
    _hf_fit(MegatronLMModule.from_hf(hf_base, seq_length=16, lr=5e-2), 2, tmp_path / "full")
    adapters, everything = tmp_path / "lora" / "epoch=0-step=2.ckpt", tmp_path / "full" / "epoch=0-step=2.ckpt"
    assert _size(adapters) < 0.1 * _size(everything), (_size(adapters), _size(everything))
    module = MegatronLMModule.from_hf(hf_base, seq_length=16, lr=5e-2, lora=lora)
    resumed = _hf_fit(module, 4, tmp_path / "again", ckpt_path=str(adapters))
    assert resumed == {step: full[step] for step in (3, 4)}
    optimizer = module.trainer.strategy.optimizers[0]
    assert sum(p.numel() for group in optimizer.param_groups for p in group["params"]) == sum(
        p.numel() for n, p in module.named_parameters() if is_adapter_param(n))  # fmt: skip

    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(7))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    want = torch.cat(trainer.predict(module, DataLoader(tokens, batch_size=4)))
    loaded = MegatronLMModule.load_from_checkpoint(tmp_path / "again" / "epoch=0-step=4.ckpt")
    assert loaded.frozen_base() == {"hf": str(hf_base.resolve()), "fingerprint": module.frozen_base()["fingerprint"]}
    got = torch.cat(trainer.predict(loaded, DataLoader(tokens, batch_size=4)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"holds only the trainable weights \(LoRA adapters\) and their optimizer"):
        _hf_fit(MegatronLMModule(loaded.config, lr=5e-2, lora=lora), 4, tmp_path / "x", ckpt_path=str(adapters))
    other = _small_llama(tmp_path / "other", seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match=r"this module's base .* holds other weights"):
        _hf_fit(MegatronLMModule.from_hf(other, seq_length=16, lr=5e-2, lora=lora), 4, tmp_path / "y", str(adapters))
    moved = tmp_path / "moved"  # a copy of the base elsewhere is the same base
    shutil.copytree(hf_base, moved)
    again = _hf_fit(
        MegatronLMModule.from_hf(moved, seq_length=16, lr=5e-2, lora=lora), 4, tmp_path / "z", str(adapters)
    )
    assert again == resumed
    fewer = MegatronLMModule.load_from_checkpoint(adapters, lora={**lora, "target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(ValueError, match=r"holds \d+ trained tensor\(s\) this module has no place for"):
        trainer.predict(fewer, DataLoader(tokens, batch_size=4))


def test_lora_on_a_checkpoint_without_adapters(hf_base: Path, tmp_path: Path) -> None:
    """load_from_checkpoint(full, lora=...): the checkpoint's weights become the frozen base of new adapters (B = 0:
    the checkpoint's logits), and the adapter-only checkpoints then refer to it."""
    _hf_fit(MegatronLMModule.from_hf(hf_base, seq_length=16, lr=5e-2), 2, tmp_path / "full")
    base = tmp_path / "full" / "epoch=0-step=2.ckpt"
    tokens = DataLoader(torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(7)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    want = torch.cat(trainer.predict(MegatronLMModule.load_from_checkpoint(base), tokens))
    module = MegatronLMModule.load_from_checkpoint(base, lora={"rank": 2, "alpha": 4.0})
    torch.testing.assert_close(torch.cat(trainer.predict(module, tokens)), want, rtol=0, atol=0)
    _hf_fit(module, 2, tmp_path / "lora")
    assert module.frozen_base() == {"checkpoint": str(base.resolve())}
    again = MegatronLMModule.load_from_checkpoint(tmp_path / "lora" / "epoch=0-step=2.ckpt")
    assert again.base_checkpoint == str(base.resolve())
    assert again.lora == module.lora
    torch.testing.assert_close(torch.cat(trainer.predict(again, tokens)), torch.cat(trainer.predict(module, tokens)))


def test_value_module_with_lora_trains_the_adapters_and_its_head() -> None:
    from lightning_megatron import MegatronValueModule

    torch.manual_seed(0)
    module = MegatronValueModule(tiny_gpt(), lr=1e-2, lora=LoRAConfig(rank=2, alpha=4.0))
    tokens = synthetic_tokens(16, 32, 256, seed=3)
    data = [{"input_ids": row, "returns": (row % 7).float() / 7} for row in tokens]  # learnable from the token
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=4), max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data * 4, batch_size=8))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    head = {"chunks.0.output_layer.weight", "chunks.0.output_layer.bias"}
    assert {n for n in trainable if not is_adapter_param(n)} == head  # and the adapters (A, B per projection)
    assert len(trainable) == 2 * 7 * 4 + 2
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.gpu
def test_lora_on_gpu_trains_and_exports_merged_weights() -> None:
    """bf16-mixed on one GPU (torch-native kernels, the fused LM head frozen): the loss falls, only the adapters
    move, and the merged export is the base plus each projection's alpha/r B A."""
    lora = LoRAConfig(rank=4, alpha=8.0)
    batch = synthetic_tokens(8, 32, 256, seed=4)
    batch[:, 16:] = batch[:, :16]
    torch.manual_seed(0)
    module = MegatronLMModule(tiny_gpt(kernels="torch"), lr=1e-2, decay_steps=12, lora=lora)
    losses: list[float] = []
    exported: dict[str, dict] = {}

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            exported["before"] = dict(pl_module.export_hf_weights(merged=False))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            exported["merged"] = dict(pl_module.export_hf_weights())
            exported["base"] = dict(pl_module.export_hf_weights(merged=False))
            qkv = pl_module.chunks[0].decoder.layers[0].self_attention.linear_qkv
            exported["q_delta"] = {"q": (qkv.lora_B["q_proj"].float() @ qkv.lora_A["q_proj"].float()) * 2.0}

    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", strategy=MegatronStrategy(micro_batch_size=4),
        max_steps=12, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, DataLoader(batch.repeat(12, 1), batch_size=8))
    assert losses[-1] < losses[0] - 0.2, losses
    assert all(torch.equal(t, exported["before"][n]) for n, t in exported["base"].items())  # the base is frozen
    name = "model.layers.0.self_attn.q_proj.weight"
    delta = exported["merged"][name].float() - exported["base"][name].float()
    assert delta.abs().max() > 0
    torch.testing.assert_close(delta, exported["q_delta"]["q"], rtol=2e-2, atol=2e-2)  # bf16 rounding of W + d
