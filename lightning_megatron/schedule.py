"""The one bridge to Megatron's pipeline schedules (``get_forward_backward_func``).

One DataLoader batch is one optimizer step for this data-parallel rank: it is split along dim 0 into
micro-batches of ``micro_batch_size`` and fed to the schedule (no pipelining, 1F1B, or interleaved 1F1B with
VPP, as Megatron picks from the parallel state). Losses are token-weighted: the module's loss function returns
a *sum* and a token count, Megatron's ``calculate_per_token_loss`` divides gradients by the token count of the
whole global batch, and :func:`reduce_loss` does the same for the logged value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_megatron.contract import Batch, LossFn, StepModule
from lightning_megatron.parallel.state import data_parallel_rank_and_size
from lightning_megatron.validation import divisors


def as_batch(batch: Tensor | Mapping[str, Tensor]) -> Batch:
    """HF-style batch dict; a bare LongTensor means ``input_ids``."""
    if isinstance(batch, Tensor):
        return {"input_ids": batch}
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return dict(batch)
    raise TypeError(
        f"a batch must be a LongTensor of input_ids or a dict with 'input_ids', got {type(batch).__name__}"
        + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
    )


def global_batch_size(batch: Tensor | Mapping[str, Tensor]) -> tuple[int, int]:
    """(samples, tokens) of the global batch this rank's DataLoader batch belongs to: data-parallel ranks each
    hold as many; tensor-, pipeline- and context-parallel peers hold the same ones."""
    input_ids = as_batch(batch)["input_ids"]
    _, dp_size = data_parallel_rank_and_size()
    return input_ids.shape[0] * dp_size, input_ids.numel() * dp_size


def check_micro_batch_size(batch_size: int, micro_batch_size: int) -> None:
    """Raise ``ValueError`` unless a DataLoader batch of ``batch_size`` splits into micro-batches."""
    if batch_size % micro_batch_size != 0:
        raise ValueError(
            f"DataLoader batch_size={batch_size} is not divisible by micro_batch_size={micro_batch_size}: each batch "
            f"is split into micro-batches; use a batch size that is a multiple of {micro_batch_size} (and "
            f"drop_last=True), or pick micro_batch_size among {divisors(batch_size)}"
        )


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into micro-batches of ``micro_batch_size``."""
    size = batch["input_ids"].shape[0]
    check_micro_batch_size(size, micro_batch_size)
    parts = {key: value.split(micro_batch_size) for key, value in batch.items()}
    return [{key: parts[key][i] for key in parts} for i in range(size // micro_batch_size)]


def run(
    module: StepModule,
    chunks: list[nn.Module],
    batch: Batch,
    *,
    micro_batch_size: int,
    forward_only: bool,
    predict: bool = False,
) -> list[dict[str, Any]]:
    """Run one global batch through Megatron's schedule; return what each micro-batch's loss function logged.

    The list is empty except on the last pipeline stage. With ``predict=True`` each entry is
    ``{"prediction": module.predict_output(micro_batch, output)}`` instead.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = split_micro_batches(batch, micro_batch_size)

    def forward_step(data_iterator: Iterator[Batch], model: nn.Module) -> tuple[Tensor, Callable]:
        micro_batch = next(data_iterator)
        if predict:
            return module.forward_predict(micro_batch, model), _prediction_fn(module, micro_batch)
        output, loss_fn = module.forward_step(micro_batch, model)
        return output, _recording(loss_fn)

    # Every chunk walks the same micro-batches: the first chunk needs the inputs, the last the labels.
    iterators = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=batch["input_ids"].shape[1],
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def _recording(loss_fn: LossFn) -> LossFn:
    """Wrap ``loss_fn`` so that the (sum, count) pair is kept for :func:`reduce_loss`."""

    def wrapped(output: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        loss_sum, num_tokens, logs = loss_fn(output)
        record = {"loss_sum": loss_sum.detach().float(), "num_tokens": num_tokens.detach().float(), **logs}
        return loss_sum, num_tokens, record

    return wrapped


def _prediction_fn(module: StepModule, micro_batch: Batch) -> Callable:
    def wrapped(output: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
        one = torch.ones((), dtype=torch.int, device=output.device)
        return output.new_zeros(()), one, {"prediction": module.predict_output(micro_batch, output)}

    return wrapped


def reduce_loss(records: list[dict[str, Any]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Token-weighted mean loss of the global batch and its token count, identical on every rank.

    Sums (loss, tokens) over micro-batches, all-reduces over data-parallel (x context-parallel) ranks, then
    broadcasts from the last pipeline stage, where alone the loss exists.
    """
    from megatron.core import parallel_state

    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for record in records:
        totals[0] += record["loss_sum"].double()
        totals[1] += record["num_tokens"].double()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(totals, group=dp_group)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            totals,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    loss = (totals[0] / totals[1].clamp(min=1)).float()
    return loss, totals[1]


def gather_predictions(records: list[dict[str, Any]], device: torch.device) -> Tensor | dict[str, Tensor]:
    """Concatenate per-micro-batch predictions (tensors or dicts of tensors) and broadcast them from the last
    pipeline stage to every rank."""
    from megatron.core import parallel_state

    local = None
    if records:
        first = records[0]["prediction"]
        if isinstance(first, dict):
            local = {key: torch.cat([r["prediction"][key] for r in records]) for key in first}
        else:
            local = torch.cat([r["prediction"] for r in records])
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return local
    group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    tensors = local if isinstance(local, dict) else {"": local} if local is not None else None
    meta = [{k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} if tensors is not None else None]
    meta.append(isinstance(local, dict))
    torch.distributed.broadcast_object_list(meta, src=src, group=group, device=device)
    shapes, is_dict = meta
    out = {}
    for key, (shape, dtype) in shapes.items():
        out[key] = tensors[key] if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(out[key], src=src, group=group)
    return out if is_dict else out[""]


class HostScalar:
    """A scalar on the host, copied from the device without waiting for the GPU.

    The copy is queued behind the work that produced the value; :meth:`get` waits for that copy only. Reading
    the loss with ``.item()`` after the optimizer step (what a progress bar does every step) would instead wait
    for the optimizer's kernels too, and keep the host from queueing the next step while they run.
    """

    def __init__(self, value: Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self._value = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._value.copy_(value.detach(), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._value = value.detach().to("cpu", copy=True)

    def get(self) -> Tensor:
        """The value as a CPU tensor (waits for its copy, not for later GPU work)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._value
