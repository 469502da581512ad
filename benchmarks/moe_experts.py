"""MoE expert MLP alone (one GPU): the per-expert loop vs grouped GEMMs vs one dense MLP of the same FLOPs.

    PYTHONPATH=. python benchmarks/moe_experts.py
    PYTHONPATH=. python benchmarks/moe_experts.py --variants grouped,dense --iters 50

Forward + backward of Megatron's ``TEGroupedMLP`` over ``lightning_megatron.kernels.experts``' linears (SwiGLU,
router probabilities applied, bf16 weights and activations) on ``--tokens`` tokens routed top-``--topk`` to
``--experts`` experts (random router scores: about tokens x topk / experts rows per expert), default the MoE probe
of the design notes ("MoE probe": 16,384 tokens x top-8, 32 experts of ffn 768, hidden 2048). Variants:

* ``loop``: one ``mm`` per expert (``gemm="loop"``); ``grouped``: ``torch._grouped_mm`` (sm90+), chosen by the
  linears themselves (``gemm="auto"``; ``grouped_mm_calls_per_step`` in its row is 6 when it ran);
* ``grouped_main_grad``: grouped, the weight gradients accumulated in fp32 into a Megatron-style ``main_grad``
  (one fp32-output GEMM per expert), as training with ``gradient_accumulation_fusion`` runs them;
* ``gptoss_main_grad``: as ``grouped_main_grad`` with GPT-OSS's expert fields (a bias on fc1 and fc2, the clamped
  GLU ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, ``g`` clamped at 7): what they cost beside SwiGLU. Both
  activations run unfused here (the local backend's fields), while training on GPU fuses SwiGLU (Megatron's
  compiled weighted SwiGLU) and not GPT-OSS's: the model's gap is larger than this one;
* ``sequential_mlp``: Megatron's ``SequentialMLP`` with its local linears (the experts of the local layer spec);
* ``dense``: the same SwiGLU MLP as one expert over all routed rows (the same GEMM FLOPs, no grouping).

FLOPs counted: the GEMMs only, 3 x 2 x rows x hidden x 3 ffn (fc1 is [2 ffn, hidden]). Prints one JSON line per
variant. Timing: CUDA events over ``--iters`` iterations after ``--warmup``, weight gradients reset (set to None)
in each iteration as an optimizer step would leave them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

VARIANTS = ("loop", "grouped", "grouped_main_grad", "gptoss_main_grad", "sequential_mlp", "dense")


def moe_config(args: argparse.Namespace, gpt_oss: bool = False) -> Any:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_megatron.gpt.transformer import LOCAL_BACKEND

    fields = dict(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=16, ffn_hidden_size=args.ffn,
        moe_ffn_hidden_size=args.ffn, num_moe_experts=args.experts, moe_router_topk=args.topk,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, params_dtype=torch.bfloat16,
        bf16=True, moe_grouped_gemm=True,
    )  # fmt: skip
    if gpt_oss:  # the fields ModelConfig sets for GPT-OSS's experts (benchmarks/shapes.py: gptoss1b)
        fields |= dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                       activation_func_clamp_value=7.0)  # fmt: skip
    return TransformerConfig(**{**LOCAL_BACKEND, **fields})


def routed_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by expert ([tokens x topk, hidden] bf16), the per-expert counts (on the host, as Megatron's
    dispatcher hands them over) and the router probabilities of the rows."""
    scores = torch.randn(args.tokens, args.experts, device="cuda")
    probs, chosen = torch.topk(scores.softmax(dim=-1), args.topk, dim=-1)
    counts = torch.bincount(chosen.flatten(), minlength=args.experts).cpu()
    rows = args.tokens * args.topk
    x = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16)
    return x, counts, probs.flatten()[torch.argsort(chosen.flatten(), stable=True)].float()


def build_experts(variant: str, config: Any) -> torch.nn.Module:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import build_module

    from lightning_megatron.kernels.expert_mlp import grouped_mlp_spec

    groups = ProcessGroupCollection.use_mpu_process_groups()
    if variant == "sequential_mlp":
        local = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        return SequentialMLP(config.num_moe_experts, config, local, pg_collection=groups)
    fused = variant.endswith("_main_grad")
    module = build_module(grouped_mlp_spec(fuse_wgrad=fused), config.num_moe_experts, config, pg_collection=groups)
    if variant == "loop":  # the others: "auto", grouped where the GPU has it (measure() counts the kernel calls)
        module.linear_fc1.gemm = module.linear_fc2.gemm = "loop"
    if fused:  # what Megatron's DDP gives each weight
        for weight in (module.linear_fc1.weight, module.linear_fc2.weight):
            weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
            weight.grad_added_to_main_grad = False
    return module


def dense_step(args: argparse.Namespace) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    """The SwiGLU MLP as one dense expert over all rows: the same GEMMs, ungrouped."""
    fc1 = (torch.randn(2 * args.ffn, args.hidden, device="cuda") / args.hidden**0.5).bfloat16().requires_grad_()
    fc2 = (torch.randn(args.hidden, args.ffn, device="cuda") / args.ffn**0.5).bfloat16().requires_grad_()

    def step(x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, fc1).chunk(2, dim=-1)
        return F.linear((F.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype), fc2)

    return step, [fc1, fc2]


def time_ms(
    step: Callable[..., torch.Tensor], params: list[torch.Tensor], batch: tuple, args: argparse.Namespace
) -> float:
    """Mean milliseconds of forward + backward (CUDA events)."""
    x, counts, probs = batch
    grad = torch.randn_like(x)

    def once() -> None:
        for param in params:
            param.grad = None
        out = step(x.requires_grad_(), counts, probs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        x.grad = None

    for _ in range(args.warmup):
        once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.iters


def measure(variant: str, config: Any, batch: tuple, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_megatron.kernels.experts import grouped_mm_available

    if variant.startswith(("grouped", "gptoss")) and not grouped_mm_available():
        return {"skipped": "torch._grouped_mm needs a CUDA GPU of compute capability 9.0+"}
    if variant == "dense":
        step, params = dense_step(args)
    else:
        module = build_experts(variant, config)
        step, params = module, list(module.parameters())
    calls, grouped_mm = [0], torch._grouped_mm

    def counted(*a: Any, **kw: Any) -> torch.Tensor:
        calls[0] += 1
        return grouped_mm(*a, **kw)

    torch._grouped_mm = counted  # which path ran: 6 grouped GEMMs per step (fc1, fc2; forward, 2 backward)
    try:
        ms = time_ms(step, params, batch, args)
    finally:
        torch._grouped_mm = grouped_mm
    rows = args.tokens * args.topk
    flops = 3 * 2 * rows * args.hidden * 3 * args.ffn
    per_step = calls[0] / (args.warmup + args.iters)
    return {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "grouped_mm_calls_per_step": per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    from lightning_megatron.parallel.state import one_process

    with one_process(29671):  # gloo: the experts alone communicate nothing
        configs = {False: moe_config(args), True: moe_config(args, gpt_oss=True)}
        batch = routed_batch(args)
        counts = batch[1]
        common = {
            "num_moe_experts": args.experts, "moe_router_topk": args.topk, "tokens": args.tokens,
            "routed_rows": args.tokens * args.topk, "rows_per_expert": [int(counts.min()), int(counts.max())],
            "hidden_size": args.hidden, "moe_ffn_hidden_size": args.ffn,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        }  # fmt: skip
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                print(json.dumps({"variant": variant, "error": f"unknown variant: one of {', '.join(VARIANTS)}"}))
                continue
            config = configs[variant.startswith("gptoss")]
            print(json.dumps({"variant": variant, **measure(variant, config, batch, args), **common}), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
