"""Every patch of a third-party object, each one small object that says what it replaces, why, and when it can go.

The run-long patches are installed by :class:`~lightning_megatron.MegatronStrategy` through one :class:`PatchStack`
and removed, in reverse order, at its teardown: every removal runs even when another one (or an earlier teardown
step) raises, and removing twice does nothing. :class:`KeepAdamStepOnLoad` lives for one optimizer load only (a
``with`` block around it). Each docstring's ``Droppable when:`` line names the upstream version it was written
against; ``tests/test_patches.py`` checks that every patch is undone after a run, also after a failed teardown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch

from lightning_megatron.contract import RunPatch


class Patch:
    """A replacement of third-party attributes, undone by :meth:`remove` (idempotent)."""

    installed = False
    """Whether this object's replacement is in place (a patch may decline to install, e.g. when not needed)."""

    def install(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError

    def targets(self) -> list[tuple[Any, str]]:
        """``(owner, attribute)`` pairs this patch replaces while installed (what a test checks is restored)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class ModuleFunctions(Patch):
    """A patch that replaces named functions of one module (:meth:`module`) by :meth:`replacements` while installed,
    the originals kept in ``_originals`` (what the replacements hand calls back to)."""

    def __init__(self) -> None:
        self._originals: dict[str, Any] = {}

    def module(self) -> Any:
        raise NotImplementedError

    def replacements(self) -> dict[str, Any]:
        raise NotImplementedError

    def wanted(self) -> bool:
        """Whether to install (checked before anything is replaced)."""
        return True

    def install(self) -> None:
        if self.installed or not self.wanted():
            return
        module, replacements = self.module(), self.replacements()
        self._originals = {name: getattr(module, name) for name in replacements}
        for name, function in replacements.items():
            setattr(module, name, function)
        self.installed = True

    def remove(self) -> None:
        module = self.module()
        originals, self._originals = self._originals, {}
        self.installed = False
        for name, original in originals.items():
            setattr(module, name, original)

    def targets(self) -> list[tuple[Any, str]]:
        module = self.module()
        return [(module, name) for name in self.replacements()]


class CpuMode(Patch):
    """Megatron-Core on CPU over gloo: ``torch.cuda`` stand-ins and a ``TorchFunctionMode`` mapping CUDA to CPU.

    Megatron-Core calls ``torch.cuda.current_device()`` in ~200 places, builds ``device="cuda"`` tensors, uses CUDA
    streams, events and the CUDA RNG, and compares ``Tensor.type()`` to CUDA type names;
    :mod:`lightning_megatron.compat.cpu` has the stand-ins. Removes only what it installed (CPU mode already on, e.g.
    a test's ``cpu.cpu_mode()``, stays).

    Droppable when: megatron-core runs on a CPU device itself; not fixed upstream as of megatron-core 0.19.2.
    """

    def install(self) -> None:
        from lightning_megatron.compat import cpu

        if not self.installed and not cpu.is_enabled():
            cpu.enable()
            self.installed = True

    def remove(self) -> None:
        from lightning_megatron.compat import cpu

        if self.installed:
            self.installed = False
            cpu.disable()

    def targets(self) -> list[tuple[Any, str]]:
        from lightning_megatron.compat import cpu

        return [(owner, name) for owner, name, _ in cpu.stand_ins()]


class QuietRun(Patch):
    """Warning filters and log-record filters for the third-party notices the torch-native path always prints
    (:mod:`lightning_megatron.compat.quiet` lists them): about 60 lines per job that ask the user to do nothing.

    Droppable when: megatron-core stops warning about missing Transformer Engine/apex and its deprecated GPTModel,
    torch about its deprecated collectives, Lightning about ``LeafSpec``; none of that is fixed as of megatron-core
    0.19.2, torch 2.11, Lightning 2.6.
    """

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self._stack: contextlib.ExitStack | None = None

    def install(self) -> None:
        from lightning_megatron.compat import quiet

        if self._stack is None:
            with contextlib.ExitStack() as stack:
                stack.enter_context(quiet.run_filters(self._device_type))
                self._stack = stack.pop_all()
            self.installed = True

    def remove(self) -> None:
        stack, self._stack = self._stack, None
        self.installed = False
        if stack is not None:
            stack.close()

    def targets(self) -> list[tuple[Any, str]]:
        import warnings

        return [(warnings, "filters")]  # catch_warnings swaps the list; the logger filters are appended and removed


class ForeachClipGrads(ModuleFunctions):
    """Megatron's gradient clipping on torch's multi-tensor kernels, and the token-count division folded into it.

    Without Transformer Engine or apex, ``megatron.core.optimizer.clip_grads`` falls back to
    ``local_multi_tensor_l2_norm`` (one ``torch.norm`` per gradient tensor and a host read of the total: a GPU
    synchronisation per step) and rescales one tensor at a time, and lacks the tensor-scale kernel that lets Megatron
    keep the norm on the device (its no-synchronisation branch: gradients multiplied by ``min(1, clip / (norm +
    1e-6))`` on the GPU). Host timeline of raw Megatron-Core, 1B on an H200: 32.9 ms of waiting and 21.8 ms of GPU
    idle per 213 ms step. ``torch._foreach_norm`` / ``_foreach_mul_`` do the same arithmetic in a few kernels.
    ``OptimizerConfig`` has no hook for these functions, hence the patch of the module's three ``*_impl`` names.

    :meth:`token_scale` is the one channel of the deferred division by the global batch's token count
    (``parallel/ddp.py:TokenScaleDeferringDDP``): Megatron's ``finalize_model_grads(num_tokens=...)`` would divide
    every gradient in one more pass (2.9 ms of a 195 ms step for 1B parameters on an H200) right before clipping
    multiplies them all again; here the clipping's multiply applies both. Installs nothing when Transformer Engine's
    or apex's kernels are in use (:attr:`installed` stays False).

    Droppable when: megatron-core's torch-native fallback uses multi-tensor kernels with a device-side clip
    coefficient and accepts a gradient pre-scale; not fixed upstream as of megatron-core 0.19.2.
    """

    def __init__(self) -> None:
        super().__init__()
        self._token_scale: torch.Tensor | float | None = None

    def module(self) -> Any:
        from megatron.core.optimizer import clip_grads

        return clip_grads

    def replacements(self) -> dict[str, Any]:
        return {"l2_norm_impl": self._l2_norm, "multi_tensor_scale_impl": self._scale,
                "multi_tensor_scale_tensor_impl": self._scale_by_tensor}  # fmt: skip

    def wanted(self) -> bool:
        from megatron.core import utils

        return self.module().l2_norm_impl is utils.local_multi_tensor_l2_norm  # not TE's or apex's kernels

    @contextlib.contextmanager
    def token_scale(self, factor: torch.Tensor | float | None) -> Iterator[None]:
        """While Megatron's optimizer steps in this block, its gradients are still to be multiplied by ``factor``:
        the norm is computed for the multiplied gradients and the clipping multiply applies ``factor`` with the clip
        coefficient. Only valid when Megatron clips (``clip_grad > 0``): otherwise nothing would apply it."""
        if factor is not None and not self.installed:
            raise RuntimeError("ForeachClipGrads.token_scale needs the patch installed")
        self._token_scale = factor
        try:
            yield
        finally:
            self._token_scale = None

    def _l2_norm(self, chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], *args: Any) -> tuple:
        # apex's amp_C.multi_tensor_l2norm contract (through Megatron's local multi_tensor_applier): the L2 norm of
        # all tensors together as a float32 tensor of shape [1], left on the device.
        norms = torch._foreach_norm(tensor_lists[0])
        norm = torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1)
        return (norm if self._token_scale is None else norm * self._token_scale), None  # the norm scales linearly

    @staticmethod
    def _scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: Any) -> None:
        # amp_C.multi_tensor_scale's contract: dst = src * scale, tensor by tensor.
        src, dst = tensor_lists
        if not dst:  # a rank without gradients to clip (Megatron filters by .grad); torch's foreach ops refuse []
            return
        if all(s is d for s, d in zip(src, dst, strict=True)):
            torch._foreach_mul_(dst, scale)
        else:
            torch._foreach_copy_(dst, torch._foreach_mul(src, scale))

    def _scale_by_tensor(
        self, chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: Any
    ) -> None:
        # Transformer Engine's multi_tensor_scale_tensor contract: dst = src * scale, the scale a one-element device
        # tensor (Megatron's clip coefficient, never read on the host; only the clipping calls it).
        if self._token_scale is not None:
            scale = scale * self._token_scale
        self._scale(chunk_size, noop_flag, tensor_lists, scale.reshape(()))


class KeepAdamStepOnLoad(Patch):
    """Let a ``fully_reshardable`` load of the distributed optimizer skip torch Adam's ``step`` tensor.

    ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every tensor of the torch optimizer's
    per-parameter state from the checkpoint, ``step`` included, but the checkpoint restores ``step`` through the
    param groups and has no per-parameter entry (``KeyError: 'step'``). Megatron skips entries whose source is not a
    tensor, so the method is handed ``step=None``. Replaced on the given optimizer's instances only (the parts of a
    ``ChainedOptimizer``), for one ``with`` block around the load.

    Droppable when: megatron-core's torch-native path loads ``fully_reshardable`` Adam state without a
    per-parameter ``step``; not fixed upstream as of megatron-core 0.19.2.
    """

    _NAME = "_set_main_param_and_optimizer_states"

    def __init__(self, optimizer: Any) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        parts = getattr(optimizer, "chained_optimizers", [optimizer])
        self._parts = [part for part in parts if isinstance(part, DistributedOptimizer)]

    def install(self) -> None:
        if self.installed:
            return
        for part in self._parts:
            original = getattr(part, self._NAME)

            def set_states(model_param: Any, tensors: dict[str, Any], original: Any = original) -> None:
                original(model_param, {"step": None, **tensors})

            setattr(part, self._NAME, set_states)  # an instance attribute: the class keeps Megatron's method
        self.installed = True

    def remove(self) -> None:
        self.installed = False
        for part in self._parts:
            vars(part).pop(self._NAME, None)

    def targets(self) -> list[tuple[Any, str]]:
        return [(part, self._NAME) for part in self._parts]


class UniformTokenPermutation(ModuleFunctions):
    """MoE token permutation by gathers and sums instead of atomic adds (:mod:`lightning_megatron.kernels.permute`).

    Without Transformer Engine, Megatron's token dispatchers call ``moe_utils.permute`` / ``unpermute``, whose
    ``index_select`` backward (``index_add_``) and ``scatter_add_`` add each token's ``k`` expert rows atomically in
    bf16: 1.6 ms per MoE layer and micro-batch at 16,384 tokens x top-8 x hidden 2048 on an H100, the largest cost of
    an MoE layer after its GEMMs. The dispatchers take no permutation function as a parameter (``moe_permute_fusion``
    selects Transformer Engine's), hence the patch of the two names in ``token_dispatcher``. Takes over only calls it
    reproduces exactly -- no fusion, no dropping and padding, a host-known ``num_out_tokens`` of ``k`` rows per token,
    no probs at unpermute -- and hands every other call to Megatron's functions.

    Droppable when: megatron-core's torch-native permutation avoids atomic adds for dropless routing; not fixed
    upstream as of megatron-core 0.19.2.
    """

    def __init__(self, kernels: Any) -> None:
        """``kernels``: :mod:`lightning_megatron.kernels.permute` (passed in: this module sits below the kernels)."""
        super().__init__()
        self._kernels = kernels

    def module(self) -> Any:
        from megatron.core.transformer.moe import token_dispatcher

        return token_dispatcher

    def replacements(self) -> dict[str, Any]:
        return {"permute": self._permute, "unpermute": self._unpermute}

    def _permute(
        self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
        num_out_tokens: Any = None, fused: bool = False, drop_and_pad: bool = False, **kwargs: Any,
    ) -> Any:  # fmt: skip
        num_tokens = tokens.shape[0]
        uniform = isinstance(num_out_tokens, int) and num_tokens > 0 and num_out_tokens % num_tokens == 0
        if fused or drop_and_pad or kwargs or not uniform or num_out_tokens == 0:
            original = self._originals["permute"]
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad, **kwargs)  # fmt: skip
        k = num_out_tokens // num_tokens
        rows, permuted_probs, sorted_indices = self._kernels.permute(tokens, routing_map, k, probs)
        return rows, permuted_probs, sorted_indices, None, None  # no padding offsets; tokens_per_expert not given

    def _unpermute(
        self, permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: Any,
        probs: torch.Tensor | None = None, routing_map: torch.Tensor | None = None, fused: bool = False,
        drop_and_pad: bool = False, **kwargs: Any,
    ) -> Any:  # fmt: skip
        if fused or drop_and_pad or probs is not None or kwargs or not self._kernels.has_token_order(sorted_indices):
            original = self._originals["unpermute"]
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad, **kwargs)  # fmt: skip
        return self._kernels.unpermute(permuted_tokens, sorted_indices, restore_shape[0])


class ThreadedShardReads(ModuleFunctions):
    """Megatron's ``torch_dist`` loads read through the reader ``make_reader(checkpoint_dir)`` builds: the package's
    reader that reads a rank's tensors in several threads (:mod:`lightning_megatron.checkpointing.load.reading`).

    ``TorchDistLoadShardedStrategy.load`` builds its storage reader itself (``_get_filesystem_reader`` in
    ``dist_checkpointing.strategies.torch``), a ``FileSystemReader`` that deserialises one tensor after the other:
    slower than the disk for gigabytes. Replaced for one ``with`` block around a load; where Megatron chose another
    reader than the plain one (multi-storage client, cached metadata), Megatron's is used.

    Droppable when: megatron-core's load strategy takes a storage reader or a thread count; not as of megatron-core
    0.19.2.
    """

    def __init__(self, make_reader: Callable[[Any], Any]) -> None:
        """``make_reader``: ``checkpoint_dir -> FileSystemReader`` (passed in: this module sits below the package's
        checkpointing)."""
        super().__init__()
        self._make_reader = make_reader
        self.readers: list[Any] = []
        """The readers ``make_reader`` made while installed (the load's timeline counts their parts)."""
        self.kept = 0
        """Loads that kept Megatron's own reader (another than the plain one)."""

    def module(self) -> Any:
        from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

        return torch_strategy

    def replacements(self) -> dict[str, Any]:
        return {"_get_filesystem_reader": self._reader}

    def _reader(self, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        reader = self._originals["_get_filesystem_reader"](checkpoint_dir, *args, **kwargs)
        if type(reader) is FileSystemReader:
            reader = self._make_reader(checkpoint_dir)
            self.readers.append(reader)
        else:
            self.kept += 1
        return reader


RUN_PATCHES: tuple[type[Patch], ...] = (QuietRun, CpuMode, UniformTokenPermutation, ForeachClipGrads)
"""The patches a run of the strategy installs (in this order; CPU mode only on CPU, the MoE permutation only for a
model with experts -- the GPT family's ``gpt/hooks.py`` asks for it --, clipping only for fit)."""


def run_patches(device_type: str) -> list[Patch]:
    """The patches every run installs when it starts, whatever its model: the quiet notices of the torch-native
    path, and CPU mode on ``"cpu"``."""
    return [QuietRun(device_type), *([CpuMode()] if device_type == "cpu" else [])]


class PatchStack:
    """The patches of one run: :meth:`install` as the run needs them, :meth:`remove` all at its teardown."""

    def __init__(self) -> None:
        self._patches: list[RunPatch] = []

    @property
    def installed(self) -> list[RunPatch]:
        """The patches in place now, in installation order."""
        return [patch for patch in self._patches if patch.installed]

    def install[P: RunPatch](self, patch: P) -> P:
        """Install ``patch`` and keep it for :meth:`remove` (kept even if its install raises part-way)."""
        self._patches.append(patch)
        patch.install()
        return patch

    def get[P: RunPatch](self, kind: type[P]) -> P | None:
        """The patch of type ``kind`` this stack holds (installed or declined), if any."""
        return next((p for p in self._patches if isinstance(p, kind)), None)

    def remove(self) -> None:
        """Remove every patch, the last installed first; each removal runs even if another raises (the first error
        is raised at the end). Idempotent."""
        patches, self._patches = self._patches, []
        error: BaseException | None = None
        for patch in reversed(patches):
            try:
                patch.remove()
            except BaseException as caught:  # noqa: BLE001  (the rest must be removed whatever happened)
                error = error or caught
        if error is not None:
            raise error
