"""MegatronLMModule: a Megatron-Core GPT with a causal-LM head."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_megatron.contract import Batch, LossFn
from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.gpt.model import GPTModule
from lightning_megatron.gpt.sequences import document_starts, token_mask
from lightning_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy
from lightning_megatron.kernels.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from lightning_megatron.training import guards

IGNORE_INDEX = guards.IGNORE_INDEX


def shift_labels(batch: Batch) -> tuple[Tensor, Tensor]:
    """HF causal-LM labels -> Megatron targets: position t predicts token t+1.

    ``labels`` (default: ``input_ids``) are unshifted, ``-100`` ignored; ``loss_mask`` and ``attention_mask``
    ([B, S], aligned with the tokens) drop positions too, and so do the last tokens of a packed row's documents
    (the next token starts another document). Returns ``targets`` [B, S] (ignored positions hold 0, a valid index
    for the vocab-parallel cross entropy) and the float ``mask`` [B, S].
    """
    labels = batch.get("labels", batch["input_ids"])
    keep = (labels != IGNORE_INDEX) & token_mask(batch)
    starts = document_starts(batch)
    if starts is not None:
        keep = keep & ~starts
    targets = torch.zeros_like(labels)
    mask = torch.zeros_like(labels, dtype=torch.float32)
    targets[:, :-1] = torch.where(keep[:, 1:], labels[:, 1:], 0)  # [B, S-1] shifted left by one
    mask[:, :-1] = keep[:, 1:].float()  # the last position has no next token
    return targets, mask


class MegatronLMModule(GPTModule):
    """A GPT (Megatron-Core ``GPTModel``) trained with the causal-LM loss.

    Batches are HF-style: ``input_ids`` [B, S], optional ``labels`` (unshifted, ``-100`` ignored),
    ``attention_mask`` and ``loss_mask``; a bare LongTensor is ``input_ids`` with ``labels = input_ids``. The
    loss is token-weighted across micro-batches and data-parallel ranks. ``trainer.predict`` returns full-vocab
    logits [B, S, V] on every rank. Hugging Face export (:meth:`save_hf`, :meth:`export_hf_weights`) and per-token
    log-probs (:meth:`compute_logprobs`) are this head's. The arguments are :class:`GPTModule`'s, plus:

    Args:
        prediction: what ``trainer.predict`` returns per batch on every rank: full-vocabulary ``logits``
            [B, S, V], or ``{"logprobs": [B, S]}`` (and ``"entropy"``), computed without gathering the vocabulary.
        temperature: softmax temperature of predicted log-probs and entropy.
    """

    def __init__(
        self,
        config: ModelConfig,
        *args: Any,
        prediction: Literal["logits", "logprobs", "logprobs+entropy"] = "logits",
        temperature: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if prediction not in ("logits", "logprobs", "logprobs+entropy"):
            raise ValueError(f"prediction={prediction!r} must be 'logits', 'logprobs' or 'logprobs+entropy'")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive")
        # GPTModule's arguments (optimizer settings, lora), typed and documented there; LightningCLI follows the call.
        super().__init__(config, *args, **kwargs)
        self.prediction = prediction
        self.temperature = temperature

    def export_hf_weights(
        self,
        *,
        include_tied: bool = True,
        bucket_bytes: int | None = None,
        lora_only: bool = False,
        merged: bool = True,
    ) -> Iterator[tuple[str, Tensor]] | Iterator[list[tuple[str, Tensor]]]:
        """Yield the full HF state dict on every rank: ``(hf_name, tensor)`` one at a time, or with
        ``bucket_bytes`` lists of them of about that many bytes (a bigger tensor alone), for weight sync.

        Collective (every rank must exhaust the generator): tensors are gathered over tensor parallelism and
        broadcast from the pipeline stage that holds them -- one collective per tensor, or per bucket with
        ``bucket_bytes``; peak extra memory is about one tensor or bucket. Names and shapes are those of
        ``AutoModelForCausalLM``'s ``state_dict()``; with tied embeddings ``include_tied=False`` leaves out
        ``lm_head.weight`` (as ``save_pretrained`` files do). With LoRA, the weights come with the adapters merged
        in (``W + alpha/r B A``; ``merged=False``: the frozen base alone), or ``lora_only=True`` streams just the
        adapters in PEFT's names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). Call it
        while the strategy is set up (any hook of ``fit``/``validate``/``predict``).
        """
        from lightning_megatron.gpt.hf.export import check_running, export_weights

        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not bucket_bytes > 0):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive number of bytes, or None")
        if lora_only and self.lora is None:
            raise ValueError("lora_only=True streams LoRA adapters; this module has none (lora=None)")
        if lora_only and not merged:
            raise ValueError("merged=False with lora_only=True: the adapters alone are never merged; drop merged=")
        check_running(self)  # now, not at the generator's first step
        chunks, lora = list(self.chunks), self.lora if lora_only else None
        buckets = export_weights(
            chunks, self.config, include_tied=include_tied, merged=merged, lora=lora, bucket_bytes=bucket_bytes
        )
        return buckets if bucket_bytes is not None else (pair for bucket in buckets for pair in bucket)

    def save_hf(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        max_shard_size: int = 5 * 2**30,
        adapter: bool = False,
        weight_format: Literal["float", "fp8_block", "mxfp4"] = "float",
    ) -> None:
        """Collective: write an HF model directory that ``AutoModelForCausalLM.from_pretrained(path)`` loads.

        Rank 0 writes config.json (the one :meth:`from_hf` read, with ``dtype`` updated; else generated in the family
        that holds the model: Llama, Qwen2 for q/k/v biases, Qwen3 for q/k norms, Gemma 3; with experts Qwen3-MoE,
        Qwen2-MoE, Mixtral, GLM-4.5 or DeepSeek-V3), the safetensors (``max_shard_size`` bytes per file, with an index
        when there are several) and, from an HF source directory, its tokenizer and generation files. ``dtype``
        (default: the parameters' dtype) is the dtype of the written tensors. With LoRA the weights are merged (base +
        adapters); ``adapter=True`` writes the adapters alone as a PEFT adapter directory instead
        (``adapter_config.json`` + ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base, path)``
        loads.

        A model loaded from an fp8 block-quantized or MXFP4 checkpoint is written in ``dtype`` too, without the
        source's ``quantization_config``; ``weight_format="fp8_block"`` writes the weights the source stored in fp8
        in its format again (fp8 e4m3 and a float32 ``_scale_inv`` per block; the other tensors in ``dtype``) and
        keeps it. ``weight_format="mxfp4"`` (GPT-OSS) writes the experts in MXFP4 (``_blocks`` + ``_scales``): those
        an MXFP4 source stored so, with its ``quantization_config``; from another source, every expert weight.
        """
        from lightning_megatron.gpt.hf.export import save_pretrained

        if adapter and weight_format != "float":
            raise ValueError(
                f"save_hf(adapter=True, weight_format={weight_format!r}): adapters are written in dtype; "
                "weight_format applies to the model's weights (adapter=False)"
            )
        if adapter:
            from lightning_megatron.gpt.hf.peft import save_adapter

            if self.lora is None:
                raise ValueError("save_hf(adapter=True) writes LoRA adapters; this module has none (lora=None)")
            save_adapter(self, path, dtype=dtype)
            return
        save_pretrained(self, path, dtype=dtype, max_shard_size=max_shard_size, weight_format=weight_format)

    def forward_step(self, batch: Batch, model: nn.Module) -> tuple[Tensor, LossFn]:
        tokens = self.rank_tokens(batch)
        targets, mask = (tokens.local(t) for t in shift_labels(batch))  # shifted on the full rows, then cut
        local = tokens.local_batch(batch)
        # Logits [B, S, V/tp] on the last stage (vocabulary-parallel, never gathered); hidden states elsewhere.
        output = self._routed_forward(tokens, batch, model)

        def loss_fn(logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            per_token = self.token_loss(logits, targets, local)  # [B, S]
            return (per_token.float() * mask).sum(), mask.sum().to(torch.int), {}

        return output, loss_fn

    def token_loss(self, logits: Tensor, targets: Tensor, batch: Batch) -> Tensor:
        """Per-token loss [B, S] from the vocabulary-parallel logits ``[B, S, V/tp]`` of one micro-batch.

        The default is the causal-LM cross entropy (``targets[t]`` is token t+1). Override it for other
        objectives on log-probs -- e.g. a PPO/GRPO clipped policy loss reading ``batch["old_logprobs"]`` and
        ``batch["advantages"]`` (see ``examples/ppo_policy.py``); positions outside the loss mask are dropped
        and the sum is token-weighted across micro-batches and data-parallel ranks by the strategy. Under context
        parallelism ``logits``, ``targets`` and the token-aligned tensors of ``batch`` hold this rank's tokens only.
        """
        if self.kernels == "local":
            return -vocab_parallel_logprobs(logits, targets)  # Megatron's reference cross entropy
        return vocab_parallel_cross_entropy(logits, targets)

    def compute_logprobs(self, batch: Batch | Tensor, temperature: float = 1.0, with_entropy: bool = False) -> dict:
        """Per-token log-probs (and entropy) of a batch, forward-only through the pipeline; on every rank.

        Collective: call it on every rank while the strategy is set up (any hook of fit/validate/predict).
        Returns ``{"logprobs": [B, S]}`` where position t holds ``log p(token t+1 | tokens <= t)`` (the last
        position, and positions the batch's masks exclude, hold 0), plus ``"entropy"`` [B, S] when asked.
        ``trainer.predict`` returns the same per batch with ``MegatronLMModule(..., prediction="logprobs")``.
        """
        saved = (self.prediction, self.temperature)
        self.prediction = "logprobs+entropy" if with_entropy else "logprobs"
        self.temperature = temperature
        try:
            return self.trainer.strategy.predict_step(batch, 0)
        finally:
            self.prediction, self.temperature = saved

    def predict_output(self, batch: Batch, output: Tensor) -> Tensor | dict[str, Tensor]:
        tokens = self.rank_tokens(batch)
        if self.prediction == "logits":
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            return tokens.gather(gather_from_tensor_model_parallel_region(output))  # [B, S, V/tp] -> [B, S, V]
        targets, mask = (tokens.local(t) for t in shift_labels(batch))
        result = {"logprobs": vocab_parallel_logprobs(output, targets, self.temperature) * mask}
        if self.prediction == "logprobs+entropy":
            result["entropy"] = vocab_parallel_entropy(output, self.temperature) * mask
        return {name: tokens.gather(value) for name, value in result.items()}  # [B, S_local] -> [B, S]
