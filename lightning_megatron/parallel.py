"""Parallel sizes: validation before anything is built, and Megatron's parallel state init/teardown.

These are the only two places that touch ``megatron.core.parallel_state``'s globals to create or destroy them
(:func:`initialize` and :func:`destroy`); everything else reads ranks through small helpers below.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class ParallelSizes:
    """The model-parallel layout. Data parallelism is what is left of the world: ``world / (tp * pp * cp)``."""

    tp: int = 1
    """Tensor-parallel size: each layer's weights are split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many consecutive stages."""
    vpp: int | None = None
    """Virtual pipeline size: model chunks per pipeline rank (interleaved 1F1B schedule). Needs ``pp > 1``."""
    cp: int = 1
    """Context-parallel size: the sequence is split across this many ranks in attention."""
    ep: int = 1
    """Expert-parallel size: MoE experts are split across this many ranks."""
    sequence_parallel: bool = False
    """Split activations along the sequence in the non-tensor-parallel regions (norms, dropout). Needs ``tp > 1``."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer (1 disables this kind of parallelism)")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1:
                raise ValueError(f"vpp={self.vpp!r} must be None or a positive integer (model chunks per pp rank)")
            if self.pp == 1:
                raise ValueError(
                    f"vpp={self.vpp} needs pipeline parallelism, but pp=1; set pp>=2 (e.g. pp=2, vpp={self.vpp}) "
                    "or leave vpp=None"
                )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=True splits activations across tensor-parallel ranks, but tp=1; "
                "set tp>=2 or sequence_parallel=False"
            )

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def num_chunks(self) -> int:
        """Model chunks held by one rank: ``vpp`` with interleaving, else 1."""
        return self.vpp or 1

    def data_parallel_size(self, world_size: int) -> int:
        """Validate the layout against ``world_size`` and return the data-parallel size."""
        if world_size % self.model_parallel_size != 0:
            fits = [d for d in _divisors(world_size)]
            raise ValueError(
                f"world size {world_size} (devices x num_nodes) is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size}; with {world_size} processes "
                f"tp*pp*cp must be one of {fits}"
            )
        if world_size % (self.tp * self.pp * self.ep) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*ep = {self.tp}*{self.pp}*{self.ep}; "
                f"pick ep among {[d for d in _divisors(world_size // (self.tp * self.pp))]}"
            )
        return world_size // self.model_parallel_size

    def megatron_kwargs(self) -> dict[str, Any]:
        """The ``ModelParallelConfig`` fields these sizes set."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "sequence_parallel": self.sequence_parallel,
        }


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
    from megatron.core import parallel_state

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
    import os

    if seed is not None:
        return seed
    return int(os.environ.get("PL_GLOBAL_SEED", 1234))
