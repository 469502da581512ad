"""Megatron's per-layer CUDA graphs (``ModelConfig.cuda_graphs``): fresh graph state for each run, none after it.

Megatron keeps its graph state process-wide: a record of what to capture, one memory pool, a patched
``save_for_backward`` while it records, and a side CUDA stream it switches to when its first graph manager is
built. Each layer's manager keeps its runners (with their graphs and buffers) after the capture, and Megatron's own
``delete_cuda_graphs`` resets only the record, which the capture has emptied. So :func:`renew` gives every
layer a fresh manager when a fit starts (a second fit of the same module records and captures again), and
:func:`release` drops all of it when the run ends, failed or not. Both do nothing for chunks built without graphs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_megatron.parallel import state


def _owners(chunks: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules of ``chunks`` that Megatron built with a CUDA graph manager (layers and blocks)."""
    return [m for chunk in chunks for m in chunk.modules() if hasattr(m, "cudagraph_manager")]


def in_use(chunks: Iterable[nn.Module]) -> bool:
    """Whether a run has recorded or captured graphs of these chunks (they hold the weights' addresses)."""
    return any(owner.cudagraph_manager.cudagraph_runners for owner in _owners(chunks))


def renew(chunks: Iterable[nn.Module]) -> None:
    """A fresh, empty graph manager on every module that has one: the run records and captures its own graphs."""
    owners = _owners(chunks)
    if not owners:
        return
    from megatron.core.transformer.cuda_graphs import CudaGraphManager

    state.graph_safe_rng()  # this run's seed() built a plain tracker, which Megatron's managers refuse
    for owner in owners:
        owner.cudagraph_manager = CudaGraphManager(owner.config)


def release(chunks: Iterable[nn.Module]) -> None:
    """Drop the captured graphs and Megatron's process-wide graph state; back on the default CUDA stream."""
    owners = _owners(chunks)
    if not owners:
        return
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    for owner in owners:
        owner.cudagraph_manager.cudagraph_runners.clear()  # the runners hold the graphs and their buffers
    delete_cuda_graphs()  # the record, the memory pool, the save_for_backward patch
    torch.cuda.set_stream(torch.cuda.default_stream())
