"""Weight averaging on the sharded model (``MegatronEMA``, ``MegatronWeightAveraging``, Lightning's own callbacks
adopted at connect) and the LightningModule's state beside its chunks, in one process.

(Both at TP=2, PP=2 and DP=2 resumed from a one-process checkpoint: ``tests/test_layouts.py``.)
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from torch.utils.data import DataLoader

from lightning_megatron import MegatronEMA, MegatronLMModule, MegatronWeightAveraging, ModelConfig, tiny_gpt
from tests.tiny_gpt_runs import DATA, tiny_trainer

VAL = DataLoader(DATA[:8], batch_size=8)


class Snapshots(L.Callback):
    """The weights after each optimizer step (fp32 copies), and ``val_loss`` of each validation after training began."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.val: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.weights.append({n: p.detach().float().clone() for n, p in pl_module.chunks[0].named_parameters()})

    def on_validation_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if not trainer.sanity_checking:
            self.val[trainer.global_step] = float(trainer.callback_metrics["val_loss"])


def _fit(
    averaging: L.Callback, *callbacks: L.Callback, steps: int = 4, ckpt_path: str | None = None, **kwargs: object
) -> tuple[Snapshots, MegatronLMModule]:
    snapshots, model = Snapshots(), MegatronLMModule(tiny_gpt(), decay_steps=8)
    trainer = tiny_trainer(
        steps, callbacks=[snapshots, averaging, *callbacks],
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        limit_val_batches=1, val_check_interval=2, **kwargs,
    )  # fmt: skip
    trainer.fit(model, DataLoader(DATA, batch_size=8), val_dataloaders=VAL, ckpt_path=ckpt_path)
    return snapshots, model


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[name].float() - b[name].float()).abs().max()) for name in a)


def test_ema_equals_the_average_computed_by_hand_and_ends_as_the_model() -> None:
    ema = MegatronEMA(decay=0.5)
    snapshots, model = _fit(ema, precision="32-true")
    by_hand = dict(snapshots.weights[0])  # the first update copies the weights, as AveragedModel's
    for weights in snapshots.weights[1:]:
        by_hand = {name: 0.5 * by_hand[name] + 0.5 * weights[name] for name in weights}
    assert ema.average is not None
    assert ema.average.num_averaged == 4
    assert _max_difference(ema.average.averages[0], by_hand) < 1e-7
    assert _max_difference(snapshots.weights[-1], by_hand) > 1e-5  # the average is not the last weights
    final = {name: p.detach() for name, p in model.chunks[0].named_parameters()}
    assert _max_difference(final, by_hand) < 1e-7  # the model ends as the average (Lightning's on_train_end)


def test_the_average_resumes_exactly_validates_in_place_of_the_weights_and_loads_as_the_model(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    full, _ = _fit(MegatronEMA(decay=0.5), saver)
    resumed_ema = MegatronEMA(decay=0.5)
    resumed, _ = _fit(resumed_ema, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert resumed.val == {4: full.val[4]}  # validation ran on the average, resumed exactly
    # Plain validation of the last weights gives another loss: validation did use the average.
    plain, _ = _fit(L.Callback(), ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert plain.val[4] != full.val[4]
    # load_from_checkpoint builds the model with the checkpoint's averaged weights (Lightning's WeightAveraging saves
    # them as the checkpoint's state_dict): its validation loss is the average's.
    module = MegatronLMModule.load_from_checkpoint(tmp_path / "step=4.ckpt")
    (metrics,) = tiny_trainer().validate(module, VAL, verbose=False)
    assert metrics["val_loss"] == pytest.approx(full.val[4], rel=1e-6)


def test_lightnings_ema_callback_is_adopted_with_its_settings_and_rule() -> None:
    lightning_ema = EMAWeightAveraging(decay=0.5, update_starting_at_step=2)
    trainer = tiny_trainer(4, callbacks=[lightning_ema], precision="32-true")
    snapshots = Snapshots()
    trainer.callbacks.insert(0, snapshots)
    trainer.fit(MegatronLMModule(tiny_gpt(), decay_steps=8), DataLoader(DATA, batch_size=8))
    (adopted,) = [c for c in trainer.callbacks if isinstance(c, WeightAveraging)]
    assert type(adopted) is MegatronWeightAveraging  # put in place of Lightning's at connect
    assert adopted.average is not None
    assert adopted.average.decay == 0.5  # Lightning's EMA function, updated in place
    by_hand = dict(snapshots.weights[2])  # should_update from step_idx 2 on: its first update copies step 3's weights
    by_hand = {name: 0.5 * by_hand[name] + 0.5 * snapshots.weights[3][name] for name in by_hand}
    assert adopted.average.num_averaged == 2
    assert _max_difference(adopted.average.averages[0], by_hand) < 1e-7


def test_the_equal_weight_average_is_the_mean_of_the_updates() -> None:
    swa = MegatronWeightAveraging()
    snapshots, _ = _fit(swa, precision="32-true")
    mean = {name: torch.stack([w[name] for w in snapshots.weights]).mean(0) for name in snapshots.weights[0]}
    assert swa.average is not None
    assert _max_difference(swa.average.averages[0], mean) < 1e-6


class OwnHook(WeightAveraging):
    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        pass


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (StochasticWeightAveraging(swa_lrs=0.01), r"StochasticWeight.* not supported .*MegatronWeightAveraging\(\)"),
        (OwnHook(), r"OwnHook overrides on_train_epoch_start .* subclass lightning_megatron\.MegatronWeightAveraging"),
    ],
    ids=["swa", "subclass-with-hooks"],
)  # fmt: skip
def test_weight_averaging_that_cannot_work_is_refused_at_connect(callback: L.Callback, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        tiny_trainer(2, callbacks=[callback]).fit(MegatronLMModule(tiny_gpt()), DataLoader(DATA, batch_size=8))


# ---------------------------------------------------------------------------------------------- module state
class WithState(MegatronLMModule):
    """A step counter and a small head of its own beside the chunks, both changed at every training step."""

    def __init__(self, config: ModelConfig | None = None, decay_steps: int = 8, **kwargs: object) -> None:
        super().__init__(config or tiny_gpt(), decay_steps=decay_steps, **kwargs)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))
        self.head = torch.nn.Linear(2, 2).requires_grad_(False)  # frozen: Megatron's optimizer trains the chunks only
        self.at_start: dict[str, torch.Tensor] = {}

    def on_train_start(self) -> None:  # after a resume restored the checkpoint
        self.at_start = {name: value.clone() for name, value in self.state_dict().items() if "chunks." not in name}

    def on_train_batch_start(self, batch, batch_idx) -> None:  # noqa: ANN001  (before that step's checkpoint)
        self.steps_seen += 1
        with torch.no_grad():
            self.head.weight.add_(0.5)


def _own_state(module: MegatronLMModule) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items() if not name.startswith("chunks.")}


def test_the_modules_own_state_survives_resume_and_load_from_checkpoint(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    first = WithState()
    trainer = tiny_trainer(2, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(first, DataLoader(DATA, batch_size=8))
    saved = _own_state(first)
    assert int(saved["steps_seen"]) == 2
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)

    resumed = WithState()
    tiny_trainer(4).fit(resumed, DataLoader(DATA, batch_size=8), ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert sorted(resumed.at_start) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(resumed.at_start[name], value), name  # restored before training went on
    assert int(resumed.steps_seen) == 4

    for path in ("step=2.ckpt", "weights.ckpt"):  # full and weights-only: restored when the chunks are built
        loaded = WithState.load_from_checkpoint(tmp_path / path)
        tiny_trainer().validate(loaded, VAL, verbose=False)
        assert all(torch.equal(_own_state(loaded)[name], value) for name, value in saved.items()), path


def test_a_checkpoint_without_the_modules_own_state_is_refused_unless_loading_is_not_strict(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, filename="plain", every_n_train_steps=2)
    tiny_trainer(2, callbacks=[saver], enable_checkpointing=True).fit(
        MegatronLMModule(tiny_gpt(), decay_steps=8), DataLoader(DATA, batch_size=8)
    )
    with pytest.raises(RuntimeError, match=r"outside its Megatron chunks: missing \['head.bias', 'head.weight', 'st"):
        tiny_trainer(3).fit(WithState(), DataLoader(DATA, batch_size=8), ckpt_path=str(tmp_path / "plain.ckpt"))
    lenient = WithState()
    lenient.strict_loading = False
    before = _own_state(lenient)
    tiny_trainer(3).fit(lenient, DataLoader(DATA, batch_size=8), ckpt_path=str(tmp_path / "plain.ckpt"))
    assert torch.equal(lenient.at_start["head.weight"], before["head.weight"])  # kept its own values


def test_the_average_swaps_in_on_request_and_the_weights_come_back_bit_for_bit() -> None:
    """``with callback.swapped_in(module):`` (e.g. around ``module.save_hf``) mid-training: the average in the weights'
    place inside, the very weights after, and training goes on as without the swap."""

    class SwapAtStep2(L.Callback):
        inside: dict[str, torch.Tensor] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step == 2:
                before = {n: p.detach().clone() for n, p in pl_module.chunks[0].named_parameters()}
                with ema.swapped_in(pl_module):
                    self.inside = {n: p.detach().clone() for n, p in pl_module.chunks[0].named_parameters()}
                after = {n: p.detach() for n, p in pl_module.chunks[0].named_parameters()}
                assert all(torch.equal(before[n], after[n]) for n in before)

    ema, swap = MegatronEMA(decay=0.5), SwapAtStep2()
    swapped, _ = _fit(ema, swap)
    plain, _ = _fit(MegatronEMA(decay=0.5))
    assert swapped.val == plain.val  # the swap changed nothing for training
    first, second = swapped.weights[0], swapped.weights[1]
    average = {name: 0.5 * first[name] + 0.5 * second[name] for name in first}  # after step 2
    assert _max_difference(swap.inside, average) < 1e-7  # inside: the average ...
    assert _max_difference(swap.inside, second) > 1e-6  # ... not the weights


def test_a_trainable_parameter_outside_the_chunks_is_refused_when_fit_starts() -> None:
    module = WithState()
    module.head.requires_grad_(True)
    with pytest.raises(
        ValueError, match=r"WithState has trainable parameters outside its Megatron chunks: head.weight"
    ):
        tiny_trainer(1).fit(module, DataLoader(DATA, batch_size=8))
    tiny_trainer().validate(module, VAL, verbose=False)  # evaluation trains nothing: nothing to refuse


def test_bf16_weights_reach_a_users_averaging_function_in_fp32() -> None:
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    theirs = MegatronWeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.5))  # torch's EMA, on lists
    _fit(theirs, precision="bf16-mixed")
    ours = MegatronEMA(decay=0.5)
    _fit(ours, precision="bf16-mixed")
    assert theirs.average is not None
    assert ours.average is not None
    assert _max_difference(theirs.average.averages[0], ours.average.averages[0]) < 1e-6


def test_an_average_is_its_runs_own(tmp_path: Path) -> None:
    """A resume from a checkpoint without an average starts one from the loaded weights; a later fit of the same
    module without the callback saves none (the old average is not loaded in place of its weights); a validation
    with ckpt_path on the fit's Trainer evaluates that checkpoint's average, not the fit's."""
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    plain, model = _fit(L.Callback(), saver)  # a checkpoint without an average
    ema = MegatronEMA(decay=0.5)
    _fit(ema, steps=3, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert ema.average is not None
    assert ema.average.num_averaged == 1  # started at step 2 from the loaded weights, then step 3 copied in
    later = ModelCheckpoint(dirpath=tmp_path / "later", filename="{step}", every_n_train_steps=4)
    trainer = tiny_trainer(4, callbacks=[later], enable_checkpointing=True)
    trainer.fit(model, DataLoader(DATA, batch_size=8))  # the module of the first fit, no averaging now
    loaded = MegatronLMModule.load_from_checkpoint(tmp_path / "later" / "step=4.ckpt")
    (metrics,) = tiny_trainer().validate(loaded, VAL, verbose=False)
    (own,) = tiny_trainer().validate(model, VAL, verbose=False)
    assert metrics["val_loss"] == pytest.approx(own["val_loss"], rel=1e-6)  # its own trained weights
    saver = ModelCheckpoint(dirpath=tmp_path / "ema", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    fit_trainer = tiny_trainer(4, callbacks=[saver, MegatronEMA(decay=0.5)], enable_checkpointing=True)
    module = MegatronLMModule(tiny_gpt(), decay_steps=8)
    fit_trainer.fit(module, DataLoader(DATA, batch_size=8))
    step2 = str(tmp_path / "ema" / "step=2.ckpt")
    (same_trainer,) = fit_trainer.validate(module, VAL, ckpt_path=step2, verbose=False)
    (fresh,) = tiny_trainer().validate(MegatronLMModule(tiny_gpt()), VAL, ckpt_path=step2, verbose=False)
    assert same_trainer["val_loss"] == fresh["val_loss"]  # step 2's average, on either Trainer


def test_the_average_of_lora_adapters_resumes_exactly_from_lean_async_checkpoints(tmp_path: Path) -> None:
    """LoRA (checkpoints of the adapters only, the frozen base referred to), async saves (the average staged in host
    buffers with the rest) and checkpoints without the model's weights (the average is saved on its own)."""
    from lightning_megatron import CheckpointConfig, MegatronStrategy

    def fit(ckpt_path: str | None = None, *callbacks: L.Callback) -> Snapshots:
        checkpoint = CheckpointConfig(async_save=True, save_model_weights=False)
        strategy = MegatronStrategy(micro_batch_size=2, checkpoint=checkpoint)
        snapshots, model = Snapshots(), MegatronLMModule(tiny_gpt(), decay_steps=8, lora={"rank": 2, "alpha": 4.0})
        trainer = tiny_trainer(
            4, strategy=strategy, callbacks=[snapshots, MegatronEMA(decay=0.5), *callbacks], limit_val_batches=1,
            val_check_interval=2, enable_checkpointing=bool(callbacks),
        )  # fmt: skip
        trainer.fit(model, DataLoader(DATA, batch_size=8), val_dataloaders=VAL, ckpt_path=ckpt_path)
        return snapshots

    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    full = fit(None, saver)
    resumed = fit(str(tmp_path / "step=2.ckpt"))
    assert resumed.val == {4: full.val[4]}


@pytest.mark.gpu
def test_the_compiled_ema_update_equals_the_eager_one() -> None:
    """On a GPU the EMA update runs compiled (one pass); it computes what the eager two passes compute."""
    from lightning_megatron.training import averaging

    weights = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((64, 32), (32,), (1000, 17))]
    eager, compiled = [w.float() * 0.5 for w in weights], [w.float() * 0.5 for w in weights]
    for _ in range(3):
        averaging.ema_update_eager(eager, weights, 0.9)
        averaging.ema_update(compiled, weights, 0.9)
    assert averaging._compiled["ema"] is not averaging.ema_update_eager  # it did compile
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
