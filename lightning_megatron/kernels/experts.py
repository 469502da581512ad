"""MoE experts as grouped GEMMs: torch-native linears for Megatron's ``TEGroupedMLP``, without Transformer Engine.

Megatron-Core 0.19's ``TEGroupedMLP`` builds its two expert linears from pluggable builders (the
``GroupedLinearFc1Builder`` / ``GroupedLinearFc2Builder`` protocols). :class:`GroupedColumnLinear` and
:class:`GroupedRowLinear` are such builders. Each holds all local experts in ONE parameter ``weight`` of shape
``[num_local_experts, out, in]`` (per expert-TP rank) and runs them with ``torch._grouped_mm`` (one kernel per
GEMM, CUDA sm90+, bf16) where the device has it, else one ``mm`` per expert (the CPU / reference path). With
``fuse_wgrad`` the weight gradient accumulates in fp32 straight into Megatron's ``main_grad`` (as
:mod:`lightning_megatron.kernels.linear` does for the dense linears).

Checkpoints are interchangeable with Megatron's ``SequentialMLP``: each expert's slice is saved under the same
sharded key, global shape and expert offset as SequentialMLP's per-expert linear (the SwiGLU fc1 split into its
gate and up halves, as Megatron's MLP does). There is no communication inside: the token dispatcher gathers the
tokens over the expert-TP group before fc1 and reduce-scatters fc2's partial sums after it.

The token counts arrive as an :class:`~lightning_megatron.kernels.expert_counts.ExpertCounts` (from
:class:`~lightning_megatron.kernels.expert_mlp.GroupedMLP`) or a list (from ``TEGroupedMLP``): the grouped kernels
read them on the device; the loops, and the fp32 weight-gradient accumulation in the backward, on the host.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_pg_rank, get_pg_size, make_tp_sharded_tensor_for_checkpoint
from torch import Tensor, nn

from lightning_megatron.kernels.expert_counts import ExpertCounts
from lightning_megatron.kernels.linear import accumulate_wgrad, mixed_dtype_addmm_available

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

Gemm = Literal["auto", "grouped", "loop"]


@functools.cache
def _grouped_mm_runs(index: int) -> bool:
    """Whether CUDA device ``index`` is sm90+ and ``torch._grouped_mm`` computes a grouped product on it."""
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    device = torch.device("cuda", index)
    try:  # fixed inputs, not drawn: the probe runs lazily, and must not move the CUDA generator of a training run
        x = (torch.arange(32 * 16, device=device) % 7 - 3).reshape(32, 16).to(torch.bfloat16) / 4
        w = (torch.arange(2 * 16 * 16, device=device) % 5 - 2).reshape(2, 16, 16).to(torch.bfloat16) / 4  # [E, out, in]
        offs = torch.tensor([8, 32], device=device, dtype=torch.int32)
        got = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    want = torch.cat([x[:8] @ w[0].t(), x[8:] @ w[1].t()])
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


def grouped_mm_available(device: torch.device | str | int | None = None) -> bool:
    """Whether the experts can run as grouped GEMMs (``torch._grouped_mm``) on ``device`` (default: the current
    CUDA device): a CUDA GPU of compute capability 9.0 or newer (H100/H200, B200) on which a probe GEMM runs."""
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return False
    return _grouped_mm_runs(torch.cuda.current_device() if device.index is None else device.index)


def _aligned(t: Tensor) -> Tensor:
    """2-D ``t`` row-major with its canonical strides (``contiguous()`` lets a size-1 dimension keep any stride),
    starting at a 16-byte boundary: the layout the grouped kernel's checks and TMA loads need."""
    if t.stride() == (t.shape[1], 1) and t.data_ptr() % 16 == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _spans(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` row ranges of the experts that got tokens."""
    ends = list(itertools.accumulate(counts))
    return [(i, end - n, end) for i, (n, end) in enumerate(zip(counts, ends, strict=True)) if n]


def _forward_gemm(x: Tensor, weight: Tensor, counts: ExpertCounts, offs: Tensor | None) -> Tensor:
    """``x_e @ weight[e].t()`` for each expert's rows: [T, in] -> [T, out]."""
    if offs is not None:  # the kernel wants the weight column-major: [E, out, in] viewed as [E, in, out]
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    out = x.new_empty(x.shape[0], weight.shape[1])
    for e, start, end in _spans(counts.host()):
        torch.mm(x[start:end], weight[e].t(), out=out[start:end])
    return out


def _dgrad(grad: Tensor, weight: Tensor, counts: ExpertCounts, offs: Tensor | None) -> Tensor:
    """Input gradient ``grad_e @ weight[e]``: [T, out] -> [T, in]."""
    if offs is not None:
        return torch._grouped_mm(grad, weight, offs=offs)
    out = grad.new_empty(grad.shape[0], weight.shape[2])
    for e, start, end in _spans(counts.host()):
        torch.mm(grad[start:end], weight[e], out=out[start:end])
    return out


def _wgrad(grad: Tensor, x: Tensor, weight: Tensor, counts: ExpertCounts, offs: Tensor | None) -> Tensor:
    """Weight gradient ``grad_e^T @ x_e`` per expert, in the weight's dtype: [E, out, in]; zeros for experts
    without tokens."""
    if offs is not None:  # [out, T] x [T, in], grouped along the tokens
        out = torch._grouped_mm(grad.t(), x, offs=offs)
        for e, n in enumerate(counts.host()):
            if not n:  # an empty contraction: not every kernel writes its output
                out[e].zero_()
        return out
    out = torch.zeros_like(weight)
    for e, start, end in _spans(counts.host()):
        torch.mm(grad[start:end].t(), x[start:end], out=out[e])
    return out


def _accumulate_main_grad(weight: Tensor, grad: Tensor, x: Tensor, counts: ExpertCounts, offs: Tensor | None) -> None:
    """``weight.main_grad[e] += grad_e^T @ x_e`` in fp32, one GEMM per expert with an fp32 output (the bf16
    products accumulated as apex's fused wgrad does); where CUDA lacks that GEMM, the grouped wgrad plus an add.
    (Measured slower on an H100 than the per-expert fp32 GEMMs: a grouped bf16 wgrad plus an fp32 add, and one
    Triton kernel for all experts of a projection -- 6% fewer tokens/s in training, its tiles at 250-390 TFLOP/s.)"""
    main = weight.main_grad
    if main.is_cuda and main.dtype != grad.dtype and not mixed_dtype_addmm_available():
        main.add_(_wgrad(grad, x, weight, counts, offs))
        return
    # One split per tensor: the host's time per expert is what this loop costs on a GPU. The host counts are
    # ready by now: their copy was queued in the forward.
    sizes = counts.host()
    for main_e, grad_e, x_e, n in zip(main.unbind(0), grad.split(sizes), x.split(sizes), sizes, strict=True):
        if n:
            accumulate_wgrad(main_e, grad_e, x_e)


def _check_rows(counts: ExpertCounts, rows: int) -> None:
    """Refuse counts that do not add up to the rows (read on the host: where they are not yet, this waits)."""
    if sum(counts.host()) != rows:
        raise ValueError(f"tokens_per_expert {list(counts.host())} must add up to the {rows} rows given")


def _has_main_grad(weight: Tensor) -> bool:
    """Whether Megatron's DDP gave ``weight`` a ``main_grad`` buffer (it also sets ``grad_added_to_main_grad``)."""
    return getattr(weight, "main_grad", None) is not None and hasattr(weight, "grad_added_to_main_grad")


def _placeholder(weight: Tensor) -> Tensor:
    """The gradient that still reaches the weight's AccumulateGrad node once the real one is in ``main_grad``:
    Megatron's DDP hook runs there (starting the bucket's reduction) and, told by ``grad_added_to_main_grad``,
    does not add it -- unless the weight is shared (``zero_out_wgrad``), where it adds it, so zeros (as
    kernels/linear.py's dense linears do)."""
    weight.grad_added_to_main_grad = True
    return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)


class _GroupedLinearFn(torch.autograd.Function):
    """Per-expert ``x_e @ weight[e].t()`` on tokens sorted by expert; ``grouped`` selects the grouped kernel (its
    offsets on the device: no wait for the host counts), else the per-expert loop. With ``into_main_grad`` the
    backward adds the weight gradient to ``weight.main_grad`` and returns the placeholder Megatron's DDP hook
    expects."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, counts: ExpertCounts, grouped: bool, into_main_grad: bool
    ) -> Tensor:
        offs = counts.offsets(x.device) if grouped else None
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.offs, ctx.into_main_grad = counts, offs, into_main_grad
        return _forward_gemm(x, weight, counts, offs)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        _check_rows(ctx.counts, x.shape[0])
        grad = _aligned(grad_output) if ctx.offs is not None else grad_output.contiguous()
        grad_x = _dgrad(grad, weight, ctx.counts, ctx.offs) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1] and ctx.into_main_grad:
            _accumulate_main_grad(weight, grad, x, ctx.counts, ctx.offs)
            grad_weight = _placeholder(weight)
        elif ctx.needs_input_grad[1]:
            grad_weight = _wgrad(grad, x, weight, ctx.counts, ctx.offs)
        return grad_x, grad_weight, None, None, None


def _check_config(config: TransformerConfig) -> None:
    """Refuse settings whose ``TEGroupedMLP`` path needs Transformer Engine or support we do not have."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if config.fp8 or config.fp4:
        raise ValueError(
            f"TransformerConfig(fp8={config.fp8!r}, fp4={config.fp4!r}) with these grouped experts, which run in the "
            "weights' dtype: leave fp8/fp4 unset (ModelConfig(fp8=...) puts the dense linears in fp8, not the experts)"
        )
    if config.use_te_activation_func:
        raise ValueError("use_te_activation_func=True needs Transformer Engine's activation; set it False")
    swiglu_like = config.gated_linear_unit and config.activation_func in (torch.nn.functional.silu, quick_gelu)
    if config.bias_activation_fusion and not swiglu_like:
        # TEGroupedMLP's fused activation covers SwiGLU and quick-GeGLU only (anything else raises mid-forward)
        raise ValueError(
            "bias_activation_fusion=True with MoE experts needs SwiGLU (gated_linear_unit with silu); "
            "set bias_activation_fusion=False for this activation"
        )


def _normalize_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-time pre-hook: accept what a sharded load hands back (per-expert ``_extra_state{i}``, which carry
    nothing) and TE-style per-expert ``weight{i}`` entries, stacked into ``weight``."""
    state_dict.setdefault(f"{prefix}_extra_state")
    experts = module.num_local_experts  # type: ignore[attr-defined]
    for e in range(1, experts):
        state_dict.pop(f"{prefix}_extra_state{e}", None)
    indexed = [f"{prefix}weight{e}" for e in range(experts)]
    if f"{prefix}weight" not in state_dict and all(key in state_dict for key in indexed):
        state_dict[f"{prefix}weight"] = torch.stack([state_dict.pop(key) for key in indexed])


def _merge_experts(pieces: list[Any]) -> Tensor:
    """Inverse of the sharded state dict's split: the loaded per-expert tensors (SwiGLU halves: a pair) stacked."""
    return torch.stack([torch.cat(piece) if isinstance(piece, list) else piece for piece in pieces])


class _GroupedLinear(MegatronModule):
    """All local experts' linears of one kind in one ``[E, out, in]`` parameter (see the module docstring)."""

    tp_axis: int
    """The weight's expert-TP split: 0 (output rows, column-parallel) or 1 (input columns, row-parallel)."""
    fuse_wgrad = False
    """Whether the weight gradient goes straight into ``main_grad`` when Megatron's DDP gave the weight one (also
    with ``config.gradient_accumulation_fusion``)."""

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        _check_config(config)
        if not is_expert:
            raise ValueError(f"{type(self).__name__} holds MoE experts; it was built with is_expert=False")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection, self.tp_group = pg_collection, pg_collection.expt_tp
        self.num_local_experts, self.input_size, self.output_size = num_local_experts, input_size, output_size
        self.skip_bias_add, self.name = skip_bias_add, name
        tp = get_pg_size(self.tp_group)
        shape = [output_size, input_size]
        if shape[self.tp_axis] % tp:
            size = "input" if self.tp_axis else "output"
            raise ValueError(
                f"{type(self).__name__}: the experts' {size} size {shape[self.tp_axis]} (moe_ffn_hidden_size, or x2 "
                f"with a gated unit) is not divisible by the expert tensor-parallel size {tp} (tp); pick tp among "
                f"{[d for d in range(1, shape[self.tp_axis] + 1) if shape[self.tp_axis] % d == 0]}"
            )
        shape[self.tp_axis] //= tp
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = nn.Parameter(torch.empty(num_local_experts, *shape, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            self._initialize(init_method, tp)
        # As Megatron's expert linears: gradients reduced over the expert-DP group where experts are split
        # differently from the dense layers, and every TP shard counted in the gradient norm.
        use_expert_groups = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        self.weight.allreduce = not use_expert_groups
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1 + self.tp_axis, stride=1)
        self.bias = self._make_bias(shape[0], device) if bias else None
        self.gemm: Gemm = "auto"
        """``"auto"``: grouped GEMMs where ``config.moe_grouped_gemm`` asks for them and the device, dtype and
        sizes allow (:func:`grouped_mm_available`), else the loop; ``"grouped"`` / ``"loop"``: always that one
        (``"grouped"`` on CPU runs torch's reference kernel: for tests)."""
        self.last_gemm: Literal["grouped", "loop"] | None = None
        """What the last forward ran (None before the first): for benchmarks and tests."""
        self.register_load_state_dict_pre_hook(_normalize_state_dict)

    def _make_bias(self, rows: int, device: Any) -> nn.Parameter:
        """Each local expert's output bias ``[E, out]``, zeros (as Megatron's expert linears start theirs). Added by
        :class:`~lightning_megatron.kernels.expert_mlp.GroupedMLP` (fc2's scaled by the router probability, as
        ``TEGroupedMLP``), not by :meth:`forward`. Column-parallel: split like the weight's rows. Row-parallel: whole
        on every expert-TP rank (as a ``RowParallelLinear``'s bias), counted once in the gradient norm; the MLP adds it
        to expert-TP rank 0's partial sum only, and every rank gets the same gradient."""
        param = nn.Parameter(torch.zeros(self.num_local_experts, rows, device=device, dtype=self.config.params_dtype))
        param.allreduce = self.weight.allreduce  # type: ignore[attr-defined]
        set_tensor_model_parallel_attributes(param, is_parallel=self.tp_axis == 0, dim=1, stride=1)
        return param

    @torch.no_grad()
    def _initialize(self, init_method: Callable[[Tensor], None], tp: int) -> None:
        """Each expert's slice drawn by ``init_method``, as Megatron's expert linears draw theirs: this rank's
        shard of a full fp32 master on CPU with ``use_cpu_initialization``, else the shard itself from the
        expert-parallel RNG stream."""
        if self.config.use_cpu_initialization:
            rank = get_pg_rank(self.tp_group)
            for e in range(self.num_local_experts):
                master = torch.empty(self.output_size, self.input_size, dtype=torch.float32)
                init_method(master)
                self.weight[e].copy_(master.chunk(tp, dim=self.tp_axis)[rank])
            return
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for e in range(self.num_local_experts):
                init_method(self.weight[e])

    def _grouped(self, rows: Tensor) -> bool:
        """Whether this call runs the grouped kernel (see :attr:`gemm`); else the per-expert loop."""
        if self.gemm == "loop" or not rows.shape[0]:
            return False
        if self.gemm == "auto":
            aligned = self.weight.shape[1] % 8 == 0 and self.weight.shape[2] % 8 == 0  # 16-byte strides in bf16
            fits = rows.dtype == self.weight.dtype == torch.bfloat16 and aligned and self.config.moe_grouped_gemm
            return fits and grouped_mm_available(rows.device)
        return True

    def forward(self, x: Tensor, tokens_per_expert: ExpertCounts | Sequence[int] | Tensor) -> tuple[Tensor, None]:
        """Each expert's linear on its rows of ``x`` ([tokens sorted by local expert, in]); ``tokens_per_expert``
        the row counts (:class:`ExpertCounts` from :class:`~lightning_megatron.kernels.expert_mlp.GroupedMLP`, a
        list from Megatron's ``TEGroupedMLP``). Returns ``(output, None)`` (a bias is the MLP's to add). Row-parallel:
        output under expert TP is this rank's partial sum, which the token dispatcher reduces."""
        counts = tokens_per_expert if isinstance(tokens_per_expert, ExpertCounts) else ExpertCounts(tokens_per_expert)
        rows = x.reshape(-1, x.shape[-1])
        grouped = self._grouped(rows)
        if len(counts) != self.num_local_experts:
            raise ValueError(f"tokens_per_expert has {len(counts)} counts for {self.num_local_experts} local experts")
        if counts.on_host or not grouped:
            _check_rows(counts, rows.shape[0])
        else:  # checked on the device without waiting: a stop rather than rows left out or read past the end
            counts.assert_total(rows.shape[0], rows.device)
        self.last_gemm = "grouped" if grouped else "loop"
        rows = _aligned(rows) if grouped else rows.contiguous()
        out = self.expert_gemms(rows, counts, grouped)
        return out.view(*x.shape[:-1], out.shape[-1]), None

    def expert_gemms(self, rows: Tensor, counts: ExpertCounts, grouped: bool) -> Tensor:
        """The experts' products on their rows: the weight's GEMMs (LoRA adds its adapters' here)."""
        return self.grouped_linear(rows, self.weight, counts, grouped)

    def grouped_linear(self, rows: Tensor, weight: Tensor, counts: ExpertCounts, grouped: bool) -> Tensor:
        """``rows_e @ weight[e].t()`` per expert for any ``[E, out, in]`` parameter of this module, its weight
        gradient into ``main_grad`` where fused (see :attr:`fuse_wgrad`)."""
        fuse = (self.fuse_wgrad or self.config.gradient_accumulation_fusion) and _has_main_grad(weight)
        into_main_grad = fuse and torch.is_grad_enabled() and weight.requires_grad
        return _GroupedLinearFn.apply(rows, weight, counts, grouped, into_main_grad)

    def backward_dw(self) -> None:
        """TEGroupedMLP's deferred weight-gradient hook: the weight gradient is computed in backward already."""

    def get_extra_state(self) -> None:
        """No extra state (the per-expert ``_extra_state`` entries exist for SequentialMLP's checkpoint keys)."""

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored."""

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape)
        bias = self.bias is not None
        return f"experts={shape[0]}, out={shape[1]}, in={shape[2]} per expert-TP rank, bias={bias}, gemm={self.gemm}"

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Each expert's slice as SequentialMLP's expert linear saves it: the same key, global shape and expert
        offset (plus this module's ``_extra_state`` per expert), so that the two load each other's checkpoints.

        The weight is one :class:`ShardedTensorFactory` over the whole parameter (its ``data`` is the parameter,
        under the parameter's name), which splits it per expert -- and the SwiGLU fc1 into its gate and up halves,
        as Megatron's MLP does. Megatron's optimizers find a parameter's sharding by that ``data`` and build its
        state (``optimizer.state.exp_avg.<key>``) through the same factory, so that those keys match
        SequentialMLP's too.
        """
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_object_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep, expert_dp = self.pg_collection.ep, self.pg_collection.expt_dp
        first = get_pg_rank(ep) * self.num_local_experts
        total = get_pg_size(ep) * self.num_local_experts

        def expert_offsets(e: int) -> tuple:
            # singleton_local_shards: one key per global expert instead of an expert axis
            return sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + e, total))

        replica_id = (0, 0, get_pg_rank(expert_dp))  # TP-sharded; one writer among the expert-DP replicas
        state: dict[str, Any] = {}
        # The bias ([E, out]) is split like the weight's rows (column-parallel), or whole on every expert-TP rank
        # (row-parallel: axis None, expert-TP rank 0 writes it).
        bias_axis = 0 if self.tp_axis == 0 else None
        for what, param, axis in (("weight", self.weight, self.tp_axis), ("bias", self.bias, bias_axis)):
            if param is not None:
                name = f"{prefix}{what}"
                build = functools.partial(self._build_experts, name, expert_offsets, singleton, first, expert_dp, axis)
                state[name] = ShardedTensorFactory(name, param, build, _merge_experts, replica_id)
        extra_replica_id = (0, get_pg_rank(self.tp_group), get_pg_rank(expert_dp))
        for e in range(self.num_local_experts):
            key = f"{first + e}.{prefix}_extra_state" if singleton else f"{prefix}_extra_state"
            state[f"{prefix}_extra_state{e or ''}"] = make_sharded_object_for_checkpoint(
                None, key, expert_offsets(e), replica_id=extra_replica_id
            )
        return state

    def _build_experts(
        self, name: str, expert_offsets: Callable[[int], tuple], singleton: bool, first: int, expert_dp: Any,
        axis: int | None, key: str, data: Tensor, replica_id: Any, flattened_range: slice | None,
    ) -> list[Any]:  # fmt: skip
        """The factory's build: ``data`` (the weight, or an optimizer state of its shape) as per-expert sharded
        tensors under ``key`` (the weight's key, prefixed by the modules above and by the optimizer), split over
        expert TP along ``axis`` (None: replicated, one writer per expert-TP group)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        if flattened_range is not None:
            raise ValueError(f"{name}: flattened (distributed-optimizer model-space) shards are not supported")
        if singleton and not key.endswith(name):  # the per-expert keys go in front of the module's own part
            raise ValueError(f"{name}: sharded key {key!r} lost the module's own suffix")
        swiglu = self.tp_axis == 0 and self.config.gated_linear_unit
        tp_rank = get_pg_rank(self.tp_group)
        pieces: list[Any] = []
        for e in range(self.num_local_experts):
            offsets = expert_offsets(e)
            # singleton: SequentialMLP's "<...>experts.<global expert>.linear_fc1.weight"
            expert_key = f"{key[: len(key) - len(name)]}{first + e}.{name}" if singleton else key
            if axis is None:
                piece = make_sharded_tensor_for_checkpoint(
                    data[e], expert_key, prepend_offsets=offsets, replica_id=(0, tp_rank, replica_id[2]),
                    tp_group=self.tp_group, dp_cp_group=expert_dp,
                )  # fmt: skip
                pieces.append(piece)
                continue
            piece = make_tp_sharded_tensor_for_checkpoint(
                data[e], expert_key, axis, replica_id=replica_id, prepend_offsets=offsets,
                tp_group=self.tp_group, dp_cp_group=expert_dp,
            )  # fmt: skip
            if swiglu:  # [gate; up] halves, each TP-sharded on its own (Megatron's MLP layout)
                piece = apply_swiglu_sharded_factory(
                    piece, offsets, singleton, tp_group=self.tp_group, dp_group=expert_dp
                ).build()
            pieces.append(piece)
        return pieces


class GroupedColumnLinear(_GroupedLinear):
    """TEGroupedMLP's ``linear_fc1``: every local expert's input projection, the output split over the expert-TP
    group. With ``gated_linear_unit`` it is the [gate; up] projection of a SwiGLU MLP (checkpointed as such)."""

    tp_axis = 0


class GroupedRowLinear(_GroupedLinear):
    """TEGroupedMLP's ``linear_fc2``: every local expert's output projection, the input split over the expert-TP
    group; under expert TP its output is this rank's partial sum, reduced by the token dispatcher."""

    tp_axis = 1


class FusedWgradGroupedColumnLinear(GroupedColumnLinear):
    """:class:`GroupedColumnLinear` whose weight gradient accumulates in fp32 straight into ``main_grad``."""

    fuse_wgrad = True


class FusedWgradGroupedRowLinear(GroupedRowLinear):
    """:class:`GroupedRowLinear` whose weight gradient accumulates in fp32 straight into ``main_grad``."""

    fuse_wgrad = True
