"""Megatron's parallel state: init and teardown, and the few rank queries the rest of the package needs.

These are the only two places that touch ``megatron.core.parallel_state``'s globals to create or destroy them
(:func:`initialize` and :func:`destroy`); everything else reads ranks through small helpers below.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from lightning_megatron.contract import ChunkSpec
from lightning_megatron.parallel.precision import megatron_dtype_fields
from lightning_megatron.parallel.sizes import ParallelSizes

_created: list[Any] = []
"""The torch process groups the live :func:`initialize` created, for :func:`destroy` to release."""


class Groups:
    """A handle on the Megatron process groups one :func:`initialize` call built."""

    def __init__(self, sizes: ParallelSizes, control: Any | None, replica: Any | None = None) -> None:
        from megatron.core import parallel_state

        self.sizes = sizes
        self.control = control
        """A gloo group of every rank for the run's control flags (SIGTERM), so that agreeing on them never waits
        for the accelerator; ``None`` for a single process."""
        self.replica = replica
        """A gloo group of this rank's model replica (the ranks of its data-parallel rank: tensor x pipeline x
        context parallel), which must all see the same batch (``data/consistency.py``); ``None`` when the replica
        is this rank alone."""
        self._marker = parallel_state.get_data_parallel_group(with_context_parallel=True)

    def alive(self) -> bool:
        """Whether Megatron's parallel state is still the one these groups belong to (no later run replaced it)."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return False
        return parallel_state.get_data_parallel_group(with_context_parallel=True) is self._marker


def initialize(sizes: ParallelSizes, timeout: timedelta | None = None) -> Groups:
    """Build Megatron's process groups on top of an initialised default group (replacing any earlier run's)."""
    from megatron.core import parallel_state

    destroy()
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        # Megatron only builds timedelta(minutes=...) from it: a fraction keeps sub-minute timeouts exact.
        kwargs["distributed_timeout_minutes"] = timeout.total_seconds() / 60
    before = set(_registered_groups())
    try:
        # Keywords only: positional parameters were inserted between megatron-core versions.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            virtual_pipeline_model_parallel_size=sizes.vpp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
            **kwargs,
        )
        control = replica = None
        if torch.distributed.get_world_size() > 1:
            control = torch.distributed.new_group(backend="gloo", timeout=timeout)
            replica = _replica_group(control, timeout)
    finally:  # a build that failed halfway has groups to release too
        _created[:] = [group for group in _registered_groups() if group not in before]
    return Groups(sizes, control, replica)


def _replica_group(control: Any, timeout: timedelta | None) -> Any | None:
    """A gloo group of the ranks sharing this rank's data-parallel rank (every rank creates every such group, in
    the same order, as ``new_group`` requires); ``None`` when each replica is one rank (pure data parallelism)."""
    from megatron.core import parallel_state

    world = torch.distributed.get_world_size()
    dp_ranks = [0] * world
    torch.distributed.all_gather_object(dp_ranks, parallel_state.get_data_parallel_rank(), group=control)
    if len(set(dp_ranks)) == world:
        return None
    mine = None
    for dp_rank in sorted(set(dp_ranks)):
        ranks = [rank for rank, r in enumerate(dp_ranks) if r == dp_rank]
        group = torch.distributed.new_group(ranks, backend="gloo", timeout=timeout)
        if dp_rank == dp_ranks[torch.distributed.get_rank()]:
            mine = group
    return mine


def seed(base: int) -> dict[str, Any]:
    """Seed torch's global RNG and Megatron's model-parallel RNG tracker for a run; return the global RNG states
    as they were, for :func:`restore_rng` when the run ends.

    Same seed on every data-parallel replica; Megatron offsets it per tensor-/expert-parallel rank for the weights
    and dropout inside sharded regions. Pipeline stages get distinct seeds, as in Megatron-LM.
    """
    from megatron.core import parallel_state, tensor_parallel

    saved = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        saved["cuda"] = torch.cuda.get_rng_state_all()
    torch.manual_seed(base + 100 * parallel_state.get_pipeline_model_parallel_rank())
    # force_reset: a plain tracker again where an earlier run made it graph-safe (graph_safe_rng).
    tensor_parallel.model_parallel_cuda_manual_seed(base, force_reset_rng=True)
    return saved


def graph_safe_rng() -> None:
    """Swap Megatron's model-parallel RNG tracker for its CUDA-graph-safe kind, keeping every state it holds.

    Megatron's per-layer CUDA graphs (``ModelConfig.cuda_graphs``) refuse a tracker that stores generator states as
    byte tensors; the graph-safe tracker keeps generators, which a graph can register. The states carry over
    unchanged, so both draw the same numbers. Idempotent; CUDA only. The next run's :func:`seed` starts over with
    a plain tracker.
    """
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker()
    if getattr(tracker, "use_cudagraphable_rng", False):
        return
    states, seeds = tracker.get_states(), set(tracker.seeds_)
    random.initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)
    safe = random.get_cuda_rng_tracker()
    safe.set_states({name: random.convert_cuda_rng_state(s, to_graphable=True) for name, s in states.items()})
    safe.seeds_ = seeds


def restore_rng(saved: dict[str, Any] | None) -> None:
    """Put back the global RNG states :func:`seed` returned (nothing for ``None``)."""
    if saved is None:
        return
    torch.random.set_rng_state(saved["cpu"])
    if "cuda" in saved:
        torch.cuda.set_rng_state_all(saved["cuda"])


def destroy() -> None:
    """Tear Megatron's parallel state down so a later Trainer in this process can build it again.

    Megatron's own teardown only forgets its groups (and destroys four gloo ones), and torch keeps every group
    alive until it is destroyed: a gloo group holds three threads, one of them polling. Dozens of groups per run
    made a process of many runs (a notebook, this project's test suite) hold thousands of threads that starved the
    CPU. So the gloo groups of the run are destroyed too. That is local (no peer takes part, so it is safe after a
    failure), and a gloo group stays usable while referenced (a module built in an earlier run keeps its groups):
    its threads end with the last reference. (Only calls on the group itself keep working: torch's lookups by group,
    such as ``get_rank(group)`` or ``get_process_group_ranks``, refuse a destroyed one; the package makes those only
    on the current run's groups.) NCCL groups are left as Megatron leaves them, since destroying one tears down a
    communicator that such a module could still need.
    """
    from megatron.core import parallel_state

    if not (parallel_state.model_parallel_is_initialized() or _created):
        return  # nothing was built (a run refused before its groups): no collection to pay for
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    created, _created[:] = list(_created), []
    registered = set(_registered_groups())
    for group in created:
        if group in registered and torch.distributed.get_backend(group) == "gloo":  # Megatron destroyed some itself
            torch.distributed.destroy_process_group(group)
    del created, registered  # no local reference may keep a group (and its threads) through the collection below
    # The finished run's modules and optimizer, which hold the groups, often sit in reference cycles that would keep
    # the threads until some later collection.
    gc.collect()


def _registered_groups() -> list[Any]:
    """Every process group torch holds in this process. Internal: torch has no public listing (only a count,
    ``get_pg_count``); its registry ``distributed_c10d._world.pg_map`` is what ``destroy_process_group`` checks."""
    if not torch.distributed.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)  # a torch without it: nothing is released, nothing breaks
    return list(getattr(world, "pg_map", {}))


def data_parallel_rank_and_size() -> tuple[int, int]:
    """Megatron's data-parallel rank and size (tensor-, pipeline- and context-parallel peers share them); ``(0, 1)``
    when no parallel state exists (outside a run, e.g. a data module set up on its own)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def data_parallel_group() -> Any | None:
    """Megatron's data-parallel (x context-parallel) group: the ranks holding different samples; ``None`` when no
    parallel state exists."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def chunk_specs(
    sizes: ParallelSizes, dtype: torch.dtype, device_type: str, variable_seq_lengths: bool = False
) -> list[ChunkSpec]:
    """One :class:`ChunkSpec` per model chunk this rank holds (one per VPP stage), for ``dtype`` on ``device_type``;
    ``variable_seq_lengths``: micro-batches differ in shape (Megatron's p2p then sends shapes first)."""
    config = megatron_config_kwargs(sizes, dtype)
    if variable_seq_lengths or sizes.ep > 1:
        # Megatron's all-to-all token dispatcher: each rank sends its tokens to the expert-parallel ranks holding
        # their experts (the default "allgather" gathers every token on every rank); also the one Megatron accepts
        # with variable lengths. At ep=1 "allgather" exchanges nothing. Both route the same tokens to the same experts.
        config["moe_token_dispatcher_type"] = "alltoall"
    if variable_seq_lengths:
        config["variable_seq_lengths"] = True
    return [
        ChunkSpec(
            pre_process=first,
            post_process=last,
            vp_stage=i if sizes.vpp else None,
            parallel=config,
            device_type=device_type,
        )  # fmt: skip
        for i, (first, last) in enumerate(chunk_stages(sizes.num_chunks))
    ]


def megatron_config_kwargs(sizes: ParallelSizes, dtype: torch.dtype) -> dict[str, Any]:
    """``TransformerConfig`` fields the strategy decides: sizes, dtypes, p2p settings, per-token loss."""
    return {
        **sizes.megatron_kwargs(),
        **megatron_dtype_fields(dtype),
        "pipeline_dtype": dtype,
        # With pp=2 the next and the previous stage are the same peer. The interleaved schedule's batched
        # send/recv then posts [send_prev, recv_prev, send_next, recv_next] on both ranks, so an activation
        # is received as a gradient and vice versa (same shape: no error, silently wrong losses after the
        # warm-up; seen on gloo and NCCL). Unbatched p2p orders the ops so they match.
        "batch_p2p_comm": not (sizes.pp == 2 and sizes.vpp is not None),
        # Loss functions return sums; Megatron then divides gradients by the global batch's token count.
        "calculate_per_token_loss": True,
    }


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


@contextlib.contextmanager
def one_process(port: int, cpu: bool = False) -> Iterator[None]:
    """Megatron's parallel state for this one process (gloo, seed 0), for modules built and run without a Trainer:
    tests of single modules and benchmarks of single kernels. ``cpu``: inside CPU mode (``compat.cpu``), where
    Megatron's CUDA calls land on the CPU. ``port``: the default group's ``MASTER_PORT`` unless the environment sets
    one. Replaces any earlier state (:func:`initialize`); torn down on exit."""
    from lightning_megatron.compat import cpu as cpu_layer

    if not cpu and cpu_layer.is_enabled():  # e.g. a CPU test's fixture still open: CUDA would become CPU
        raise RuntimeError("one_process(cpu=False) inside CPU mode: run GPU work apart from CPU-mode work")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    elif torch.distributed.get_world_size() != 1:
        raise RuntimeError(f"one_process() in a group of {torch.distributed.get_world_size()} processes")
    with cpu_layer.cpu_mode() if cpu and not cpu_layer.is_enabled() else contextlib.nullcontext():
        try:
            initialize(ParallelSizes())
            seed(0)
            yield
        finally:
            destroy()
