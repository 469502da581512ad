"""The MoE experts' weight gradients as one Triton kernel per projection, accumulated in fp32 into ``main_grad``.

With Megatron's fp32 ``main_grad`` buffers the expert linears (:mod:`.experts`) accumulate each expert's weight
gradient ``grad_e^T @ x_e`` with one fp32-output GEMM per expert: on a GPU, one launch per expert and projection
(``aten::addmm``: about 64 us of host time each in a profiled H100 run), so that the host's launches outlast the
GPU's work in an MoE backward. This kernel does all experts of a projection in one launch: program ``(o, i, e)``
sums expert ``e``'s rows (its range read from the device offsets, no host counts) into an fp32 tile and adds it to
``main_grad[e]``'s tile -- no bf16 copy of the gradient, no extra pass over ``main_grad``. Imported only on CUDA
(Triton comes with torch's CUDA builds) and by the CPU test that runs it in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCKS = (128, 128, 64)  # (out, in, tokens) per program and loop step on a GPU


@triton.jit
def _accumulate(
    grad_ptr, x_ptr, main_ptr, offs_ptr, OUT, IN,
    stride_gt, stride_go, stride_xt, stride_xi, stride_me, stride_mo, stride_mi,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid_o, pid_i, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)  # the expert's rows: [start, end)
    end = tl.load(offs_ptr + e)
    o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for first in range(start, end, BLOCK_T):
        t = first + tl.arange(0, BLOCK_T)
        rows = t < end
        t = t.to(tl.int64)  # row offsets: tokens x stride can pass 2**31
        g = tl.load(grad_ptr + t[:, None] * stride_gt + o[None, :] * stride_go,
                    mask=rows[:, None] & (o[None, :] < OUT), other=0.0)  # fmt: skip
        x = tl.load(x_ptr + t[:, None] * stride_xt + i[None, :] * stride_xi,
                    mask=rows[:, None] & (i[None, :] < IN), other=0.0)  # fmt: skip
        acc += tl.dot(tl.trans(g), x)  # [BLOCK_O, BLOCK_T] x [BLOCK_T, BLOCK_I], fp32 accumulation
    inside = (o[:, None] < OUT) & (i[None, :] < IN)
    tile = main_ptr + e.to(tl.int64) * stride_me + o[:, None] * stride_mo + i[None, :] * stride_mi
    tl.store(tile, tl.load(tile, mask=inside) + acc, mask=inside)


def accumulate_expert_wgrad(
    main: Tensor, grad: Tensor, x: Tensor, offs: Tensor, blocks: tuple[int, int, int] = _BLOCKS
) -> None:
    """``main[e] += grad_e^T @ x_e`` for every expert ``e`` in one launch: ``main`` ``[E, out, in]`` fp32,
    ``grad`` ``[T, out]`` and ``x`` ``[T, in]`` with the tokens sorted by expert, ``offs`` the int32 cumulative
    token counts ``[E]`` on the same device. ``blocks``: the (out, in, tokens) tile sizes, each at least 16."""
    experts, out, size_in = main.shape
    fits = grad.shape[0] == x.shape[0] and grad.shape[1] == out and x.shape[1] == size_in and grad.dtype == x.dtype
    if main.dtype != torch.float32 or not fits or offs.numel() != experts or min(blocks) < 16:
        raise ValueError(
            f"expert wgrad: main {tuple(main.shape)} {main.dtype}, grad {tuple(grad.shape)}, x {tuple(x.shape)}, "
            f"offs {tuple(offs.shape)}, blocks {blocks} do not fit (fp32 main [E, out, in], grad [T, out] and x "
            "[T, in] of one dtype, offs [E], tiles of at least 16)"
        )
    block_o, block_i, block_t = blocks
    grid = (triton.cdiv(out, block_o), triton.cdiv(size_in, block_i), experts)
    _accumulate[grid](
        grad, x, main, offs, out, size_in, grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
        main.stride(0), main.stride(1), main.stride(2), BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_T=block_t,
        num_warps=8 if block_o * block_i >= 128 * 128 else 4, num_stages=3,
    )  # fmt: skip
