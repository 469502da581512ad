"""Lightning habits that were silently wrong under MegatronStrategy (one process, CPU): several validation/test/predict
loaders, the Trainer's model summary, ``torch.compile(model)`` and Lightning's ``grad_norm`` recipe. The summary's
multi-process counts (TP=2, PP=2 with a tied embedding, EP=2) are asserted in the runs of ``tests/test_layouts.py``
and ``tests/test_moe.py``."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities import grad_norm
from lightning.pytorch.utilities.model_summary import summarize
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, tiny_gpt
from lightning_megatron.callbacks import MegatronModelSummary, MegatronRichModelSummary
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.training.grad_norms import PATIENCE
from tests.conftest import one_process_trainer


def _trainer(max_steps: int = 1, **kwargs: object) -> L.Trainer:
    return one_process_trainer(max_steps, **kwargs)


def _loaders() -> tuple[DataLoader, DataLoader]:
    """Two loaders over different data: random tokens (8 rows), and rows that repeat their first half (4 rows)."""
    repeated = synthetic_tokens(4, 32, 256, seed=2)
    repeated[:, 16:] = repeated[:, :16]
    return DataLoader(synthetic_tokens(8, 32, 256, seed=1), batch_size=4), DataLoader(repeated, batch_size=4)


def test_several_eval_loaders_log_each_loader_apart() -> None:
    model = MegatronLMModule(tiny_gpt())
    first, second = _loaders()
    trainer = _trainer()
    alone = [trainer.validate(model, loader)[0] for loader in (first, second)]  # the same weights throughout
    # An untrained model: near ln(256) on both, yet apart far beyond the tolerances below (as would be a mix).
    assert abs(alone[0]["val_loss"] - alone[1]["val_loss"]) > 1e-4
    evaluated = {"val": trainer.validate(model, [first, second]), "test": trainer.test(model, [first, second])}
    for stage, both in evaluated.items():
        assert len(both) == 2
        for idx, (got, want) in enumerate(zip(both, alone, strict=True)):
            # Lightning's names; each loader's perplexity its own (one shared metric would mix the loaders' tokens).
            assert set(got) == {f"{stage}_loss/dataloader_idx_{idx}", f"{stage}_ppl/dataloader_idx_{idx}"}
            assert got[f"{stage}_loss/dataloader_idx_{idx}"] == pytest.approx(want["val_loss"], rel=1e-6)
            assert got[f"{stage}_ppl/dataloader_idx_{idx}"] == pytest.approx(want["val_ppl"], rel=1e-5)
    predictions = trainer.predict(model, [first, second])
    assert len(predictions) == 2  # one list per loader
    for got, loader in zip(predictions, (first, second), strict=True):
        torch.testing.assert_close(torch.cat(got), torch.cat(trainer.predict(model, loader)))


def test_the_trainer_s_model_summaries_are_replaced_keeping_their_settings() -> None:
    given = RichModelSummary(max_depth=2, header_style="bold green")
    trainer = _trainer(callbacks=[given])
    model = MegatronLMModule(tiny_gpt())
    trainer.fit(model, _loaders()[0])
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert type(callback) is MegatronRichModelSummary  # printed as Rich prints it
    assert (callback.max_depth, callback.summarize_kwargs) == (2, {"header_style": "bold green"})
    whole, plain = callback.summary, summarize(model, max_depth=2)  # one process: Lightning's own counts agree
    assert whole is not None
    assert (whole.total_parameters, whole.trainable_parameters) == (plain.total_parameters, plain.trainable_parameters)
    assert whole.total_parameters == sum(p.numel() for p in model.parameters()) > 0
    assert whole.layer_names == plain.layer_names
    assert whole.param_nums == plain.param_nums
    # The Trainer's default summary (enable_model_summary=True) and a plain ModelSummary are replaced too.
    for settings in ({"enable_model_summary": True}, {"callbacks": [ModelSummary(max_depth=3)]}):
        trainer = _trainer(**settings)
        trainer.fit(MegatronLMModule(tiny_gpt()), _loaders()[0])
        (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
        assert isinstance(callback, MegatronModelSummary)
        assert callback.summary is not None


def test_torch_compile_of_the_module_fails_at_connect(fresh_megatron_state: None) -> None:
    from megatron.core import parallel_state

    module = MegatronLMModule(tiny_gpt())
    with pytest.raises(TypeError, match=r"torch.compile\(MegatronLMModule.*never calls.*kernels='torch'.*cuda_graphs"):
        _trainer().fit(torch.compile(module), _loaders()[0])
    assert not parallel_state.model_parallel_is_initialized()
    assert not hasattr(module, "chunks")  # raised before anything was built
    # What the message says: the module, unmarked, trains.
    from lightning.pytorch.utilities.compile import to_uncompiled

    trainer = _trainer()
    trainer.fit(to_uncompiled(module), _loaders()[0])
    assert trainer.global_step > 0


class GradNormRecipe(MegatronLMModule):
    """Lightning's documented recipe for logging gradient norms."""

    def on_before_optimizer_step(self, optimizer: object) -> None:
        self.seen = grad_norm(self, norm_type=2)
        self.log_dict(self.seen)


class ReadsGradNorms(L.Callback):
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        self.seen = trainer.strategy.grad_norms()


class ReadsGradNormsOnce(L.Callback):
    """Periodic logging: reads at step 0 only."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        if trainer.global_step == 0:
            trainer.strategy.grad_norms()


def _grad_norm_warnings(model: MegatronLMModule, callbacks: list, steps: int = PATIENCE + 1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(steps, callbacks=callbacks).fit(model, _loaders()[0])
    return [str(w.message) for w in caught if "strategy.grad_norms()" in str(w.message)]


def test_grad_norm_recipe_warns_once_naming_the_strategy_s_grad_norms() -> None:
    model = GradNormRecipe(tiny_gpt())
    messages = _grad_norm_warnings(model, [])
    assert model.seen == {}  # what Lightning's recipe sees under Megatron: no .grad
    assert len(messages) == 1, messages  # PATIENCE + 1 steps, one warning
    assert messages[0].startswith(f"GradNormRecipe.on_before_optimizer_step ran {PATIENCE} training steps and none")
    assert _grad_norm_warnings(GradNormRecipe(tiny_gpt()), [], steps=PATIENCE - 1) == []  # not before PATIENCE
    # Once a hook reads them through the strategy (here a callback's), nothing warns; once in the run is enough.
    reader = ReadsGradNorms()
    assert _grad_norm_warnings(GradNormRecipe(tiny_gpt()), [reader]) == []
    assert float(reader.seen["grad_2.0_norm_total"]) > 0
    assert _grad_norm_warnings(GradNormRecipe(tiny_gpt()), [ReadsGradNormsOnce()]) == []
