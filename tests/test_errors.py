"""Bad configurations raise ValueError naming the field and its value, before any process group or model exists."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens

# These tests check that a failing run builds nothing and leaves nothing: start without an earlier run's groups.
pytestmark = pytest.mark.usefixtures("fresh_megatron_state")


def _trainer(strategy: MegatronStrategy, devices: int = 1, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def _assert_nothing_built(model: MegatronLMModule) -> None:
    from megatron.core import parallel_state

    # (A default process group left by an earlier in-process Trainer is Lightning's to keep and reuse.)
    assert not parallel_state.model_parallel_is_initialized()
    assert not hasattr(model, "chunks")


def _fit(trainer: L.Trainer, model: MegatronLMModule, batch_size: int = 4) -> None:
    trainer.fit(model, DataLoader(synthetic_tokens(8, 32, 256), batch_size=batch_size))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pp": 1, "vpp": 2}, r"vpp=2 .*pp=1"),
        ({"tp": 1, "sequence_parallel": True}, r"sequence_parallel=True.*tp=1"),
        ({"tp": 0}, r"tp=0"),
        ({"micro_batch_size": 0}, r"micro_batch_size=0"),
    ],
)
def test_strategy_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MegatronStrategy(**kwargs)


def test_world_size_not_divisible_by_model_parallel_size() -> None:
    # Raised while the Trainer is built: no process was launched, no group created.
    was_initialized = torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"world size 3 .*tp\*pp\*cp = 2\*1\*1 = 2"):
        _trainer(MegatronStrategy(tp=2), devices=3)
    assert torch.distributed.is_initialized() == was_initialized


@pytest.mark.parametrize(
    ("strategy", "config", "match"),
    [
        (dict(tp=1, pp=3), dict(num_layers=4), r"num_layers=4"),
        (dict(pp=2, vpp=3), dict(num_layers=4), r"num_layers=4"),
        (dict(tp=3), dict(num_attention_heads=4, vocab_size=255), r"num_attention_heads=4.*tp=3"),
        (dict(tp=2), dict(num_attention_heads=4, num_query_groups=1), r"num_query_groups=1.*tp=2"),
    ],
)
def test_model_does_not_fit_layout(strategy: dict, config: dict, match: str) -> None:
    # devices=1 cannot hold these layouts either, so check the model against the layout directly
    # through connect(), which runs first in Trainer._run.
    model = MegatronLMModule(tiny_gpt(**config))
    megatron = MegatronStrategy(**strategy)
    trainer = _trainer(MegatronStrategy())
    model.trainer = trainer
    with pytest.raises(ValueError, match=match):
        megatron.connect(model)
    _assert_nothing_built(model)


def test_gradient_clip_val_goes_to_the_optimizer() -> None:
    model = MegatronLMModule(tiny_gpt())
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0.*clip_grad"):
        _fit(_trainer(MegatronStrategy(), gradient_clip_val=1.0), model)
    _assert_nothing_built(model)


def test_batch_not_divisible_by_micro_batch_size() -> None:
    model = MegatronLMModule(tiny_gpt())
    with pytest.raises(ValueError, match=r"batch_size=3 is not divisible by micro_batch_size=2"):
        _fit(_trainer(MegatronStrategy(micro_batch_size=2)), model, batch_size=3)
    # Raised before the first step (the DataLoader is only known once fit() sets up its data).
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()  # torn down cleanly after the error


def test_wrong_module_type() -> None:
    class Plain(L.LightningModule):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return batch.float().sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    with pytest.raises(TypeError, match=r"MegatronLightningModule"):
        _fit(_trainer(MegatronStrategy()), Plain())


def test_a_run_failing_while_its_chunks_are_built_leaves_no_megatron_state(caplog: pytest.LogCaptureFixture) -> None:
    # The groups exist, the chunks do not: teardown must still release Megatron's state, and fail in nothing.
    model = MegatronLMModule(tiny_gpt(kernels="te"))  # Transformer Engine: refused on CPU when the chunks are built
    with pytest.raises(ValueError, match=r"kernels='te'"):
        _fit(_trainer(MegatronStrategy()), model)
    _assert_nothing_built(model)
    assert "teardown after a failed run also failed" not in caplog.text
