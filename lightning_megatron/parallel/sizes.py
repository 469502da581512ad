"""Parallel sizes, validated before anything is built (no process group, no model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_megatron.validation import check_positive_int, divisors


@dataclass(frozen=True, kw_only=True)
class ParallelSizes:
    """The model-parallel layout. Data parallelism is what is left of the world: ``world / (tp * pp * cp)``."""

    tp: int = 1
    """Tensor-parallel size: each layer's weights are split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many consecutive stages."""
    vpp: int | None = None
    """Virtual pipeline size: model chunks per pipeline rank (interleaved 1F1B schedule), >= 2. Needs ``pp > 1``."""
    cp: int = 1
    """Context-parallel size: the sequence is split across this many ranks in attention."""
    ep: int = 1
    """Expert-parallel size: MoE experts are split across this many ranks."""
    sequence_parallel: bool = False
    """Split activations along the sequence in the non-tensor-parallel regions (norms, dropout). Needs ``tp > 1``."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            check_positive_int(name, getattr(self, name), " (1 disables this kind of parallelism)")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1:
                raise ValueError(f"vpp={self.vpp!r} must be None or a positive integer (model chunks per pp rank)")
            if self.pp == 1:
                raise ValueError(
                    f"vpp={self.vpp} needs pipeline parallelism, but pp=1; set pp>=2 (e.g. pp=2, vpp={self.vpp}) "
                    "or leave vpp=None"
                )
            if self.vpp == 1:
                raise ValueError(
                    "vpp=1 is one model chunk per pipeline rank, which is no interleaving (Megatron would then expect "
                    "virtual stages it does not build); leave vpp=None, or use vpp>=2 for the interleaved schedule"
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
            raise ValueError(
                f"world size {world_size} (devices x num_nodes) is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size}; with {world_size} processes "
                f"tp*pp*cp must be one of {divisors(world_size)}"
            )
        if world_size % (self.tp * self.pp * self.ep) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*ep = {self.tp}*{self.pp}*{self.ep}; "
                f"pick ep among {divisors(world_size // (self.tp * self.pp))}"
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
