"""Per-token log-probabilities and entropy on vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary ``[..., V/tp]``. Log-probs use Megatron's
vocab-parallel cross entropy; the entropy is written the same way: a max and two sums all-reduced over the TP
group. Both are differentiable (policy losses and entropy bonuses train through them), and with ``tp=1`` they
are plain ``log_softmax`` computations.
"""

from __future__ import annotations

import torch
from torch import Tensor


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)[target]`` per position: logits ``[..., V/tp]``, targets ``[...]``."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    return -vocab_parallel_cross_entropy(scaled, targets)


def vocab_parallel_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: logits ``[..., V/tp]`` -> ``[...]``.

    ``H = logsumexp(l) - sum_v p_v l_v``, with the max and the two sums reduced over TP.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    scaled = logits.float() / temperature
    local_max = scaled.detach().amax(dim=-1, keepdim=True)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            local_max, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    shifted = scaled - local_max  # the max is a constant shift: no gradient through it
    # reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward. Both sums are reduced
    # before they are combined, so everything after the reductions is identical on every rank and the identity
    # backward is exact: H = log Z - (sum_v e^l_v l_v) / Z.
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_logit = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return sum_exp.log() - sum_exp_logit / sum_exp
