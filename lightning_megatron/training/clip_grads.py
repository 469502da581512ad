"""Megatron-Core's gradient clipping on torch's multi-tensor kernels, where it fell back to per-tensor loops.

A process-wide patch of ``megatron.core.optimizer.clip_grads``, installed by the strategy while it trains and
removed at teardown (:func:`restore_clip_grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_LOCAL_CLIP_GRADS: dict[str, Any] = {}  # megatron-core's own fallbacks while ours are installed
_TOKEN_SCALE: list[Any] = []  # while the optimizer steps: the factor the gradients still wait for (token_scale)


@contextlib.contextmanager
def token_scale(factor: torch.Tensor | float | None) -> Iterator[None]:
    """While Megatron's optimizer steps in this block, its gradients are still to be multiplied by ``factor`` (the
    division by the global batch's token count, deferred by ``parallel/ddp.py:TokenScaleDeferringDDP``): the
    gradient norm is computed for the multiplied gradients (the norm times ``factor``) and the clipping multiply
    applies ``factor`` together with the clip coefficient -- one pass over the gradients instead of two.

    Only valid when Megatron clips (``clip_grad > 0``) with the kernels :func:`use_foreach_clip_grads` installed:
    otherwise nothing would apply ``factor``.
    """
    if factor is None:
        yield
        return
    if not _LOCAL_CLIP_GRADS:
        raise RuntimeError("token_scale needs the clipping kernels of use_foreach_clip_grads()")
    _TOKEN_SCALE.append(factor)
    try:
        yield
    finally:
        _TOKEN_SCALE.clear()


def use_foreach_clip_grads() -> bool:
    """Give megatron-core's gradient clipping torch's multi-tensor kernels where it fell back to per-tensor loops.

    Without Transformer Engine or apex, ``megatron.core.optimizer.clip_grads`` computes the gradient norm with one
    ``torch.norm`` and one host read per parameter tensor -- a GPU synchronisation each, ~100 per step for a
    16-layer model -- and rescales clipped gradients one tensor at a time. ``torch._foreach_norm`` and
    ``torch._foreach_mul_`` (what ``torch.nn.utils.clip_grad_norm_`` uses) do the same arithmetic in a few kernels.

    It also supplies the tensor-scale kernel that only Transformer Engine provides, which switches Megatron to its
    no-synchronisation branch: the total norm stays a device tensor and gradients are multiplied by
    ``min(1, clip / (norm + 1e-6))`` on the GPU, unconditionally (a multiply by exactly 1.0 when not clipping: the
    same values).
    Otherwise Megatron reads the norm on the host in every step, which drains the GPU's queue before the optimizer
    runs (host timeline of raw Megatron-Core, 1B on an H200: 32.9 ms of waiting and 21.8 ms of GPU idle per 213 ms
    step, while the host refills the queue). Process-wide until :func:`restore_clip_grads`; does nothing (returns
    False) when Transformer Engine's or apex's kernels are in use.
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if _LOCAL_CLIP_GRADS or clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return bool(_LOCAL_CLIP_GRADS)
    _LOCAL_CLIP_GRADS.update(
        l2_norm_impl=clip_grads.l2_norm_impl,
        multi_tensor_scale_impl=clip_grads.multi_tensor_scale_impl,
        multi_tensor_scale_tensor_impl=clip_grads.multi_tensor_scale_tensor_impl,
    )
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    clip_grads.multi_tensor_scale_tensor_impl = _foreach_scale_by_tensor
    return True


def restore_clip_grads() -> None:
    """Put megatron-core's own fallbacks back (see :func:`use_foreach_clip_grads`)."""
    from megatron.core.optimizer import clip_grads

    for name, fn in _LOCAL_CLIP_GRADS.items():
        setattr(clip_grads, name, fn)
    _LOCAL_CLIP_GRADS.clear()


def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], *args: Any) -> tuple:
    # Same contract as apex's amp_C.multi_tensor_l2norm (through Megatron's local multi_tensor_applier):
    # the L2 norm of all tensors together as a float32 tensor of shape [1], left on the device.
    norms = torch._foreach_norm(tensor_lists[0])
    norm = torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1)
    return (norm * _TOKEN_SCALE[0] if _TOKEN_SCALE else norm), None  # a deferred factor: scales linearly


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    # amp_C.multi_tensor_scale's contract: dst = src * scale, tensor by tensor.
    src, dst = tensor_lists
    if not dst:  # a rank without gradients to clip (Megatron filters by .grad); torch's foreach ops refuse []
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _foreach_scale_by_tensor(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: Any
) -> None:
    # Transformer Engine's multi_tensor_scale_tensor contract: dst = src * scale, the scale a one-element device
    # tensor (Megatron's clip coefficient, never read on the host; only the clipping calls it).
    if _TOKEN_SCALE:
        scale = scale * _TOKEN_SCALE[0]
    _foreach_scale(chunk_size, noop_flag, tensor_lists, scale.reshape(()))
