"""Which kernels build the layers: ``ModelConfig.kernels`` ("auto", "torch", "te", "local") resolved for a device."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Literal, Protocol

import torch

Kernels = Literal["auto", "torch", "te", "local"]
Resolved = Literal["torch", "te", "local"]


@functools.cache
def te_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (it needs a CUDA toolchain to install)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken install (missing CUDA libraries) counts as absent
        return False
    return True


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (fp8's cast kernel on GPU; torch's CUDA builds for Linux bring it)."""
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True


def resolve(kernels: Kernels, device_type: str) -> Resolved:
    """The concrete kernel set for ``kernels`` on ``device_type`` ("cuda" or "cpu").

    ``"auto"``: Transformer Engine's spec when it imports, else the torch-native path, on GPU; the torch-native path
    on CPU, where it compiles nothing (:func:`~lightning_megatron.kernels.compile.for_device`) and runs the tiny
    test models as fast as Megatron's reference local spec. Not the local spec there: its attention takes neither
    packed batches (no document masks) nor context parallelism, and "auto" must never pick kernels that refuse the
    user's batch.
    """
    if kernels == "auto":
        if device_type != "cuda":
            return "torch"
        return "te" if te_available() else "torch"
    if kernels == "te":
        if not te_available():
            raise ValueError(
                "ModelConfig(kernels='te') needs Transformer Engine (`import transformer_engine.pytorch` failed); "
                "use kernels='torch' (torch-native fast path) or 'auto'"
            )
        if device_type != "cuda":
            raise ValueError("ModelConfig(kernels='te') runs on GPUs only; use kernels='torch' or 'local' on CPU")
    return kernels


def fuse_wgrad(requested: bool | None, kernels: Resolved, device_type: str) -> bool:
    """Whether the parallel linears accumulate weight gradients straight into ``main_grad`` (one fp32-output GEMM).

    ``requested`` is ``ModelConfig.gradient_accumulation_fusion``: None means on with ``'torch'`` on GPU where
    torch has the mixed-dtype GEMM (torch >= 2.11), off elsewhere; True asks for it with ``'torch'``/``'local'``
    on any device (on CPU an upcast GEMM: for tests); False keeps Megatron's unfused path.
    """
    from lightning_megatron.kernels.linear import mixed_dtype_addmm_available

    if kernels == "te":
        if requested:
            raise ValueError(
                "ModelConfig(gradient_accumulation_fusion=True) fuses the torch-native linears; Transformer Engine's "
                "linears fuse through their own kernels; leave gradient_accumulation_fusion=None with kernels='te'"
            )
        return False
    if requested is None:
        return kernels == "torch" and device_type == "cuda" and mixed_dtype_addmm_available()
    if requested and device_type == "cuda" and not mixed_dtype_addmm_available():
        raise ValueError(
            f"ModelConfig(gradient_accumulation_fusion=True) needs torch.addmm(out_dtype=float32) on CUDA, which "
            f"torch {torch.__version__} lacks; use torch >= 2.11 or gradient_accumulation_fusion=None"
        )
    return requested


def use_fp8(requested: str | None, kernels: Resolved, device_type: str) -> bool:
    """Whether the transformer layers' parallel linears run in fp8 (``ModelConfig.fp8``) on this rank's device."""
    from lightning_megatron.kernels.fp8 import fp8_supported

    if requested is None:
        return False
    if kernels == "te":
        raise ValueError(f"ModelConfig(fp8={requested!r}) with kernels='te': use precision='transformer-engine'")
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if not fp8_supported(device):
        where = "a CPU"
        if device.type == "cuda":
            capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
            where = f"{torch.cuda.get_device_name(device)} (compute capability {capability})"
        raise ValueError(
            f"ModelConfig(fp8={requested!r}) needs a GPU with fp8 tensor cores (compute capability >= 8.9: Ada, "
            f"Hopper or later), and this run is on {where}; use fp8=None there"
        )
    if device.type == "cuda" and not triton_available():  # the GPU cast kernel (kernels/fp8_triton.py)
        raise ValueError(
            f"ModelConfig(fp8={requested!r}) casts to fp8 with a Triton kernel, and Triton is not installed (torch's "
            "CUDA builds for Linux bring it); install the triton version your torch pins, or use fp8=None"
        )
    return True


def use_cuda_graphs(requested: bool, device_type: str) -> bool:
    """Whether the transformer layers run as Megatron's CUDA graphs (``ModelConfig.cuda_graphs``) on this device."""
    if requested and device_type != "cuda":
        raise ValueError(
            f"ModelConfig(cuda_graphs=True) captures CUDA graphs, and this run is on {device_type}; "
            "use cuda_graphs=False there"
        )
    return requested


def check_grouped_gemm(requested: bool | None, device_type: str) -> None:
    """Raise ``ValueError`` for ``ModelConfig(moe_grouped_gemm=True)`` where this rank's device has no grouped GEMMs
    (None falls back to the per-expert loop there; the experts module makes that choice when it runs)."""
    if requested is not True:
        return
    from lightning_megatron.kernels.experts import grouped_mm_available

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if not grouped_mm_available(device):
        where = "a CPU" if device.type != "cuda" else torch.cuda.get_device_name(device)
        raise ValueError(
            f"ModelConfig(moe_grouped_gemm=True) needs grouped GEMMs (torch._grouped_mm), and this run is on {where}, "
            "which has none; use moe_grouped_gemm=None (grouped GEMMs where the device has them, the per-expert loop "
            "elsewhere: the same parameters and checkpoints) or False"
        )


_DESCRIPTIONS = {
    "torch": "torch (SDPA attention with RoPE inside, or MLA's own; fused vocab-parallel cross entropy)",
    "local": "local (Megatron's reference torch spec: unfused attention)",
    "te": "te (Transformer Engine)",
}


def describe(kernels: Resolved, fused_wgrad: bool = False, fp8: str | None = None) -> str:
    """One line naming a resolved kernel set, and whether Transformer Engine is there (printed once per run);
    ``fp8``: the format of the transformer layers' fp8 GEMMs, if they run in fp8."""
    fused = "; weight gradients accumulated into fp32 main_grad in the GEMM" if fused_wgrad else ""
    fused += f"; fp8 GEMMs in the transformer layers ({fp8!r} format, per-tensor scaling)" if fp8 else ""
    return f"kernels: {_DESCRIPTIONS[kernels]}{fused}" + (
        "" if te_available() else "; Transformer Engine not installed"
    )


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How a GPT's chunks are built on one device, resolved once from ``ModelConfig`` before the first chunk:
    the kernel set, whether weight gradients accumulate into ``main_grad`` in the GEMM, whether the transformer
    layers' GEMMs run in fp8, and whether the layers run as CUDA graphs."""

    kernels: Resolved
    fused_wgrad: bool = False
    fp8: bool = False
    cuda_graphs: bool = False

    @classmethod
    def resolve(
        cls, config: PlanRequest, device_type: str, *, hf_weights: bool = False, lora: bool = False
    ) -> KernelPlan:
        """The plan for ``config`` on ``device_type``; ``hf_weights``/``lora``: the model loads HF weights / carries
        LoRA adapters, which both need the torch-native layers (``'auto'`` picks them; ``'te'`` is refused)."""
        kernels = resolve(config.kernels, device_type)
        for needed, what in ((hf_weights, "cannot load HF weights"), (lora, "takes no LoRA adapters")):
            if needed and kernels == "te":
                if config.kernels == "te":
                    raise ValueError(
                        f"ModelConfig(kernels='te') {what}: the HF mapping and LoRA target the torch-native layers "
                        "(Transformer Engine fuses the norms into its linear layers); use kernels='torch' or 'auto'"
                    )
                kernels = "torch"
        # 'auto' with TE, for layers only we build: MLA's core attention, experts with biases (GPT-OSS); ModelConfig
        # refuses an explicit 'te' for both.
        biased_experts = config.num_moe_experts is not None and config.add_bias_linear
        if kernels == "te" and (config.multi_latent_attention or biased_experts):
            kernels = "torch"
        if config.attention_variants and config.kernels == "auto":  # our block-sparse windows, sinks, soft-capping
            kernels = "torch"
        if config.attention_variants and kernels == "local" and device_type != "cuda":
            raise ValueError(  # Megatron's local attention builds its window mask and sink parameter on the GPU
                "ModelConfig(kernels='local') with attention variants (window_size, softmax_type, ...) needs a GPU; "
                "use kernels='torch' or 'auto' on CPU"
            )
        check_grouped_gemm(config.moe_grouped_gemm, device_type)
        return cls(
            kernels=kernels,
            fused_wgrad=fuse_wgrad(config.gradient_accumulation_fusion, kernels, device_type),
            fp8=use_fp8(config.fp8, kernels, device_type),
            cuda_graphs=use_cuda_graphs(config.cuda_graphs, device_type),
        )

    def describe(self, fp8_format: str | None = None) -> str:
        """One line for the run's log: :func:`describe` of this plan."""
        return describe(self.kernels, self.fused_wgrad, fp8_format if self.fp8 else None)


class PlanRequest(Protocol):
    """The ``ModelConfig`` fields a :class:`KernelPlan` is resolved from (a Protocol: this module imports no
    config)."""

    kernels: Kernels
    gradient_accumulation_fusion: bool | None
    fp8: str | None
    cuda_graphs: bool
    moe_grouped_gemm: bool | None
    multi_latent_attention: bool
    num_moe_experts: int | None
    add_bias_linear: bool
    attention_variants: bool
