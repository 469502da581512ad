"""MegatronValueModule: a GPT whose last pipeline stage emits one scalar per token (critic / reward model)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_megatron.contract import Batch, ChunkSpec, LossFn
from lightning_megatron.gpt.model import GPTModule
from lightning_megatron.gpt.sequences import token_mask


class ValueHead(nn.Linear):
    """Linear(hidden -> 1), replicated on every tensor-parallel rank; replaces GPTModel's vocabulary head.

    Called like Megatron's output layer: ``head(hidden [S, B, H], weight=..., runtime_gather_output=...)`` returns
    ``(values [S, B, 1], None)``. Under sequence parallelism the hidden states are first gathered along the
    sequence, so every TP rank computes the same values and the same head gradients.
    """

    def __init__(self, hidden_size: int, std: float, sequence_parallel: bool) -> None:
        # An nn.Linear itself (not wrapping one): GPTModel's sharded state dict expects output_layer.weight.
        super().__init__(hidden_size, 1)
        self.sequence_parallel = sequence_parallel
        with torch.no_grad():
            self.weight.normal_(0.0, std)
            self.bias.zero_()
        _broadcast_over_tensor_parallel_group(self)

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):  # noqa: ANN201
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # [S/tp, B, H] -> [S, B, H]. The head is replicated and every TP rank computes the whole loss, so the
            # backward must split the gradient, not sum tp identical copies (the default, for split outputs).
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return super().forward(hidden.to(self.weight.dtype)), None


def _broadcast_over_tensor_parallel_group(module: nn.Module) -> None:
    """Replicated parameters must start equal on all TP ranks (per-rank RNG streams may differ)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    src = parallel_state.get_tensor_model_parallel_src_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    for param in module.parameters():
        torch.distributed.broadcast(param.data, src=src, group=group)


class MegatronValueModule(GPTModule):
    """A value model: the GPT of :class:`~lightning_megatron.gpt.model.GPTModule` with a scalar head instead of the
    vocabulary head (no Hugging Face causal-LM counterpart: save it with ``ModelCheckpoint``).

    Training batches hold ``input_ids`` [B, S], ``returns`` [B, S] (the value targets; ``values`` is accepted as
    an alias) and optionally ``loss_mask``/``attention_mask`` [B, S]. With ``old_values`` [B, S] and
    ``clip_range`` set, the loss is PPO's clipped value loss. Per-token values are token-weighted across
    micro-batches and data-parallel ranks like the LM loss: ``0.5 * sum(mask * error^2) / sum(mask)``.
    ``trainer.predict`` returns values [B, S] on every rank. A model with tied embeddings (Gemma's, from
    ``from_hf``) keeps its embedding, tied to nothing: the value head takes the vocabulary head's place.
    All ``GPTModule`` arguments apply, plus:

    Args:
        clip_range: PPO value clipping range (used when the batch has ``old_values``); ``None`` disables it.
    """

    def __init__(self, *args: object, clip_range: float | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if clip_range is not None and clip_range <= 0:
            raise ValueError(f"clip_range={clip_range} must be positive (e.g. 0.2) or None")
        self.clip_range = clip_range

    def build_chunk(self, spec: ChunkSpec) -> nn.Module:
        chunk = super().build_chunk(spec)  # (with tied embeddings, a last stage's head copy loads and is dropped)
        if spec.post_process:
            config = chunk.config
            chunk.output_layer = ValueHead(config.hidden_size, config.init_method_std, config.sequence_parallel)
        # Nothing is tied to the embedding any more: on every chunk, or Megatron would all-reduce the first stage's
        # embedding gradient with the last stage's head (now the value head) after each step.
        chunk.share_embeddings_and_output_weights = False
        return chunk

    def forward_step(self, batch: Batch, model: nn.Module) -> tuple[Tensor, LossFn]:
        targets = batch.get("returns", batch.get("values"))
        if targets is None:
            raise KeyError("MegatronValueModule batches need 'returns' (or 'values') [B, S] value targets")
        tokens = self.rank_tokens(batch)
        # No shift: the value at position t estimates the return from t. Under CP: this rank's tokens only.
        targets, mask = tokens.local(targets), tokens.local(token_mask(batch).float())
        old_values = tokens.local(batch["old_values"]) if "old_values" in batch else None
        output = self._routed_forward(tokens, batch, model)  # [B, S, 1] on the last stage

        def loss_fn(values: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            values = values.squeeze(-1).float()  # [B, S, 1] -> [B, S]
            error = (values - targets.float()).pow(2)
            if self.clip_range is not None and old_values is not None:
                old = old_values.float()
                clipped = old + (values - old).clamp(-self.clip_range, self.clip_range)
                error = torch.maximum(error, (clipped - targets.float()).pow(2))
            return 0.5 * (error * mask).sum(), mask.sum().to(torch.int), {}

        return output, loss_fn

    def predict_output(self, batch: Batch, output: Tensor) -> Tensor:
        return self.rank_tokens(batch).gather(output.squeeze(-1).float())  # [B, S_local, 1] -> [B, S]
