"""ModelConfig(cuda_graphs=True): Megatron's per-layer CUDA graphs on the torch-native path.

CPU: the configuration and batch checks. GPU: a run with graphs follows the same run without them (same seed,
same batches), validation and ``trainer.test`` work around the captured graphs, and a second run in the process
captures its own.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ParallelSizes, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.gpt.plan import use_cuda_graphs
from lightning_megatron.training import graphs
from lightning_megatron.training.guards import check_graphable_batch
from lightning_megatron.training.offload import offload


def test_cuda_graphs_configuration() -> None:
    config = tiny_gpt(cuda_graphs=True)
    assert config.to_transformer_config().cuda_graph_impl == "local"
    assert tiny_gpt().to_transformer_config().cuda_graph_impl == "none"
    config.validate_parallel(ParallelSizes(tp=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"cuda_graphs=True with num_moe_experts=4.*cuda_graphs=False"):
        tiny_gpt(cuda_graphs=True, num_moe_experts=4)
    with pytest.raises(ValueError, match=r"cuda_graphs=True with hidden_dropout=0.1.*replay their dropout"):
        tiny_gpt(cuda_graphs=True, hidden_dropout=0.1)
    with pytest.raises(ValueError, match=r"cuda_graphs=True with recompute_granularity='selective'"):
        tiny_gpt(cuda_graphs=True, recompute_granularity="selective")
    for sizes, name in ((ParallelSizes(pp=2), "pp=2"), (ParallelSizes(cp=2), "cp=2")):
        with pytest.raises(ValueError, match=rf"cuda_graphs=True\) with {name}.*cuda_graphs=False"):
            config.validate_parallel(sizes)
    with pytest.raises(ValueError, match=r"ModelConfig\(cuda_graphs=True\).*this run is on cpu.*cuda_graphs=False"):
        use_cuda_graphs(True, "cpu")
    assert use_cuda_graphs(False, "cpu") is False


def test_graph_state_helpers_leave_chunks_without_graphs_alone() -> None:
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not graphs.in_use([chunk])
    graphs.renew([chunk])
    graphs.release([chunk])  # nothing to release: no CUDA call either (this runs on CPU)


def test_offload_refuses_captured_graphs() -> None:
    chunk = torch.nn.Linear(2, 2)
    chunk.cudagraph_manager = SimpleNamespace(cudagraph_runners=["a recorded runner"])  # as Megatron's layers hold
    assert graphs.in_use([chunk])
    with pytest.raises(RuntimeError, match=r"offload\(\) with ModelConfig\(cuda_graphs=True\).*device addresses"):
        offload([chunk], None, params=True, grads=True, optimizer_state=True)


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


def _trainer(steps: int, record: L.Callback) -> L.Trainer:
    return L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", strategy=MegatronStrategy(micro_batch_size=2),
        max_steps=steps, val_check_interval=3, limit_val_batches=2, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )  # fmt: skip


def _gpu_run(cuda_graphs: bool, fail_at: int | None = None, fp8: str | None = None) -> dict:
    """6 steps on one GPU with validation every 3 steps, ``trainer.test``, then a second fit of the same module (3
    steps): what each step logged, and whether the layers held captured graphs. ``fail_at``: that step's batch is
    too short, and the run fails there."""
    seq, steps = 64, 6
    config = tiny_gpt(
        kernels="torch", seq_length=seq, hidden_size=128, ffn_hidden_size=256, cuda_graphs=cuda_graphs, fp8=fp8
    )
    torch.manual_seed(0)
    module = MegatronLMModule(config, lr=1e-2, decay_steps=2 * steps)
    seen: dict = {"train": [], "norm": [], "val": [], "graphed": []}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            seen["train"].append(float(outputs["loss"]))
            seen["norm"].append(float(trainer.callback_metrics["grad_norm"]))
            seen["graphed"].append(_captured(pl_module.chunks))

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if not trainer.sanity_checking:
                seen["val"].append(float(trainer.callback_metrics["val_loss"]))

    rows = synthetic_tokens(4, seq, 256, seed=1)
    rows[:, seq // 2 :] = rows[:, : seq // 2]  # learnable: each row's second half repeats its first
    train = list(rows.repeat(steps, 1))
    if fail_at is not None:
        for i in range(4 * fail_at, 4 * fail_at + 4):
            train[i] = train[i][: seq // 2]
    held_out = synthetic_tokens(8, seq, 256, seed=2)
    loader = DataLoader(train, batch_size=4, collate_fn=_pad_to_each_batch)
    _trainer(steps, Record()).fit(module, loader, DataLoader(held_out, batch_size=4))
    seen["test"] = _trainer(steps, Record()).test(module, DataLoader(held_out, batch_size=4), verbose=False)[0]
    _trainer(steps // 2, Record()).fit(module, DataLoader(list(rows.repeat(steps // 2, 1)), batch_size=4))
    return seen


def _captured(chunks: torch.nn.ModuleList) -> bool:
    """Every transformer layer holds a captured forward and backward graph."""
    return all(
        hasattr(layer, "cudagraph_manager")
        and any(r.fwd_graph is not None and r.bwd_graph is not None for r in layer.cudagraph_manager.cudagraph_runners)
        for chunk in chunks
        for layer in chunk.decoder.layers
    )


def _pad_to_each_batch(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack rows, each batch as long as its longest row (a short batch stays short)."""
    length = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, length - len(r))) for r in rows])


@pytest.mark.gpu
def test_cuda_graphs_follow_the_eager_run_on_gpu() -> None:
    eager = _gpu_run(cuda_graphs=False)
    graphed = _gpu_run(cuda_graphs=True)
    # A run that fails after its graphs were captured (a short batch at step 4) leaves no graph state behind:
    # the next run, with a new module, captures its own.
    with pytest.raises(ValueError, match=r"length 32.*cuda_graphs=True"):
        _gpu_run(cuda_graphs=True, fail_at=3)
    again = _gpu_run(cuda_graphs=True)
    assert not any(eager["graphed"])
    for run in (graphed, again):
        # Captured at the end of each fit's first step, replayed after; the second fit of the module captures too.
        assert run["graphed"] == [True] * 9, run["graphed"]
        assert run["train"] == pytest.approx(eager["train"], rel=2e-3), (run, eager)
        assert run["norm"] == pytest.approx(eager["norm"], rel=2e-3), (run, eager)
        assert len(run["val"]) == 2, run
        assert run["val"] == pytest.approx(eager["val"], rel=2e-3), (run, eager)
        assert run["test"]["test_loss"] == pytest.approx(eager["test"]["test_loss"], rel=2e-3), (run, eager)
    assert eager["train"][5] < eager["train"][0] - 0.1, eager["train"]  # the runs learn, not only agree


@pytest.mark.gpu
def test_fp8_cuda_graphs_follow_the_fp8_eager_run_on_gpu() -> None:
    """fp8 in the graphs: the weights' casts are recorded with a device flag; each step's first micro-batch casts,
    the second one's replay skips the cast and reuses it (kernels/fp8.py), as the eager run does on the host."""
    from lightning_megatron.kernels.fp8 import fp8_supported

    if not fp8_supported(torch.device("cuda")):
        pytest.skip("fp8 needs a GPU of compute capability >= 8.9")
    eager = _gpu_run(cuda_graphs=False, fp8="hybrid")
    graphed = _gpu_run(cuda_graphs=True, fp8="hybrid")
    assert graphed["graphed"] == [True] * 9, graphed["graphed"]
    assert graphed["train"] == pytest.approx(eager["train"], rel=2e-3), (graphed, eager)
    assert graphed["val"] == pytest.approx(eager["val"], rel=2e-3), (graphed, eager)
    assert graphed["test"]["test_loss"] == pytest.approx(eager["test"]["test_loss"], rel=2e-3), (graphed, eager)
    assert eager["train"][5] < eager["train"][0] - 0.1, eager["train"]
