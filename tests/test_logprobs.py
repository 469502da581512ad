"""Per-token log-probs and entropy on vocabulary-parallel logits, and a policy loss on top of them."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import one_process_megatron, run_here, run_worker

EXAMPLES = Path(__file__).parent.parent / "examples"


def _reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """One process's full logits -> log_softmax / entropy, with the module's alignment (last position 0)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # [B, S, V]
    picked = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)  # position t scores token t+1
    entropy = -(logp.exp() * logp).sum(-1)
    mask = torch.ones_like(picked)
    return {
        "logprobs": torch.cat([picked, torch.zeros_like(picked[:, :1])], dim=1).float(),
        "entropy": torch.cat([entropy[:, :-1] * mask, torch.zeros_like(entropy[:, :1])], dim=1).float(),
    }


def _trainer(**kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def test_logprobs_and_entropy_equal_log_softmax_of_full_logits() -> None:
    tokens = synthetic_tokens(4, 32, 256, seed=9)
    model = MegatronLMModule(tiny_gpt(), temperature=0.7)
    logits = _trainer().predict(model, DataLoader(tokens, batch_size=4))[0]
    model.prediction = "logprobs+entropy"
    got = _trainer().predict(model, DataLoader(tokens, batch_size=4))[0]
    want = _reference(logits, tokens, temperature=0.7)
    torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["entropy"], want["entropy"], rtol=1e-5, atol=1e-5)


def test_compute_logprobs_inside_a_hook_and_gradients_flow() -> None:
    tokens = synthetic_tokens(4, 32, 256, seed=9)
    seen: dict = {}

    class Probe(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            seen.update(pl_module.compute_logprobs(tokens, with_entropy=True))

    _trainer(max_steps=1, callbacks=[Probe()]).fit(MegatronLMModule(tiny_gpt()), DataLoader(tokens, batch_size=4))
    assert seen["logprobs"].shape == seen["entropy"].shape == (4, 32)
    assert torch.all(seen["logprobs"][:, :-1] < 0)
    assert torch.all(seen["logprobs"][:, -1] == 0)

    # tp=1 formulas against autograd of the reference (the TP>1 reductions are checked by the layout test).
    from lightning_megatron.kernels.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

    with one_process_megatron(port=29593):
        logits = torch.randn(2, 5, 11, requires_grad=True)
        targets = torch.randint(0, 11, (2, 5))
        (vocab_parallel_logprobs(logits, targets).sum() + vocab_parallel_entropy(logits).sum()).backward()
        ref = logits.detach().clone().requires_grad_()
        logp = torch.log_softmax(ref, -1)
        (logp.gather(-1, targets[..., None]).sum() - (logp.exp() * logp).sum()).backward()
        torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def lp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("logprobs")
    # Train 2 steps (checkpointing at step 2), then predict logits with those weights, in one process.
    args = {"devices": 1, "max_steps": 2, "ckpt_dir": str(tmp / "ckpt"), "ckpt_every": 2}
    run_here({**args, "pred_out": str(tmp / "logits")}, tmp)
    ckpt = str(tmp / "ckpt" / "epoch=0-step=2.ckpt")
    return {"ckpt": ckpt, "logits": torch.load(tmp / "logits.rank0.pt")}


@pytest.mark.multiprocess
# Log-probs gathered across pipeline stages (PP=2 x VPP=2) and CP ranks: tests/test_hf_layouts.py, against transformers.
@pytest.mark.parametrize("layout", [{"devices": 2, "tp": 2}], ids=["tp2"])
def test_logprobs_and_entropy_at_tp2(layout: dict, lp_checkpoint: dict, tmp_path: Path) -> None:
    args = {**layout, "mode": "predict", "prediction": "logprobs+entropy", "resume": lp_checkpoint["ckpt"]}
    run_worker({**args, "pred_out": str(tmp_path / "lp")}, tmp_path)
    tokens = synthetic_tokens(16, 32, 256, seed=2)  # the worker's validation data
    want = _reference(lp_checkpoint["logits"], tokens)
    for rank in range(layout["devices"]):
        got = torch.load(tmp_path / f"lp.rank{rank}.pt")
        torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["entropy"], want["entropy"], rtol=1e-5, atol=1e-5)


def test_ppo_example_moves_logprobs_with_the_advantages() -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import ppo_policy
    finally:
        sys.path.pop(0)
    losses, gain = ppo_policy.main(steps=5)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert gain[0::2].mean() > 0 > gain[1::2].mean()  # positive advantages up, negative down
