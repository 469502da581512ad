"""torchmetrics' Perplexity fed from Megatron's token-weighted loss instead of full-vocabulary logits."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torchmetrics.text import Perplexity


class TokenPerplexity(Perplexity):
    """``exp(sum of token NLLs / number of tokens)``: torchmetrics' ``Perplexity``, updated with sums.

    ``Perplexity.update(preds, target)`` needs full-vocabulary logits, which no rank holds under tensor parallelism
    (the logits are vocabulary-parallel) and only the last stage under pipeline parallelism. The strategy already
    reduces each batch's summed loss and token count over data-parallel ranks and broadcasts them from the last
    stage, so every rank updates with the same global numbers; ``compute`` is torchmetrics' own. Syncing across
    processes at ``compute`` would only repeat that reduction, so it is off by default.
    """

    def __init__(self, sync_on_compute: bool = False, **kwargs: Any) -> None:
        super().__init__(sync_on_compute=sync_on_compute, **kwargs)

    def update(self, loss_sum: Tensor, num_tokens: Tensor) -> None:  # type: ignore[override]
        """Add a batch: its summed token NLL (nats) and its token count."""
        self.total_log_probs += loss_sum.detach().to(self.total_log_probs)
        self.count += num_tokens.detach().to(self.count)
