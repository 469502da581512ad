"""The one bridge to Megatron's pipeline schedules (``get_forward_backward_func``).

One DataLoader batch is one optimizer step for this data-parallel rank: its micro-batches
(:mod:`lightning_megatron.micro_batches`) are fed to the schedule (no pipelining, 1F1B, or interleaved 1F1B with
VPP, as Megatron picks from the parallel state). Losses are token-weighted: the module's loss function returns
a *sum* and a token count, Megatron's ``calculate_per_token_loss`` divides gradients by the token count of the
whole global batch, and :func:`reduce_step` does the same for the logged value.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_megatron.contract import Batch, LossFn, StepModule, StepStats
from lightning_megatron.parallel.state import data_parallel_rank_and_size
from lightning_megatron.training.host import HostScalar


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


def run(
    module: StepModule,
    chunks: list[nn.Module],
    micro_batches: list[Batch],
    *,
    forward_only: bool,
    predict: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run one global batch's micro-batches (:mod:`lightning_megatron.micro_batches`) through Megatron's schedule;
    return what each micro-batch's loss function logged (also passed to ``on_record`` as each is made).

    The list is empty except on the last pipeline stage. With ``predict=True`` each entry is
    ``{"prediction": module.predict_output(micro_batch, output)}`` instead.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[Batch], model: nn.Module) -> tuple[Tensor, Callable]:
        micro_batch = next(data_iterator)
        if predict:
            return module.forward_predict(micro_batch, model), _prediction_fn(module, micro_batch)
        output, loss_fn = module.forward_step(micro_batch, model)
        return output, _recording(loss_fn, on_record)

    # Every chunk walks the same micro-batches: the first chunk needs the inputs, the last the labels.
    iterators = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(micro_batches),
        # Shapes of the p2p activations (ignored under variable_seq_lengths, where micro-batches differ).
        seq_length=micro_batches[0]["input_ids"].shape[1],
        micro_batch_size=micro_batches[0]["input_ids"].shape[0],
        forward_only=forward_only,
    )


def train(
    module: StepModule, chunks: list[nn.Module], micro_batches: list[Batch], device: torch.device, known: LogNames
) -> StepLoss:
    """One training step's forward and backward passes through Megatron's schedule, and its reduced loss.

    Without pipeline parallelism the loss is reduced in the last micro-batch's loss function, before that micro-batch's
    backward pass: the host copy the step's logging waits for (``StepLoss.header``) is then ready while the GPU
    still has the backward pass and the optimizer step queued, so the host queues the next step before the GPU runs
    out of work. (Reduced after the schedule, it made the host wait for the whole backward pass: 1B on an H200, 8.5
    ms of waiting and 13 ms of GPU idle per 200 ms step; 0.005 ms of waiting after.) Every rank issues the reduction
    at the same point of the same schedule. With pipeline stages the loss exists on the last stage only, and its
    broadcast to the others must wait for the end of the schedule.
    """
    from megatron.core import parallel_state

    early: list[StepLoss] = []
    seen: list[dict[str, Any]] = []

    def on_record(record: dict[str, Any]) -> None:
        seen.append(record)
        if len(seen) == len(micro_batches):
            early.append(reduce_step(seen, device, known))

    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    # Megatron's hybrid-CP schedule regroups micro-batches per rank: the count would not mark the same point.
    regrouped = getattr(getattr(chunks[0], "config", None), "hybrid_context_parallel", False)
    early_ok = not pipelined and not regrouped
    records = run(module, chunks, micro_batches, forward_only=False, on_record=on_record if early_ok else None)
    return early[0] if early else reduce_step(records, device, known)


def _recording(loss_fn: LossFn, on_record: Callable[[dict[str, Any]], None] | None) -> LossFn:
    """Wrap ``loss_fn`` so that the (sum, count) pair and its logs are kept for :func:`reduce_step`."""

    def wrapped(output: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
        loss_sum, num_tokens, logs = loss_fn(output)
        record = {"loss_sum": loss_sum.detach().float(), "num_tokens": num_tokens.detach().float(), "logs": logs}
        if on_record is not None:
            on_record(record)
        return loss_sum, num_tokens, record

    return wrapped


def _prediction_fn(module: StepModule, micro_batch: Batch) -> Callable:
    def wrapped(output: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
        one = torch.ones((), dtype=torch.int, device=output.device)
        return output.new_zeros(()), one, {"prediction": module.predict_output(micro_batch, output)}

    return wrapped


@dataclass
class StepLoss:
    """One global batch's loss (and ``loss_fn`` logs), reduced: identical on every rank."""

    loss: Tensor
    """Token-weighted mean loss (a device scalar)."""
    num_tokens: Tensor
    """Tokens the loss counts, over all micro-batches and data-parallel ranks (a device scalar)."""
    header: HostScalar
    """Host copy, queued without waiting, of ``[loss_sum, num_tokens, number of logs, hash of their names, that hash
    summed over data-parallel ranks, (sum, count) of each log whose names the other stages know]``."""
    log_names: list[str] = field(default_factory=list)
    """The ``loss_fn`` logs' names, sorted (last pipeline stage only)."""
    log_totals: Tensor | None = None
    """``[len(log_names), 2]`` (sum, count) per log over micro-batches and data-parallel ranks (last stage only)."""


class LogNames:
    """The ``loss_fn`` log names every pipeline stage knows (sent again only when they change)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.hash = _names_hash([])


def reduce_step(records: list[dict[str, Any]], device: torch.device, known: LogNames) -> StepLoss:
    """Reduce what the loss functions returned: the token-weighted loss and each log's (sum, count).

    Sums over micro-batches, all-reduces over data-parallel (x context-parallel) ranks in one collective, then
    broadcasts a header from the last pipeline stage, where alone the loss exists. The header carries the logs'
    values too while their names are the ones every stage already knows (``known``), so steady-state logging
    costs no extra collective and no extra synchronisation (:func:`step_logs`).
    """
    from megatron.core import parallel_state as ps

    names, totals = _log_totals(records, device)
    # [loss_sum, num_tokens, names hash, totals...]; new_full is a fill kernel, where torch.tensor([...], device=...)
    # or item assignment would copy from the host and synchronise with the GPU.
    names_hash = totals.new_full((1,), _names_hash(names))
    sums = torch.cat([_loss_sums(records, device), names_hash, totals.flatten()])
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    # The other stages receive a header sized for the names they know: the values ride along only for those.
    known_totals = sums[3:] if not pipelined or names == known.names else sums.new_zeros(2 * len(known.names))
    header = torch.cat([sums[:2], sums.new_full((1,), len(names)), names_hash, sums[2:3], known_totals])
    if pipelined:
        src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
        torch.distributed.broadcast(header, src=src, group=group)
    loss = (header[0] / header[1].clamp(min=1)).float()
    reduced = sums[3:].reshape(-1, 2) if names else None
    return StepLoss(loss, header[1], HostScalar(header), log_names=names, log_totals=reduced)


def _loss_sums(records: list[dict[str, Any]], device: torch.device) -> Tensor:
    """``[sum of loss_sum, sum of num_tokens]`` over the micro-batches' records, in float64."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for record in records:
        sums[0] += record["loss_sum"].double()
        sums[1] += record["num_tokens"].double()
    return sums


def _log_totals(records: list[dict[str, Any]], device: torch.device) -> tuple[list[str], Tensor]:
    """(sorted names, [K, 2] sums and counts) of the micro-batches' ``logs``: a scalar counts 1, a (sum, count) pair
    as is. Sorted: every rank must all-reduce the same logs in the same order."""
    pairs: dict[str, list[Tensor]] = {}
    for record in records:
        for name, value in record["logs"].items():
            pairs.setdefault(name, []).append(_sum_and_count(name, value, device))
    names = sorted(pairs)
    if not names:
        return [], torch.zeros(0, 2, dtype=torch.float64, device=device)
    return names, torch.stack([torch.stack(pairs[name]).sum(0) for name in names])


def _sum_and_count(name: str, value: Any, device: torch.device) -> Tensor:
    if isinstance(value, Tensor) and value.numel() == 1:
        return torch.stack([value.detach().reshape(()).double(), torch.ones((), dtype=torch.float64, device=device)])
    if isinstance(value, tuple | list) and len(value) == 2:
        return torch.stack([_scalar(v, device) for v in value])
    raise TypeError(
        f"loss_fn logs[{name!r}] is {type(value).__name__}; a log is a scalar tensor (averaged over micro-batches and "
        "data-parallel ranks) or a (sum, count) pair of scalars (summed, then divided)"
    )


def _scalar(value: Any, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().reshape(()).double()
    return torch.full((), float(value), dtype=torch.float64, device=device)  # a fill: no host-to-device copy


def _names_hash(names: list[str]) -> int:
    return zlib.crc32("\0".join(names).encode())


def step_logs(step: StepLoss, known: LogNames, device: torch.device) -> dict[str, Tensor]:
    """The step's ``loss_fn`` logs, ``{name: sum / count}`` as host tensors, on every rank (collective like
    :func:`step_log_totals`)."""
    return {name: (pair[0] / pair[1]).float() for name, pair in step_log_totals(step, known, device).items()}


def step_log_totals(step: StepLoss, known: LogNames, device: torch.device) -> dict[str, Tensor]:
    """The step's ``loss_fn`` logs, ``{name: [sum, count]}`` as host float64 tensors, on every rank.

    Reads the header's host copy, which waits only for the step's own reduction. Only when the names are new to the
    other pipeline stages (the first step with logs, or a change) does it broadcast them and the values, a
    collective over the pipeline group: every rank calls this function after every :func:`reduce_step`.
    """
    from megatron.core import parallel_state as ps

    header = step.header.get()
    count, names_hash = int(header[2]), int(header[3])
    if count == 0:
        return {}
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    if int(header[4]) != dp * names_hash:
        raise ValueError(
            "loss_fn returned different log names on different data-parallel ranks; every rank and micro-batch must "
            "return the same names (log a (0, 0) pair where a value does not apply)"
        )
    names, values = step.log_names, header[5:].reshape(-1, 2)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        if names_hash != known.hash:  # new names: send them, and this step's values, once
            group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
            message = [names]
            torch.distributed.broadcast_object_list(message, src=src, group=group, device=device)
            known.names, known.hash = message[0], names_hash
            totals = step.log_totals
            if totals is None:
                totals = torch.empty(count, 2, dtype=torch.float64, device=device)
            torch.distributed.broadcast(totals, src=src, group=group)
            values = totals.cpu()
        names = known.names
    return {name: values[i] for i, name in enumerate(names)}


def evaluation(records: list[dict[str, Any]], device: torch.device, known: LogNames) -> dict[str, Any]:
    """Collective: ``{"loss", "num_tokens", "logs"}`` of a forward-only run's records, identical on every rank
    (:func:`reduce_step`, then :func:`step_logs`)."""
    step = reduce_step(records, device, known)
    return {"loss": step.loss, "num_tokens": step.num_tokens, "logs": step_logs(step, known, device)}


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


@dataclass(frozen=True)
class TrainStep:
    """One optimizer step between the strategy's ``training_step`` and its logging after the optimizer step: one
    DataLoader batch, or the k batches of a gradient-accumulation window."""

    losses: tuple[StepLoss, ...] = ()
    """Each batch's reduced loss."""
    start: float = 0.0
    """``time.perf_counter()`` when the step's last batch so far began."""
    tokens: int = 0
    """Input tokens of the step's global batches."""
    earlier: float = 0.0
    """Seconds of the step's earlier batches' own work (their ``training_step``s, not what ran between them)."""

    def add(self, loss: StepLoss, tokens: int, start: float, done: bool) -> TrainStep:
        """This step with one more batch, begun at ``start``; ``done``: the batch ends here (an accumulated batch,
        whose step comes with a later one), so its time is counted now."""
        earlier = self.earlier + (time.perf_counter() - start if done else 0.0)
        return TrainStep((*self.losses, loss), start, self.tokens + tokens, earlier)


def train_metrics(step: TrainStep, stats: StepStats, skipped_steps: int, known: LogNames) -> dict[str, Tensor]:
    """What a training step logs (identical on every rank but ``tokens_per_s``, each rank's clock): ``train_loss``,
    ``lr``, ``grad_norm``, ``skipped_steps``, ``tokens_per_s`` and the loss_fn logs, token-weighted over the step's
    batches. Host tensors, but for ``grad_norm``: a device tensor, as Megatron's optimizer left it, since its host
    copy would wait for the whole optimizer step (Lightning reads it only when a logger writes). Collective like
    :func:`step_logs`."""
    # Host copies: each waits for its batch's reduction only, not for the optimizer's kernels.
    loss_sum = sum(float(loss.header.get()[0]) for loss in step.losses)
    num_tokens = sum(float(loss.header.get()[1]) for loss in step.losses)
    # Input tokens of the global batch per second of the step's own work (schedule and optimizer, this rank's clock),
    # not of the callbacks around it.
    elapsed = max(step.earlier + time.perf_counter() - step.start, 1e-9)
    metrics = {"train_loss": _host(loss_sum / max(num_tokens, 1.0)), "lr": _host(stats.lr)}
    if stats.grad_norm is not None:
        norm = stats.grad_norm
        metrics["grad_norm"] = norm if isinstance(norm, Tensor) else _host(norm)
    metrics["skipped_steps"] = _host(skipped_steps)
    metrics["tokens_per_s"] = _host(step.tokens / elapsed)
    totals: dict[str, Tensor] = {}
    for loss in step.losses:
        for name, pair in step_log_totals(loss, known, loss.loss.device).items():
            totals[name] = totals[name] + pair if name in totals else pair
    metrics.update({name: pair[0] / pair[1] for name, pair in totals.items()})
    return {name: value.float() for name, value in metrics.items()}


def _host(value: float) -> Tensor:
    """A host-side number as a CPU tensor for ``self.log``: Lightning would copy a bare float to the GPU, a
    synchronising copy that stops the host from queueing the next step while the optimizer's kernels run."""
    return torch.tensor(float(value), dtype=torch.float64)
