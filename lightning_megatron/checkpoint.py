"""Sharded checkpoints through Megatron's ``dist_checkpointing``, reshardable across layouts.

A checkpoint is a directory. Model chunks, the (distributed) optimizer state and everything Lightning puts into
its checkpoint dict (loops, callbacks, LR schedule, hyper-parameters) are saved together: tensors as sharded
tensors keyed by their *global* names (layer numbers include the pipeline/VPP offset), the rest as Megatron's
common state. Loading at another TP/PP/VPP/DP layout reads the same global tensors with other shards.

The three megatron-core 0.19 workarounds for the torch-native Adam path (no Transformer Engine / apex) live
here: :func:`_init_adam_state`, :func:`_keep_step_on_load` and :func:`_untie_adam_steps`. The layout tests fail
when any of them stops being right (cross-layout resume must be exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from lightning_megatron import ckpt_checks
from lightning_megatron.optim import inner_optimizers

# Reshardable across TP, PP, VPP and DP: the optimizer state is gathered per parameter on save.
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_MODEL_KEY = "model{}"
_OPTIMIZER_KEY = "optimizer"
MODEL_CONFIG_KEY = "model_config"
"""Common-state entry holding the module's ModelConfig (a plain dict), checked when resuming."""
PARTIAL_SUFFIX = ".partial"


def chunk_key(index: int) -> str:
    # Each chunk under its own key: VPP chunks' local parameter names collide.
    return _MODEL_KEY.format(index)


def sharded_state_dict(
    chunks: Sequence[nn.Module], optimizer: Any | None = None, *, is_loading: bool = False
) -> dict[str, Any]:
    """Model chunks' (and optionally the Megatron optimizer's) sharded state dict."""
    state: dict[str, Any] = {
        chunk_key(i): chunk.sharded_state_dict(metadata=_METADATA)  # type: ignore[operator]
        for i, chunk in enumerate(chunks)
    }
    if optimizer is not None:
        if is_loading:
            _init_adam_state(optimizer)
        state[_OPTIMIZER_KEY] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_METADATA)
    return state


def model_config_dict(module: object) -> dict[str, Any] | None:
    """The module's ``ModelConfig`` (any dataclass ``config``) as a plain dict, loadable with ``weights_only``."""
    config = getattr(module, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else None


def save(state: dict[str, Any], path: str | Path, async_queue: Any | None = None) -> None:
    """Collective: every rank writes its shards of ``state`` (sharded tensors + common objects) to ``path``.

    Crash-safe: the shards go to ``<path>.partial``, which becomes ``path`` (by rename, replacing an older
    checkpoint of the same name such as ``last.ckpt``) only after every rank finished writing. A run killed
    mid-save leaves the previous checkpoint intact and a ``.partial`` directory that nothing loads.

    With ``async_queue`` (Megatron's ``AsyncCallsQueue``, see :func:`async_queue`) the shards are written by a
    background process and the rename is the last finalisation step, run on every rank by the queue's
    ``maybe_finalize_async_calls`` once every rank's writer is done.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    rank = torch.distributed.get_rank()
    status: list[str | None] = [None]
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
            partial.mkdir(parents=True)
        except OSError as error:  # tell the other ranks instead of leaving them in the next barrier
            status = [f"{type(error).__name__}: {error}"]
    torch.distributed.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise OSError(f"cannot create checkpoint directory {partial}: {status[0]}")
    if async_queue is None:
        dist_checkpointing.save(state, str(partial))
        _publish(partial, path)
        return
    request = dist_checkpointing.save(
        state, str(partial), async_sharded_save=True, async_strategy=_async_strategy()
    )  # fmt: skip
    request.add_finalize_fn(lambda: _publish(partial, path))  # after Megatron's own metadata.json finaliser
    async_queue.schedule_async_request(request)


def _publish(partial: Path, path: Path) -> None:
    torch.distributed.barrier()  # every rank's shards are on disk
    if torch.distributed.get_rank() == 0:
        _replace(partial, path)
    torch.distributed.barrier()


def _async_strategy() -> str:
    # NVIDIA's resiliency extension is Megatron's preferred async writer; its own (deprecated) one otherwise.
    from megatron.core.dist_checkpointing.strategies.torch import HAVE_NVRX

    return "nvrx" if HAVE_NVRX else "mcore"


def async_queue() -> Any:
    """The ``AsyncCallsQueue`` that matches :func:`save`'s async requests."""
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    _, queue_class = get_async_strategy(_async_strategy(), "AsyncCallsQueue")
    return queue_class()


def _replace(new: Path, path: Path) -> None:
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    new.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load(
    chunks: Sequence[nn.Module], optimizer: Any | None, path: str | Path, model_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Collective: load model (and optimizer) state from ``path`` into ``chunks`` (and ``optimizer``).

    Before anything is read collectively, every rank checks the files (complete, not truncated, metadata free of
    foreign pickled objects) and the model's shape (the saved ``model_config`` against ``model_config``, every
    tensor's global shape); a failure raises on every rank. Non-tensor entries are unpickled with
    ``weights_only=True``. Returns the checkpoint's other (common) entries: Lightning's loops, callbacks, ...
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = sharded_state_dict(chunks, optimizer, is_loading=True)
    _raise_on_every_rank(lambda: _check(path, state, model_config))
    try:
        with ckpt_checks.weights_only():
            loaded = dist_checkpointing.load(state, str(path))
    except (Exception, CheckpointException) as error:
        raise ValueError(
            f"cannot load checkpoint {path}: {type(error).__name__}: {error}. Objects other than tensors, containers "
            "and numbers are refused (weights_only loading); allow a trusted class with "
            "torch.serialization.add_safe_globals([...])"
        ) from error
    loaded.pop(MODEL_CONFIG_KEY, None)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded.pop(chunk_key(i)))
    if optimizer is not None:
        # Copying into fp32 main params that require grad must not be recorded by autograd.
        with torch.no_grad(), _keep_step_on_load():
            optimizer.load_state_dict(loaded.pop(_OPTIMIZER_KEY))
        _untie_adam_steps(optimizer)
    else:
        loaded.pop(_OPTIMIZER_KEY, None)
    return loaded


def _check(path: Path, state: dict[str, Any], model_config: dict[str, Any] | None) -> None:
    from megatron.core import dist_checkpointing

    if path.name.endswith(PARTIAL_SUFFIX):
        final = path.with_name(path.name.removesuffix(PARTIAL_SUFFIX))
        raise ValueError(f"{path} is an unfinished save (a run stopped while writing it); load {final} or an older one")
    if not path.is_dir() or not (path / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete Megatron sharded checkpoint (no metadata.json); checkpoints written by "
            "MegatronStrategy are directories"
        )
    metadata = ckpt_checks.read_metadata(path)
    ckpt_checks.check_files(path, metadata)
    saved_config = None
    if model_config is not None:
        try:
            with ckpt_checks.weights_only():
                saved_config = dist_checkpointing.load_common_state_dict(str(path)).get(MODEL_CONFIG_KEY)
        except (Exception, CheckpointException) as error:
            raise ValueError(
                f"the common state of checkpoint {path} cannot be read safely ({type(error).__name__}: {error}); only "
                "tensors, containers and numbers are unpickled; is the checkpoint damaged or from an untrusted source?"
            ) from error
    diff = ckpt_checks.config_mismatch(saved_config, model_config)
    model_state = {k: v for k, v in state.items() if k != _OPTIMIZER_KEY}
    ckpt_checks.check_shapes(path, metadata, model_state, diff)


def _raise_on_every_rank(check: Callable[[], None]) -> None:
    """Run a local check on every rank; if it fails anywhere, raise on every rank (no rank left in a collective)."""
    error: BaseException | None = None
    try:
        check()
    except (Exception, CheckpointException) as caught:  # whatever it hit, no rank may go on into the load
        error = caught
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if error is not None:
        raise error
    if int(flag.item()):
        raise ValueError("another rank found the checkpoint unusable (see its error); nothing was loaded")


def _init_adam_state(optimizer: Any) -> None:
    """Give a fresh torch Adam the state it has after a step, so ``sharded_state_dict(is_loading=True)`` works.

    megatron-core 0.19's ``DistributedOptimizer.state_dict`` asserts exactly one ``step`` value among the torch
    optimizer's per-parameter states, which a fresh torch Adam does not have yet.
    """
    for megatron_optimizer in inner_optimizers(optimizer):
        torch_optimizer = megatron_optimizer.optimizer
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if len(state) == 0:
                    device = param.device if group.get("fused") else None  # see optim.place_adam_steps
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _untie_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam ``step`` tensor after loading.

    megatron-core 0.19's ``DistributedOptimizer.load_state_dict`` (torch-native path) assigns *one* ``step``
    tensor to every parameter's state; torch Adam increments it in place once per parameter, so the bias
    correction of every step after a resume would be wrong.
    """
    # Where each counter lives (host, or the device for fused Adam) is decided by the strategy's use_fused_adam,
    # which runs after every load because Megatron also restores the saved groups' fused/foreach flags.
    for megatron_optimizer in inner_optimizers(optimizer):
        for state in megatron_optimizer.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


@contextlib.contextmanager
def _keep_step_on_load() -> Iterator[None]:
    """Let ``fully_reshardable`` loading skip torch Adam's ``step`` tensor.

    megatron-core 0.19's ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every tensor of
    the torch optimizer state from the checkpoint, ``step`` included, but the checkpoint restores ``step``
    through the param groups instead and has no per-parameter entry (``KeyError: 'step'``). Megatron already
    skips entries whose source is not a tensor, so we hand it ``step=None`` for the duration of the load.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        original(self, model_param, {"step": None, **tensors})

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original  # type: ignore[method-assign]
