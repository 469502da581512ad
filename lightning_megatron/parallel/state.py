"""Megatron's parallel state: init and teardown, and the few rank queries the rest of the package needs.

These are the only two places that touch ``megatron.core.parallel_state``'s globals to create or destroy them
(:func:`initialize` and :func:`destroy`); everything else reads ranks through small helpers below.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from lightning_megatron.parallel.sizes import ParallelSizes


def initialize(sizes: ParallelSizes, seed: int, timeout: timedelta | None = None) -> None:
    """Build Megatron's process groups on top of an initialised default group, and seed its RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    kwargs: dict[str, Any] = {}
    if timeout is not None:
        # Megatron only builds timedelta(minutes=...) from it: a fraction keeps sub-minute timeouts exact.
        kwargs["distributed_timeout_minutes"] = timeout.total_seconds() / 60
    # Keywords only: positional parameters were inserted between megatron-core versions.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        **kwargs,
    )
    # Same seed on every data-parallel replica; Megatron offsets it per tensor-/expert-parallel rank for
    # the weights and dropout inside sharded regions. Pipeline stages get distinct seeds as in Megatron.
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear Megatron's parallel state down so a later Trainer in this process can build it again."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def data_parallel_rank_and_size() -> tuple[int, int]:
    """Megatron's data-parallel rank and size (tensor-, pipeline- and context-parallel peers share them); ``(0, 1)``
    when no parallel state exists (outside a run, e.g. a data module set up on its own)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def chunk_stages(num_chunks: int) -> list[tuple[bool, bool]]:
    """(holds the input embedding, holds the output head) for each of this rank's model chunks."""
    from megatron.core import parallel_state

    vpp = num_chunks if num_chunks > 1 else None
    return [
        (
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage if vpp else None),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage if vpp else None),
        )
        for stage in range(num_chunks)
    ]


def resolve_seed(seed: int | None) -> int:
    """The strategy's seed, else Lightning's ``seed_everything`` seed (``PL_GLOBAL_SEED``), else 1234."""
    if seed is not None:
        return seed
    return int(os.environ.get("PL_GLOBAL_SEED", 1234))
