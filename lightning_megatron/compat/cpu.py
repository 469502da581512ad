"""CPU mode: run Megatron-Core (which assumes CUDA) on CPU over gloo.

Megatron-Core 0.19 calls ``torch.cuda.current_device()`` in ~200 places, builds literal ``device="cuda"``
tensors, calls ``.cuda()``, uses CUDA streams/events, seeds and forks the *CUDA* RNG for tensor-parallel
initialisation and dropout, and compares ``param.type()`` against ``"torch.cuda.FloatTensor"``. None of that
needs a GPU to be *correct*; it only needs to run. This module makes it run without touching Megatron's files:

* a ``TorchFunctionMode`` rewrites every CUDA device argument to CPU, makes ``.cuda()`` and ``pin_memory()``
  identities (and a factory's ``pin_memory=True`` off), and reports CUDA type names from ``Tensor.type()``;
* custom autograd Functions run their backward under the mode as well (the autograd engine does not carry
  torch function modes into backward, where Megatron allocates buffers and re-runs forward code for recompute);
* a handful of ``torch.cuda`` functions are swapped for CPU stand-ins: ``current_device()`` returns the CPU
  device, streams, events and synchronisation are no-ops, and the CUDA RNG is the CPU generator.

The layer is process-wide and reversible: :func:`enable` installs it, :func:`disable` restores every original.
:class:`~lightning_megatron.MegatronStrategy` installs it only for ``accelerator="cpu"`` (as
:class:`lightning_megatron.compat.patches.CpuMode`) and removes it at teardown. It is written against megatron-core 0.19
(see ``SUPPORTED_MEGATRON``); tests pin that.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON = "0.19"

_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CPU = torch.device("cpu")


def _as_cpu(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")`` or a bare index) to CPU."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    # A bare int is a CUDA ordinal everywhere torch accepts one (``device=torch.cuda.current_device()``).
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement in every torch call to CPU."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            name = func(*args)
            return _TYPE_NAMES.get(name, name)
        if func is torch.Tensor.type and len(args) == 2 and isinstance(args[1], str):
            args = (args[0], args[1].replace("torch.cuda.", "torch."))
        if func is torch.Tensor.to:
            # Positional device: ``t.to("cuda")``, ``t.to(torch.cuda.current_device())``; not ``t.to(other)``.
            args = (args[0], *(_as_cpu(a) if isinstance(a, (str, torch.device, int)) else a for a in args[1:]))
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):  # a factory's pinned host buffer (e.g. get_pos_emb_on_this_cp_rank's indices)
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NoStream:
    """Stand-in for ``torch.cuda.Stream``/``Event``: CPU work is synchronous, so every wait is already done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # record/wait/synchronize/wait_stream/record_event/...: all no-ops on CPU.
        return _noop

    def query(self) -> bool:
        return True

    def record_event(self, *args: Any, **kwargs: Any) -> _NoStream:
        # An event to wait on later (Megatron's alltoall dispatcher calls .synchronize() on it).
        return _NoStream()

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the host: as numpy where asked, as the CUDA
    path gives (the alltoall dispatcher passes the split sizes to ``all_to_all_single``, which refuses tensors)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _current_device() -> torch.device:
    # A CPU device rather than the index 0: ``device=torch.cuda.current_device()`` also runs inside autograd
    # backward functions, where the engine does not apply the TorchFunctionMode (its stack is empty there).
    return _CPU


def _nullcontext(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.default_generator.set_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that also seeds CUDA generators, which would call back into this stand-in.
    torch.default_generator.manual_seed(seed)


def _backward_in_mode(original: Callable[..., Any]) -> Callable[..., Any]:
    """Run custom autograd Functions' backward under the mode too: the autograd engine does not carry torch
    function modes into backward, and Megatron's backward functions allocate CUDA buffers and re-run forward code
    (activation recompute builds ``device="cuda"`` causal masks)."""

    def apply(self: Any, *args: Any) -> Any:
        if torch._C._len_torch_function_stack() > 0:
            return original(self, *args)
        with _CudaToCpuMode():
            return original(self, *args)

    return apply


def stand_ins() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, CPU stand-in) for every CUDA entry point Megatron-Core 0.19 reaches in training."""

    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    cuda = torch.cuda
    backward_cls = torch.autograd.function.BackwardCFunction
    patches = [
        (cuda, "current_device", _current_device),
        (cuda, "set_device", _noop),
        (cuda, "synchronize", _noop),
        (cuda, "empty_cache", _noop),
        (cuda, "Stream", _NoStream),
        (cuda, "ExternalStream", _NoStream),
        (cuda, "Event", _NoStream),
        (cuda, "current_stream", _NoStream),
        (cuda, "default_stream", _NoStream),
        (cuda, "stream", _nullcontext),
        (cuda, "device", _nullcontext),
        (cuda, "is_current_stream_capturing", lambda: False),
        (cuda, "memory_allocated", _zero),
        (cuda, "max_memory_allocated", _zero),
        (cuda, "get_rng_state", _get_rng_state),
        (cuda, "set_rng_state", _set_rng_state),
        (cuda, "manual_seed", _manual_seed),
        (cuda.random, "get_rng_state", _get_rng_state),
        (cuda.random, "set_rng_state", _set_rng_state),
        (mcore_random, "_set_cuda_rng_state", _set_rng_state),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
        (backward_cls, "apply", _backward_in_mode(backward_cls.apply)),
    ]
    # One distinct object per patched name: torch.compile (used by Megatron's MoE code) keeps a table of torch
    # functions and rejects one object registered under two names with different trace rules.
    return [(owner, name, _distinct(replacement, name)) for owner, name, replacement in patches]


def _distinct(replacement: Any, name: str) -> Any:
    if isinstance(replacement, type):
        return type(f"_Cpu{name}", (replacement,), {})

    @functools.wraps(replacement)
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    return stand_in


class _DropCpuRngWarning(logging.Filter):
    """Megatron's RNG tracker warns when the CPU RNG moves inside a CUDA-RNG fork; in CPU mode they are one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = logging.getLogger("megatron.core.tensor_parallel.random")
_RNG_FILTER = _DropCpuRngWarning()


class _State:
    mode: _CudaToCpuMode | None = None
    originals: list[tuple[Any, str, Any]] = []


def is_enabled() -> bool:
    """Whether CPU mode is installed in this process."""
    return _State.mode is not None


def enable() -> None:
    """Install CPU mode (idempotent). Must run on the thread that then runs Megatron (modes are thread-local)."""
    if _State.mode is not None:
        return
    _check_megatron_version()
    patches = stand_ins()
    _State.originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    _RNG_LOGGER.addFilter(_RNG_FILTER)
    mode = _CudaToCpuMode()
    mode.__enter__()
    _State.mode = mode


def disable() -> None:
    """Remove CPU mode and restore every patched function (idempotent)."""
    if _State.mode is None:
        return
    _State.mode.__exit__(None, None, None)
    _State.mode = None
    for owner, name, original in _State.originals:
        setattr(owner, name, original)
    _State.originals = []
    _RNG_LOGGER.removeFilter(_RNG_FILTER)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Context manager form of :func:`enable` / :func:`disable`."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def _check_megatron_version() -> None:
    import megatron.core

    version = megatron.core.__version__
    if not version.startswith(SUPPORTED_MEGATRON + "."):
        raise ImportError(
            f"lightning_megatron's CPU mode is written for megatron-core {SUPPORTED_MEGATRON}.x, found {version}; "
            f"install megatron-core=={SUPPORTED_MEGATRON}.* or train on GPUs"
        )
