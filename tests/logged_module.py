"""The LM with loss_fn logs (and one with torchmetrics metrics too), shared by the contract tests and their workers
(run as scripts from tests/)."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import CatMetric, MeanMetric, MetricCollection, SumMetric

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


class Metered(Logged):
    """Logged, with torchmetrics metrics of each validation batch (the same batch on every rank of a model replica):
    the rows (``SumMetric``, logged as ``val_rows``), the mean token id (``MeanMetric``, ``val_mean_token``) and each
    row's token sum (a ``CatMetric`` in a ``MetricCollection``, computed by hand at the epoch's end: ``row_sums``)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.val_rows = SumMetric()
        self.val_mean_token = MeanMetric()
        self.val_tables = MetricCollection({"row_sums": CatMetric()})
        self.row_sums: list[float] = []

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        tokens = (batch["input_ids"] if isinstance(batch, dict) else batch).float()
        self.val_rows.update(tokens.shape[0])
        self.val_mean_token.update(tokens.mean(dim=1))
        self.val_tables["row_sums"].update(tokens.sum(dim=1))
        self.log("val_rows", self.val_rows)
        self.log("val_mean_token", self.val_mean_token)

    def on_validation_epoch_end(self) -> None:
        self.row_sums = sorted(self.val_tables.compute()["row_sums"].tolist())  # a collective: every rank computes
        self.val_tables.reset()
