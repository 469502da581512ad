"""The register of every workaround of an upstream limitation: what it is, where it lives, what upstream names it
relies on, why, and the upstream version that makes it droppable.

When the pinned megatron-core or Lightning moves, ``tests/test_compat.py`` fails while the installed version is
outside :data:`CHECKED` and names the entries to re-check; it also resolves every name in each entry's
``touches`` against the installed packages (a renamed or removed upstream name fails there, not deep in a run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["patch", "fix", "class swap", "sys.modules", "config hook", "internals read", "private read"]


@dataclass(frozen=True, kw_only=True)
class Workaround:
    """One workaround."""

    name: str
    """What it is called in the code (a class or function of this package)."""
    kind: Kind
    """Its sort: a patch installed and removed (``patches.py``), a fix of Megatron's state, a class swap, a
    ``sys.modules`` entry, a rewrite of Megatron config hooks, or a read of internal or private names."""
    where: str
    """Where it lives in this package, ``module:qualified.name``."""
    package: Literal["megatron-core", "lightning", "litdata", "torch"]
    """The upstream package whose behaviour it works around."""
    touches: tuple[str, ...]
    """The upstream names it replaces or reads: ``module:Qualified.name`` (must resolve), or ``module:Class#attr``
    for an attribute the class's own code assigns to its instances."""
    why: str
    """What goes wrong without it."""
    droppable: str
    """The upstream change that makes it unneeded, and the version it was last checked against."""


CHECKED: dict[str, tuple[str, str]] = {
    "megatron-core": ("0.19.0", "0.20"),
    "lightning": ("2.6.0", "2.7"),
    "torch": ("2.11", "2.15"),
}
"""The versions the register was checked against: ``(lowest, first not checked)`` per upstream package."""

_MCORE = "not fixed upstream as of megatron-core 0.19.2"
_LIGHTNING = "Lightning exposes it publicly; private as of Lightning 2.6.6"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"

REGISTER: tuple[Workaround, ...] = (
    Workaround(
        name="QuietRun",
        kind="patch",
        where="lightning_megatron.compat.patches:QuietRun",
        package="megatron-core",
        touches=("warnings:filters",),
        why="the torch-native path prints notices on every run (missing Transformer Engine/apex, deprecations, CUDA "
        "advice on CPU) that ask the user to do nothing",
        droppable="megatron-core, torch and Lightning stop printing them; " + _MCORE,
    ),
    Workaround(
        name="CpuMode",
        kind="patch",
        where="lightning_megatron.compat.patches:CpuMode",
        package="megatron-core",
        touches=("torch.cuda:current_device", "torch.cuda:get_rng_state", "torch.cuda:set_rng_state"),
        why="megatron-core assumes CUDA: current_device() calls, device='cuda' tensors, streams, CUDA type names",
        droppable="megatron-core runs on a CPU device itself; " + _MCORE,
    ),
    Workaround(
        name="UniformTokenPermutation",
        kind="patch",
        where="lightning_megatron.compat.patches:UniformTokenPermutation",
        package="megatron-core",
        touches=(
            "megatron.core.transformer.moe.token_dispatcher:permute",
            "megatron.core.transformer.moe.token_dispatcher:unpermute",
        ),
        why="without Transformer Engine the dispatchers add each token's k expert rows with atomic bf16 adds, the "
        "largest MoE cost after the expert GEMMs (installed only for models with experts)",
        droppable="megatron-core's torch-native permutation avoids atomic adds; " + _MCORE,
    ),
    Workaround(
        name="ForeachClipGrads",
        kind="patch",
        where="lightning_megatron.compat.patches:ForeachClipGrads",
        package="megatron-core",
        touches=(
            "megatron.core.optimizer.clip_grads:l2_norm_impl",
            "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
            "megatron.core.optimizer.clip_grads:multi_tensor_scale_tensor_impl",
        ),
        why="without Transformer Engine/apex the clipping computes per-tensor norms with a host read each",
        droppable="megatron-core's fallback uses multi-tensor kernels with a device-side coefficient; " + _MCORE,
    ),
    Workaround(
        name="ThreadedShardReads",
        kind="patch",
        where="lightning_megatron.compat.patches:ThreadedShardReads",
        package="megatron-core",
        touches=("megatron.core.dist_checkpointing.strategies.torch:_get_filesystem_reader",),
        why="Megatron's torch_dist load builds torch DCP's FileSystemReader itself, which reads one tensor at a time",
        droppable="megatron-core's load strategy takes a storage reader or a thread count; " + _MCORE,
    ),
    Workaround(
        name="KeepAdamStepOnLoad",
        kind="patch",
        where="lightning_megatron.compat.patches:KeepAdamStepOnLoad",
        package="megatron-core",
        touches=(f"{_DIST_OPT}._set_main_param_and_optimizer_states",),
        why="a fully_reshardable load raises KeyError: 'step' on the torch-native Adam path",
        droppable="megatron-core loads such state without a per-parameter step; " + _MCORE,
    ),
    Workaround(
        name="init_adam_state",
        kind="fix",
        where="lightning_megatron.compat.mcore_fixes:init_adam_state",
        package="megatron-core",
        touches=(f"{_DIST_OPT}.state_dict",),
        why="DistributedOptimizer.state_dict asserts one 'step' among the torch optimizer's states, which a fresh "
        "torch Adam lacks (a bare AssertionError when saving or loading before the first step)",
        droppable="megatron-core builds the state of a fresh torch Adam; " + _MCORE,
    ),
    Workaround(
        name="untie_adam_steps",
        kind="fix",
        where="lightning_megatron.compat.mcore_fixes:untie_adam_steps",
        package="megatron-core",
        touches=(f"{_DIST_OPT}.load_state_dict",),
        why="the torch-native load assigns one 'step' tensor to every parameter, which torch Adam increments once "
        "per parameter: every later bias correction would be wrong",
        droppable="megatron-core gives each parameter its own step on load; " + _MCORE,
    ),
    Workaround(
        name="build_with_expert_biases",
        kind="config hook",
        where="lightning_megatron.gpt.moe.config:build_with_expert_biases",
        package="megatron-core",
        touches=("megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",),
        why="TransformerConfig asserts expert tensor parallelism 1 for MoE with add_bias_linear, guarding its own "
        "expert linears (which would add fc2's bias on every expert-TP rank); the grouped experts used on every path "
        "add it once, so GPT-OSS at tp > 1 is built at expert TP 1 and then given its size (nothing else __post_init__ "
        "derives differs: the expert weight-shard remat size is 1 at both)",
        droppable="Megatron's check moves to its own expert modules; " + _MCORE,
    ),
    Workaround(
        name="FusedWgradLMHead",
        kind="class swap",
        where="lightning_megatron.kernels.linear:fuse_lm_head",
        package="megatron-core",
        touches=(
            "megatron.core.tensor_parallel.layers:ColumnParallelLinear._forward_impl",
            "megatron.core.models.gpt.gpt_model:GPTModel#output_layer",
        ),
        why="GPTModel builds its output layer itself, outside any layer spec; its class becomes a subclass without "
        "state of its own (compat/class_swap.py) for the fused weight gradient and batch-first logits",
        droppable="GPTModel takes a spec (or a class) for its output layer; " + _MCORE,
    ),
    Workaround(
        name="lean_imports",
        kind="sys.modules",
        where="lightning_megatron.compat.lean_imports:enter",
        package="megatron-core",
        touches=("megatron.core:parallel_state",),
        why="the async-save writer process would import Lightning, the models and megatron.core's models and "
        "fusions through the packages' __init__ files: seconds of start-up while the training process starts too",
        droppable="megatron-core's __init__ imports its subpackages lazily; " + _MCORE,
    ),
    Workaround(
        name="GradientAccumulation.schedule_hooks",
        kind="config hook",
        where="lightning_megatron.training.accumulation:GradientAccumulation.schedule_hooks",
        package="megatron-core",
        touches=(
            "megatron.core.model_parallel_config:ModelParallelConfig#finalize_model_grads_func",
            "megatron.core.model_parallel_config:ModelParallelConfig#no_sync_func",
            "megatron.core.model_parallel_config:ModelParallelConfig#grad_sync_func",
        ),
        why="Lightning's accumulate_grad_batches spans several schedule runs; Megatron's schedule reduces gradients "
        "at the end of each, so the hooks it calls are swapped for the batches that do not step",
        droppable="Megatron's schedule takes an accumulation window over several calls; " + _MCORE,
    ),
    Workaround(
        name="megatron_internals",
        kind="internals read",
        where="lightning_megatron.compat.megatron_internals",
        package="megatron-core",
        touches=(
            "megatron.core.optimizer:ChainedOptimizer._synchronize_steps",
            "megatron.core.optimizer:ChainedOptimizer#chained_optimizers",
            "megatron.core.optimizer.optimizer:MegatronOptimizer#optimizer",
            "megatron.core.transformer.moe.experts:TEGroupedMLP#_with_fused_impl",
        ),
        why="the torch optimizers inside Megatron's (fixes, offload, the fused-Adam switch), the chained steps' "
        "alignment its own sharded_state_dict runs, and whether grouped experts run Transformer Engine's fused ops",
        droppable="megatron-core exposes its torch optimizers; internal as of megatron-core 0.19.2",
    ),
    Workaround(
        name="optimizer_state",
        kind="internals read",
        where="lightning_megatron.checkpointing.format.optimizer_state",
        package="megatron-core",
        touches=(
            f"{_DIST_OPT}#buffers",
            f"{_DIST_OPT}#gbuf_ranges",
            f"{_DIST_OPT}#model_param_group_index_map",
            f"{_DIST_OPT}#optimizer_state_keys",
            f"{_DIST_OPT}#data_parallel_group",
            "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer#param_index_map",
            "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer#buckets",
        ),
        why="the distributed optimizer's sharded state is built one parameter at a time into host buffers (Megatron "
        "gathers every state on the device first), from its buffers' and ranges' layout",
        droppable="megatron-core builds the fully_reshardable state without device-wide gathers; " + _MCORE,
    ),
    Workaround(
        name="compiled block masks",
        kind="private read",
        where="lightning_megatron.kernels.variants:_build_block_mask",
        package="torch",
        touches=("torch.nn.attention.flex_attention:create_block_mask",),
        why="create_block_mask's private _compile=True builds a FlexAttention block mask block by block on the GPU; "
        "the public eager build materialises the [B, S_q, S] boolean mask first (gigabytes at 16K tokens); the "
        "packed-document mask of kernels/documents.py:_block_mask passes it too",
        droppable="torch makes compiled block-mask construction public or the default; private as of torch 2.14",
    ),
    Workaround(
        name="DirectQueryNorms",
        kind="private read",
        where="lightning_megatron.compat.mla_norms:DirectQueryNorms",
        package="megatron-core",
        touches=("megatron.core.transformer.multi_latent_attention:MLASelfAttention._resolve_qk_norm_config",),
        why="with q_lora_rank=None and qk_layernorm=True Megatron's MLA asks for Transformer Engine's fused norm + "
        "linear as the query projection and raises without it; overridden for that case only",
        droppable="Megatron's resolver takes a standalone key/value latent norm for a direct query projection; "
        + _MCORE,
    ),
    Workaround(
        name="SharedRopeKeyGrad",
        kind="private read",
        where="lightning_megatron.compat.mla_rope_grad:SharedRopeKeyGrad",
        package="megatron-core",
        touches=("megatron.core.transformer.multi_latent_attention:MLASelfAttention._qkv_down_projection",),
        why="at tp > 1 with a column-parallel key/value down projection, the gradient of MLA's shared RoPE key holds "
        "only one rank's heads (the all-gather's backward keeps each rank's slice): training leaves the one-process "
        "curve from step 2 on; overridden to reach Megatron's path that sums it over the ranks",
        droppable="megatron-core sums k_pos_emb's gradient over TP (NVIDIA/Megatron-LM issue 1699); " + _MCORE,
    ),
    Workaround(
        name="lightning_internals",
        kind="private read",
        where="lightning_megatron.compat.lightning_internals",
        package="lightning",
        touches=(
            "lightning.pytorch.callbacks:ModelSummary._summary",
            "lightning.pytorch.callbacks:ModelSummary#_max_depth",
            "lightning.pytorch.callbacks:ModelSummary#_summarize_kwargs",
            "lightning.pytorch.utilities.model_summary:ModelSummary._get_summary_data",
            "lightning.pytorch.callbacks:WeightAveraging#_device",
            "lightning.pytorch.callbacks:WeightAveraging#_use_buffers",
            "lightning.pytorch.callbacks:WeightAveraging#_kwargs",
            "lightning.pytorch.strategies:DDPStrategy#_layer_sync",
            "lightning.pytorch.callbacks:LearningRateFinder#_early_exit",
            "lightning.pytorch.utilities.compile:from_compiled",
            "lightning.pytorch.core.module:LightningModule#_compiler_ctx",
            "lightning.pytorch.core.module:LightningModule#_trainer",
        ),
        why="Lightning keeps these settings only in private attributes: a summary or weight-averaging callback is "
        "replaced by one with the same settings, sync_batchnorm and an LR finder inside fit are refused, and a "
        "module unwrapped from torch.compile (_compiler_ctx, which from_compiled sets) is refused",
        droppable=_LIGHTNING,
    ),
    Workaround(
        name="evaluate_without_inference_mode",
        kind="internals read",
        where="lightning_megatron.compat.lightning_internals:evaluate_without_inference_mode",
        package="lightning",
        touches=(
            "lightning.pytorch.loops.evaluation_loop:_EvaluationLoop#inference_mode",
            "lightning.pytorch.loops.prediction_loop:_PredictionLoop#inference_mode",
        ),
        why="evaluation under inference_mode leaves inference tensors (RoPE tables, metric states) that make a later "
        "fit fail; Lightning sets this attribute itself under FSDP and gloo",
        droppable="Lightning takes inference_mode per strategy; a private loop class's attribute as of Lightning 2.6.6",
    ),
    Workaround(
        name="CombinedStreamingDataset._datasets",
        kind="private read",
        where="lightning_megatron.data.sharding:bind_data_parallel",
        package="litdata",
        touches=("litdata.streaming.combined:CombinedStreamingDataset#_datasets",),
        why="each dataset of a combined LitData stream is sharded by the data-parallel rank, not the global rank",
        droppable="LitData takes a distributed environment for a combined dataset; private as of litdata 0.2",
    ),
)
"""Every workaround, by kind."""
