"""What the GPT family needs of the strategy around the step (:class:`~lightning_megatron.contract.ModelHooks`).

* the MoE token permutation without atomic adds (``patches.UniformTokenPermutation``), for models with experts only;
* fp8 weight casts (``ModelConfig.fp8``), kept between steps: stale after every optimizer update, dropped when the
  weights leave the GPU or the run ends;
* Megatron's per-layer CUDA graphs (``ModelConfig.cuda_graphs``): fresh for each fit, released when it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_megatron.compat import patches
from lightning_megatron.contract import ModelHooks, RunPatch
from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.kernels import fp8, permute
from lightning_megatron.training import graphs


class GPTHooks(ModelHooks):
    """The GPT family's hooks for a module of ``config``."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def run_patches(self, device_type: str) -> list[RunPatch]:
        return [patches.UniformTokenPermutation(permute)] if self.config.num_moe_experts else []

    def fit_starting(self, chunks: Sequence[nn.Module]) -> None:
        graphs.renew(chunks)  # with ModelConfig.cuda_graphs: this fit records and captures its own graphs

    def weights_updated(self) -> None:
        fp8.weights_changed()  # Megatron's optimizer writes the weights in place: the kept casts are stale

    def weights_released(self, chunks: Sequence[nn.Module]) -> None:
        fp8.forget_weight_casts(chunks)

    def run_ended(self, chunks: Sequence[nn.Module]) -> None:
        graphs.release(chunks)  # Megatron's process-wide graph state
        fp8.forget_weight_casts(chunks)  # the graphs that wrote into them are gone: free their memory
