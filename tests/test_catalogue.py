"""The bad-input catalogue: every invalid configuration raises ValueError/TypeError naming the field, the value and
what would work; configuration errors come before any process group or model exists.

Each case is ``(make, error, match)``: ``make()`` must raise ``error`` whose message matches ``match``.
``FIT_CASES`` need a model and data, so they raise when ``fit`` starts (after setup, before the first step).
Checkpoint cases (another shape, damaged or unfinished files) are in ``test_reliability.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import (
    MegatronLightningModule,
    MegatronLMModule,
    MegatronStrategy,
    ModelConfig,
    ParallelSizes,
    tiny_gpt,
)
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.parallel import state as parallel_state
from lightning_megatron.training.guards import check_token_batch

# These tests check that a failing run builds nothing and leaves nothing: start without an earlier run's groups.
pytestmark = pytest.mark.usefixtures("fresh_megatron_state")


def _trainer(strategy: MegatronStrategy | None = None, devices: int = 1, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy or MegatronStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def _fit(trainer: L.Trainer | None = None, data: object = None, batch_size: int = 4, **model: object) -> None:
    loader = DataLoader(synthetic_tokens(8, 32, 256) if data is None else data, batch_size=batch_size)
    (trainer or _trainer()).fit(MegatronLMModule(tiny_gpt(**model)), loader)


def _layout(config: dict, **sizes: object) -> Callable[[], None]:
    return lambda: tiny_gpt(**config).validate_parallel(ParallelSizes(**sizes))


def _batch(**fields: torch.Tensor) -> Callable[[], None]:
    ids = synthetic_tokens(2, 32, 256)
    return lambda: check_token_batch({"input_ids": ids, **fields}, vocab_size=256, seq_length=32)


class _TupleData(L.LightningDataModule):
    """Yields (ids,) tuples and makes them dicts in its own on_before_batch_transfer, ending with the module's (as the
    README advises), so the module's host checks still run."""

    def __init__(self, ids: torch.Tensor) -> None:
        super().__init__()
        self.ids = ids

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.TensorDataset(self.ids), batch_size=4)

    def on_before_batch_transfer(self, batch: object, dataloader_idx: int) -> object:
        batch = {"input_ids": batch[0]}
        return self.trainer.lightning_module.on_before_batch_transfer(batch, dataloader_idx)


def _fit_empty() -> None:
    loader = DataLoader(synthetic_tokens(3, 32, 256), batch_size=4, drop_last=True)
    _trainer().fit(MegatronLMModule(tiny_gpt()), loader)


IDS = synthetic_tokens(2, 32, 256)


def _overlap_gather() -> object:
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(overlap_param_gather=True)


CASES = [
    # --- strategy arguments (raised by the constructor)
    pytest.param(lambda: MegatronStrategy(tp=0), ValueError, r"tp=0 must be a positive integer", id="tp zero"),
    pytest.param(lambda: MegatronStrategy(pp=True), ValueError, r"pp=True must be a positive integer", id="pp bool"),
    pytest.param(
        lambda: MegatronStrategy(vpp=2), ValueError, r"vpp=2 needs pipeline.*pp=1.*pp>=2", id="vpp without pp"
    ),
    pytest.param(lambda: MegatronStrategy(pp=2, vpp=0), ValueError, r"vpp=0 must be None or a positive", id="vpp zero"),
    pytest.param(
        lambda: MegatronStrategy(pp=2, vpp=1), ValueError, r"vpp=1 is one model chunk.*vpp=None", id="vpp one"
    ),
    pytest.param(
        lambda: MegatronStrategy(sequence_parallel=True),
        ValueError,
        r"sequence_parallel=True.*tp=1.*tp>=2",
        id="sp with tp=1",
    ),
    pytest.param(
        lambda: MegatronStrategy(micro_batch_size=0), ValueError, r"micro_batch_size=0 must be", id="micro batch zero"
    ),
    pytest.param(
        lambda: MegatronStrategy(ddp_config=_overlap_gather(), use_distributed_optimizer=False),
        ValueError,
        r"overlap_param_gather=True needs use_distributed_optimizer=True",
        id="param-gather overlap without distributed optimizer",
    ),
    pytest.param(
        lambda: tiny_gpt(kernels="flash"), ValueError, r"kernels='flash'.*'auto', 'torch', 'te', 'local'", id="kernels"
    ),
    pytest.param(
        lambda: MegatronStrategy(nonfinite="warn"),
        ValueError,
        r"nonfinite='warn'.*'error'.*'skip'",
        id="nonfinite policy",
    ),
    # --- ModelConfig (raised by the dataclass)
    pytest.param(
        lambda: tiny_gpt(num_layers=0), ValueError, r"num_layers=0 must be a positive integer", id="layers zero"
    ),
    pytest.param(
        lambda: tiny_gpt(num_attention_heads=6),
        ValueError,
        r"hidden_size=64.*num_attention_heads=6.*pick",
        id="head dim",
    ),
    pytest.param(
        lambda: tiny_gpt(num_query_groups=3), ValueError, r"num_query_groups=3.*\[1, 2, 4\]", id="query groups"
    ),
    pytest.param(
        lambda: tiny_gpt(hidden_dropout=1.0), ValueError, r"hidden_dropout=1\.0 must be in \[0, 1\)", id="dropout"
    ),
    pytest.param(
        lambda: tiny_gpt(activation="relu"),
        ValueError,
        r"activation='relu'.*\['silu', 'gelu', 'gelu_tanh', 'quick_gelu'\]",
        id="activation",
    ),
    pytest.param(
        lambda: tiny_gpt(num_moe_experts=4, moe_router_topk=8),
        ValueError,
        r"moe_router_topk=8.*num_moe_experts=4",
        id="topk > experts",
    ),
    pytest.param(
        lambda: tiny_gpt(num_moe_experts=4, moe_router_topk=2, add_bias_linear=True, kernels="te"),
        ValueError,
        r"kernels='te' with experts that have biases .* use kernels='torch' or 'auto'",
        id="biased experts on te",
    ),
    pytest.param(
        lambda: ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2),
        TypeError,
        r"vocab_size",
        id="missing field",
    ),
    # --- the model against the layout (raised in connect(), before any group)
    pytest.param(
        _layout({}, tp=8), ValueError, r"num_attention_heads=4 must be divisible by tp=8.*\[1, 2, 4\]", id="heads / tp"
    ),
    pytest.param(
        _layout({"vocab_size": 250}, tp=4), ValueError, r"vocab_size=250.*tp=4.*pad vocab_size to 252", id="vocab / tp"
    ),
    pytest.param(
        _layout({"num_layers": 6}, pp=2, vpp=2),
        ValueError,
        r"num_layers=6.*pp\*vpp=2\*2=4.*\[4, 8\]",
        id="layers / pp*vpp",
    ),
    pytest.param(
        _layout({"num_moe_experts": 6}, ep=4), ValueError, r"num_moe_experts=6.*ep=4.*\[1, 2, 3, 6\]", id="ep / experts"
    ),
    pytest.param(_layout({}, ep=2), ValueError, r"ep=2 needs an MoE model.*num_moe_experts=None", id="ep on dense"),
    pytest.param(
        _layout({"seq_length": 30}, cp=2),
        ValueError,
        r"seq_length=30 must be divisible by 4.*cp=2.*seq_length=32",
        id="cp seq / 2cp",
    ),
    pytest.param(
        _layout({"seq_length": 30}, tp=4, sequence_parallel=True),
        ValueError,
        r"seq_length=30.*divisible by 4.*32",
        id="sp seq / tp",
    ),
    pytest.param(
        _layout({"kernels": "local"}, cp=2), ValueError, r"cp=2 with kernels='local'.*kernels='torch'", id="cp local"
    ),
    pytest.param(
        _layout({"num_moe_experts": 4, "moe_enable_routing_replay": True}, cp=2),
        ValueError,
        r"cp=2 with moe_enable_routing_replay=True.*use cp=1",
        id="cp routing replay",
    ),
    # --- the world against the layout (raised when the Trainer is built)
    pytest.param(
        lambda: _trainer(MegatronStrategy(tp=2), devices=3),
        ValueError,
        r"world size 3.*tp\*pp\*cp = 2\*1\*1 = 2.*\[1, 3\]",
        id="world / tp",
    ),
    pytest.param(
        lambda: _trainer(MegatronStrategy(ep=4), devices=2),
        ValueError,
        r"world size 2.*tp\*pp\*ep = 1\*1\*4.*\[1, 2\]",
        id="world / ep",
    ),
    # --- Trainer arguments (raised in connect(), before any group)
    pytest.param(
        lambda: MegatronStrategy(check_batches="yes"),  # type: ignore[arg-type]
        ValueError,
        r"check_batches='yes'.*True.*False",
        id="check_batches",
    ),
    pytest.param(
        lambda: _fit(_trainer(gradient_clip_val=1.0)),
        ValueError,
        r"gradient_clip_val=1\.0.*clip_grad",
        id="clip on Trainer",
    ),
    pytest.param(
        lambda: _fit(_trainer(precision="64-true")),
        ValueError,
        r"precision='64-true'.*\['32-true', 'bf16-mixed', '16-mixed'\]",
        id="precision",
    ),
    pytest.param(
        lambda: _trainer().fit(L.LightningModule()),
        TypeError,
        r"MegatronLightningModule.*got LightningModule",
        id="module type",
    ),
    pytest.param(lambda: MegatronLMModule(tiny_gpt(), lr=0), ValueError, r"lr=0 must be positive", id="module lr"),
    pytest.param(
        lambda: MegatronLMModule(tiny_gpt(), prediction="probs"),
        ValueError,
        r"prediction='probs'",
        id="module prediction",
    ),
    # --- data (raised on the host before the batch moves to the device: guards.check_token_batch)
    pytest.param(
        _batch(input_ids=IDS.float()),
        TypeError,
        r"input_ids is a tensor of dtype torch\.float32.*integer",
        id="float token ids",
    ),
    pytest.param(
        _batch(input_ids=IDS.clone().fill_(256)),
        ValueError,
        r"input_ids.*outside \[0, 256\), e\.g\. 256.*vocab_size",
        id="token id >= vocab",
    ),
    pytest.param(
        _batch(input_ids=IDS.clone().fill_(-3)),
        ValueError,
        r"input_ids.*outside \[0, 256\), e\.g\. -3",
        id="negative token id",
    ),
    pytest.param(
        _batch(input_ids=synthetic_tokens(2, 40, 256)),
        ValueError,
        r"length 40, longer than ModelConfig\(seq_length=32\)",
        id="too long",
    ),
    pytest.param(
        _batch(labels=IDS.clone().fill_(300)),
        ValueError,
        r"labels.*outside \[0, 256\) or -100.*e\.g\. 300",
        id="labels range",
    ),
    pytest.param(
        _batch(labels=IDS[:, :16]),
        ValueError,
        r"labels has shape \(2, 16\).*input_ids has \(2, 32\)",
        id="labels shape",
    ),
    pytest.param(
        lambda: check_token_batch({"input_ids": IDS[0]}, 256, 32),
        ValueError,
        r"input_ids has shape \(32,\).*\[batch, sequence\]",
        id="1-d input_ids",
    ),
]
FIT_CASES = [
    # --- data through a real fit (the same checks, wired into the Trainer)
    pytest.param(
        lambda: _fit(data=synthetic_tokens(8, 32, 256).float()),
        TypeError,
        r"input_ids is a tensor of dtype torch\.float32",
        id="fit float ids",
    ),
    pytest.param(
        lambda: _fit(_trainer(MegatronStrategy(micro_batch_size=2)), batch_size=3),
        ValueError,
        r"batch_size=3 is not divisible by micro_batch_size=2",
        id="fit micro batch",
    ),
    pytest.param(
        lambda: _trainer().fit(MegatronLMModule(tiny_gpt()), datamodule=_TupleData(IDS.repeat(2, 1).fill_(300))),
        ValueError,
        r"input_ids.*outside \[0, 256\), e\.g\. 300",
        id="fit datamodule hook",
    ),
    pytest.param(
        lambda: _fit(_trainer(MegatronStrategy(micro_batch_size=2)), data=synthetic_tokens(9, 32, 256)),
        ValueError,
        r"last batch would hold 1 samples \(9 samples on this rank, batch_size=4, drop_last=False\).*"
        r"micro_batch_size=2; for training pass drop_last=True",
        id="fit last batch",
    ),
    pytest.param(
        _fit_empty,
        ValueError,
        r"training DataLoader has no batches.*3 samples, batch_size=4, drop_last=True",
        id="fit empty loader",
    ),
]


def test_catalogue_size() -> None:
    print(f"bad-input catalogue: {len(CASES) + len(FIT_CASES)} cases")
    assert len(CASES) + len(FIT_CASES) >= 30
    ids = [case.id for case in CASES + FIT_CASES]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("make", "error", "match"), CASES)
def test_invalid_configuration(
    make: Callable[[], object], error: type[Exception], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was built before the error")

    # Configuration errors come before Megatron's groups or any model chunk exist.
    monkeypatch.setattr(parallel_state, "initialize", built)
    monkeypatch.setattr(MegatronLightningModule, "configure_model", built)
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(("make", "error", "match"), FIT_CASES)
def test_invalid_data_at_fit(make: Callable[[], object], error: type[Exception], match: str) -> None:
    from megatron.core import parallel_state

    with pytest.raises(error, match=match):
        make()  # raised when fit sets up its data or on the host before the first batch reaches the model
    assert not parallel_state.model_parallel_is_initialized()  # what was built is torn down
