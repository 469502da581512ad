"""ModelConfig(cuda_graphs=True): Megatron's per-layer CUDA graphs on the torch-native path.

CPU: the configuration and batch checks. GPU: a run with graphs follows the same run without them (same seed,
same batches), validation and ``trainer.test`` work around the captured graphs, and a second run in the process
captures its own.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.kernels.resolve import use_cuda_graphs
from lightning_megatron.training.guards import check_graphable_batch


def test_cuda_graphs_configuration() -> None:
    config = tiny_gpt(cuda_graphs=True)
    assert config.to_transformer_config().cuda_graph_impl == "local"
    assert tiny_gpt().to_transformer_config().cuda_graph_impl == "none"
    with pytest.raises(ValueError, match=r"cuda_graphs=True with num_moe_experts=4.*cuda_graphs=False"):
        tiny_gpt(cuda_graphs=True, num_moe_experts=4)
    with pytest.raises(ValueError, match=r"ModelConfig\(cuda_graphs=True\).*this run is on cpu.*cuda_graphs=False"):
        use_cuda_graphs(True, "cpu")
    assert use_cuda_graphs(False, "cpu") is False


def test_graphable_batches_have_the_captured_shape() -> None:
    full = torch.zeros(2, 32, dtype=torch.long)
    check_graphable_batch(full, 32)
    check_graphable_batch({"input_ids": full, "labels": full}, 32)
    with pytest.raises(ValueError, match=r"length 16.*seq_length=32.*pad every batch to 32"):
        check_graphable_batch({"input_ids": full[:, :16]}, 32)
    packed = torch.cat([torch.arange(16), torch.arange(16)]).expand(2, 32)
    with pytest.raises(ValueError, match=r"packed position_ids.*cuda_graphs=False"):
        check_graphable_batch({"input_ids": full, "position_ids": packed}, 32)


def test_a_cpu_run_with_cuda_graphs_fails_before_training() -> None:
    module = MegatronLMModule(tiny_gpt(cuda_graphs=True), lr=1e-3)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"cuda_graphs=True.*on cpu"):
        trainer.fit(module, DataLoader(synthetic_tokens(4, 32, 256), batch_size=2))


def _gpu_run(cuda_graphs: bool) -> dict:
    """6 steps on one GPU with validation every 3 steps, then ``trainer.test``: what each step logged."""
    seq, steps = 64, 6
    config = tiny_gpt(kernels="torch", seq_length=seq, hidden_size=128, ffn_hidden_size=256, cuda_graphs=cuda_graphs)
    torch.manual_seed(0)
    module = MegatronLMModule(config, lr=1e-2, decay_steps=steps)
    seen: dict = {"train": [], "val": [], "graphed": False}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            seen["train"].append(float(outputs["loss"]))
            runners = pl_module.chunks[0].decoder.layers[0].cudagraph_manager.cudagraph_runners if cuda_graphs else []
            seen["graphed"] = any(r.fwd_graph is not None and r.bwd_graph is not None for r in runners)

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if not trainer.sanity_checking:
                seen["val"].append(float(trainer.callback_metrics["val_loss"]))

    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", strategy=MegatronStrategy(micro_batch_size=2),
        max_steps=steps, val_check_interval=3, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    rows = synthetic_tokens(4, seq, 256, seed=1)
    rows[:, seq // 2 :] = rows[:, : seq // 2]  # learnable: each row's second half repeats its first
    train = rows.repeat(steps, 1)
    held_out = synthetic_tokens(8, seq, 256, seed=2)
    trainer.fit(module, DataLoader(train, batch_size=4), DataLoader(held_out, batch_size=4))
    seen["test"] = trainer.test(module, DataLoader(held_out, batch_size=4), verbose=False)[0]["test_loss"]
    return seen


@pytest.mark.gpu
def test_cuda_graphs_follow_the_eager_run_on_gpu() -> None:
    eager = _gpu_run(cuda_graphs=False)
    graphed = _gpu_run(cuda_graphs=True)
    again = _gpu_run(cuda_graphs=True)  # a new module in the same process captures its own graphs
    assert graphed["graphed"], graphed
    assert again["graphed"], again
    for run in (graphed, again):
        assert run["train"] == pytest.approx(eager["train"], rel=2e-3), (run, eager)
        assert len(run["val"]) == 2, run
        assert run["val"] == pytest.approx(eager["val"], rel=2e-3), (run, eager)
        assert run["test"] == pytest.approx(eager["test"], rel=2e-3), (run, eager)
    assert eager["train"][-1] < eager["train"][0] - 0.1, eager["train"]  # the runs learn, not only agree
