"""A PPO/GRPO-style clipped policy objective on top of MegatronLMModule, without touching the schedule.

The only override is ``token_loss``: the per-token loss computed from the vocabulary-parallel logits of the last
pipeline stage. Batches carry what a rollout produced, aligned with ``compute_logprobs``' output (position t
scores token t+1): ``input_ids`` [B, S], ``old_logprobs`` [B, S], ``advantages`` [B, S], and ``loss_mask``
[B, S] (1 on response tokens). The strategy token-weights the loss across micro-batches and data-parallel ranks.

    python examples/ppo_policy.py            # one process on CPU: rollout log-probs, then 5 policy steps
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, tiny_gpt
from lightning_megatron.contract import Batch
from lightning_megatron.data.corpus import synthetic_tokens
from lightning_megatron.kernels.logprobs import vocab_parallel_logprobs


class ClippedPolicy(MegatronLMModule):
    """PPO's clipped surrogate: ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with ``r = exp(logp - old_logp)``."""

    def __init__(self, *args: object, clip_ratio: float = 0.2, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.clip_ratio = clip_ratio

    def token_loss(self, logits: Tensor, targets: Tensor, batch: Batch) -> Tensor:
        logprobs = vocab_parallel_logprobs(logits, targets)  # [B, S], no full-vocabulary gather
        ratio = (logprobs - batch["old_logprobs"]).exp()
        advantages = batch["advantages"]
        clipped = ratio.clamp(1 - self.clip_ratio, 1 + self.clip_ratio)
        return -torch.minimum(ratio * advantages, clipped * advantages)


def main(steps: int = 5) -> tuple[list[float], torch.Tensor]:
    tokens = synthetic_tokens(8, 32, 256, seed=0)
    policy = ClippedPolicy(tiny_gpt(), lr=1e-3, decay_steps=steps, prediction="logprobs")
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=4), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    # "Rollout": log-probs of the current policy, forward-only through the pipeline.
    rollout = trainer.predict(policy, DataLoader(tokens, batch_size=8), return_predictions=True)
    old_logprobs = rollout[0]["logprobs"]
    loss_mask = torch.zeros(8, 32, dtype=torch.long)
    loss_mask[:, 16:] = 1  # the "response" half
    advantages = torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0)[:, None].expand(8, 32)  # [B] -> [B, S]
    items = [
        {
            "input_ids": tokens[i],
            "old_logprobs": old_logprobs[i],
            "advantages": advantages[i],
            "loss_mask": loss_mask[i],
        }
        for i in range(8)
    ]
    trainer2 = L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=4), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer2.fit(policy, DataLoader([items[i % 8] for i in range(8 * steps)], batch_size=8))
    print("policy loss per step:", [round(v, 4) for v in losses])
    new_logprobs = trainer2.predict(policy, DataLoader(tokens, batch_size=8))[0]["logprobs"]
    gain = ((new_logprobs - old_logprobs) * loss_mask)[:, :].sum(dim=1)  # per sample, response tokens only
    print("log-prob gain, positive-advantage samples:", round(float(gain[0::2].mean()), 4),
          "negative:", round(float(gain[1::2].mean()), 4))  # fmt: skip
    return losses, gain


if __name__ == "__main__":
    main()
