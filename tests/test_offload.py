"""strategy.offload() / reload(): memory is released and training continues bit-identically."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens


class OffloadEveryStep(L.Callback):
    """Offload after every optimizer step and reload before the next one, checking that memory was released."""

    def __init__(self) -> None:
        self.released: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))
        if self.released is None:
            return
        strategy = trainer.strategy
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        self.released.append(strategy.offload(params=True, grads=True, optimizer=True))
        param = next(pl_module.parameters())
        assert param.untyped_storage().nbytes() == 0  # really freed, not just copied
        if torch.cuda.is_available():
            assert torch.cuda.memory_allocated() < before - self.released[-1] // 2
        strategy.reload()


class Plain(OffloadEveryStep):
    def __init__(self) -> None:
        super().__init__()
        self.released = None  # type: ignore[assignment]


def _run(callback: L.Callback, accelerator: str = "cpu") -> None:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=MegatronStrategy(micro_batch_size=4, seed=3), max_steps=4,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback],
    )  # fmt: skip
    data = synthetic_tokens(32, 32, 256, seed=4)
    trainer.fit(MegatronLMModule(tiny_gpt(), lr=3e-3, decay_steps=4), DataLoader(data, batch_size=8))


def test_offload_round_trip_keeps_training_identical() -> None:
    plain, offloaded = Plain(), OffloadEveryStep()
    _run(plain)
    _run(offloaded)
    assert offloaded.losses == plain.losses  # bit-identical
    # params (fp32) + Adam's two moments + grads: at least 4 bytes x 4 copies of ~197k parameters
    assert min(offloaded.released) > 4 * 4 * 190_000


def test_offload_twice_is_an_error() -> None:
    strategy = MegatronStrategy()
    strategy._offload.record = object()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="offload called twice"):
        strategy.offload()
    with pytest.raises(RuntimeError, match="reload called without"):
        MegatronStrategy().reload()


def test_offload_refused_under_cuda_graphs_keeps_the_fp8_weight_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured graphs replay into the kept fp8 casts' addresses: offload() refuses before dropping them, and the
    teardown (graphs released by then) drops them."""
    from lightning_megatron.kernels import fp8
    from lightning_megatron.training import graphs

    forgotten: list[int] = []
    monkeypatch.setattr(graphs, "in_use", lambda chunks: True)  # as after a capture (CPU runs have no graphs)

    def count(modules: list[torch.nn.Module]) -> None:
        forgotten.append(sum(len(list(m.parameters())) for m in modules))

    monkeypatch.setattr(fp8, "forget_weight_casts", count)

    class Refused(Plain):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            with pytest.raises(RuntimeError, match=r"offload\(\) with ModelConfig\(cuda_graphs=True\)"):
                trainer.strategy.offload()
            assert not forgotten
            self.losses.append(float(outputs["loss"]))
            self.model = pl_module

    refused = Refused()
    _run(refused)
    assert len(refused.losses) == 4
    assert len(forgotten) == 1  # at teardown, every parameter of the model
    assert forgotten[0] == len(list(refused.model.parameters()))


@pytest.mark.gpu(devices=1)
def test_offload_releases_gpu_memory() -> None:
    plain, offloaded = Plain(), OffloadEveryStep()
    _run(plain, "gpu")
    _run(offloaded, "gpu")
    assert offloaded.losses == plain.losses


class OffloadOptimizerOnly(OffloadEveryStep):
    """params=False must keep the weights readable even where the optimizer's main params are views of them."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))
        before = [p.detach().clone() for p in pl_module.parameters()]
        self.released.append(trainer.strategy.offload(params=False, grads=True, optimizer=True))
        for saved, param in zip(before, pl_module.parameters(), strict=True):
            assert torch.equal(saved, param.detach())  # still there, unchanged
        trainer.strategy.reload()


def test_offload_optimizer_only_keeps_weights_and_training_identical() -> None:
    plain, offloaded = Plain(), OffloadOptimizerOnly()
    _run(plain)
    _run(offloaded)
    assert offloaded.losses == plain.losses
    assert min(offloaded.released) > 0
