"""The third-party warnings that the torch-native path always triggers, silenced where we cause them.

Without Transformer Engine and apex, importing megatron-core and building its models prints about 60 lines per
job (most once per rank): "Transformer Engine and Apex are not installed" six times, "Apex is not installed.
Falling back to Torch Norm", GPTModel's deprecation notice, MimoModelConfig's "experimental" notice, torch's
deprecation of the collectives Megatron calls, and on CPU CUDA advice. None of them asks the user to do anything;
the kernel set chosen is stated once instead (``MegatronLMModule.configure_model``). The filters apply only while
our package imports megatron-core (:func:`importing`) and while a run of the strategy is set up
(:func:`run_filters`, removed at teardown); warnings outside those and any other warning stay.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# warnings.warn messages (regexes, matched at the start), and on which devices they say nothing useful.
_EVERYWHERE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"MimoModelConfig is experimental",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's own pytree code on torch >= 2.10
    r"Please use DTensor instead and we are deprecating ShardedTensor",  # inside dist_checkpointing
    # MLA's fused RoPE (on GPU): its limit is Megatron's inference contexts, which no forward of ours passes.
    r"apply_rope_fusion for multi-latent attention only supports training",
)
_ON_CPU = (
    r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",  # Megatron's CPU code paths
)
# logging records: logger name -> message prefixes.
_LOGGED = {
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    # Advice to callers of DDP: computing the layout inside DDP gives the same layout.
    "megatron.core.distributed.distributed_data_parallel": ("DistributedDataParallel: full_param_layout not provided",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    # Every save runs Megatron's "mcore" writer function (in the training process, or in this package's writer
    # process for async saves); the advice to switch to NVRx's writer is not the user's to follow.
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
}


class _DropRecords(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_RECORD_FILTERS = {name: _DropRecords(prefixes) for name, prefixes in _LOGGED.items()}


def _ignore(patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        warnings.filterwarnings("ignore", message=pattern)


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """While our package imports megatron-core (and torch's C++-extension module with it)."""
    with warnings.catch_warnings():
        _ignore(_EVERYWHERE)
        with _records_dropped():
            yield


@contextlib.contextmanager
def _records_dropped() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _RECORD_FILTERS]
    for logger in loggers:
        logger.addFilter(_RECORD_FILTERS[logger.name])
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_RECORD_FILTERS[logger.name])


@contextlib.contextmanager
def run_filters(device_type: str) -> Iterator[None]:
    """The filters of one run on ``device_type`` (installed by the strategy as
    :class:`lightning_megatron.compat.patches.QuietRun`, from ``setup_environment`` to ``teardown``)."""
    with warnings.catch_warnings():
        _ignore(_EVERYWHERE + (_ON_CPU if device_type == "cpu" else ()))
        with _records_dropped():
            yield
