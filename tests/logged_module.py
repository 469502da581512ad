"""The LM with loss_fn logs, shared by the contract tests and their workers (run as scripts from tests/)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_megatron import MegatronLMModule


class Logged(MegatronLMModule):
    """The LM with two loss_fn logs: the loss again as a (sum, count) pair, and a scalar that is always one."""

    def forward_step(self, batch, model):  # noqa: ANN001, ANN201
        output, loss_fn = super().forward_step(batch, model)

        def with_logs(logits: Tensor) -> tuple[Tensor, Tensor, dict]:
            loss_sum, tokens, logs = loss_fn(logits)
            ones = torch.ones((), device=logits.device)
            return loss_sum, tokens, {**logs, "mean_loss": (loss_sum.detach(), tokens.detach()), "ones": ones}

        return output, with_logs
