"""LoRA (lightning_megatron.lora): configuration errors, frozen base, seeded adapters, training at one process.
(TP=2 + SP and PP=2 against one process, from HF weights: tests/test_hf.py.)"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import LoRAConfig, MegatronLMModule, MegatronStrategy, SaveHF, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens


def test_lora_config_errors() -> None:
    with pytest.raises(ValueError, match=r"rank=0 must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"unknown \['q_proj'\]; pick from \['linear_qkv', 'linear_fc1'"):
        LoRAConfig(target_modules=("q_proj",))
    with pytest.raises(ValueError, match=r"alpha=0"):
        LoRAConfig(alpha=0)
    with pytest.raises(ValueError, match=r"adapters on experts are not supported"):
        MegatronLMModule(tiny_gpt(num_moe_experts=4), lora=LoRAConfig())
    assert LoRAConfig(target_modules=["linear_qkv"]).target_modules == ("linear_qkv",)  # YAML lists
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        LoRAConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"fp8='hybrid'\): the adapted linears run in bf16"):
        MegatronLMModule(tiny_gpt(fp8="hybrid"), lora=LoRAConfig())
    module = MegatronLMModule(tiny_gpt(), lora=LoRAConfig())
    with pytest.raises(NotImplementedError, match=r"SaveHF of a LoRA module"):
        SaveHF("unused").setup(None, module, "fit")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"HF export of a LoRA module"):
        module.export_hf_weights()  # not the base without its adapters
    with pytest.raises(NotImplementedError, match=r"HF export of a LoRA module"):
        module.save_hf("unused")


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
    assert all(n.endswith(("lora_A", "lora_B")) for n in trainable), trainable
    assert len(trainable) == 2 * 4 * 4  # A and B of 4 linears in each of 4 layers
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
    names = [n for n in before_a if n.endswith("lora_A")]
    assert len(names) == 16
    assert all(torch.equal(before_a[n], before_b[n]) for n in names)  # the same seed: the same adapters
    assert not any(torch.equal(before_a[n], other[n]) for n in names)  # another seed: others
    for i, first in enumerate(names):  # every layer and linear its own draw
        for second in names[i + 1 :]:
            same_shape = before_a[first].shape == before_a[second].shape
            assert not (same_shape and torch.equal(before_a[first], before_a[second])), (first, second)
    assert all(not before_a[n.replace("lora_A", "lora_B")].any() for n in names)  # B starts at zero


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
    from tests.conftest import run_worker

    tmp = tmp_path_factory.mktemp("lora")
    one = run_worker({**LORA_RUN, "devices": 1, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2}, tmp)
    return {"train": one["train"], "ckpt": str(tmp / "ckpt" / "epoch=0-step=2.ckpt")}


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_lora_checkpoint_reshards_to_tp2(sp: bool, lora_one_process: dict, tmp_path) -> None:  # noqa: ANN001
    """A one-process LoRA checkpoint (adapters, their optimizer state, the frozen base) resumed at TP=2 (+ SP),
    where B of column-parallel (gate/up rows of linear_fc1 included) and A of row-parallel linears are sharded,
    continues the one-process curve; with B far from zero, A's tensor-parallel gradients shape steps 3 and 4."""
    from tests.conftest import run_worker

    tp2 = run_worker({**LORA_RUN, "devices": 2, "tp": 2, "sp": sp, "resume": lora_one_process["ckpt"]}, tmp_path)
    assert sorted(tp2["train"]) == ["3", "4"]
    for step in ("3", "4"):
        assert tp2["train"][step] == pytest.approx(lora_one_process["train"][step], rel=2e-4), step
