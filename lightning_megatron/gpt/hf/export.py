"""Hugging Face out: stream or write the full HF state dict of a running model.

:func:`export_weights` yields full HF tensors, one parameter's or a bucket of about N bytes at a time (gathered over
tensor parallelism, broadcast from the pipeline stage that owns them; LoRA adapters merged in, or streamed alone in
PEFT's names); :func:`save_pretrained` writes them as an HF model directory with rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_megatron.contract import MegatronRuntime
from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.gpt.hf import mxfp4, quantized
from lightning_megatron.gpt.hf.config import check_exportable, hf_config_dict
from lightning_megatron.gpt.hf.load import SAFETENSORS_FILE, SAFETENSORS_INDEX, HFCheckpoint, side_files
from lightning_megatron.gpt.hf.mapping import adapter_params, chunk_params, hf_weight_shapes
from lightning_megatron.gpt.hf.params import (
    SPLIT_DIM,
    Param,
    expert_piece,
    join_pieces,
    join_rank_blocks,
    split_local,
)
from lightning_megatron.gpt.lora.config import LoRAConfig

WeightFormat = Literal["float", "fp8_block", "mxfp4"]
"""How ``save_hf`` writes the weights: all in ``dtype``, the source's fp8 weights in its 128 x 128 (or other)
blocks (:mod:`lightning_megatron.gpt.hf.quantized`), or GPT-OSS's experts in MXFP4
(:mod:`lightning_megatron.gpt.hf.mxfp4`)."""


@dataclasses.dataclass(frozen=True)
class _Written:
    """What a save writes quantized: fp8 weights in ``block``, MXFP4 weights, and the ``quantization_config``
    config.json says (None: none, the files hold ``dtype`` tensors)."""

    fp8: set[str] = dataclasses.field(default_factory=set)
    block: tuple[int, int] = (1, 1)
    mxfp4: set[str] = dataclasses.field(default_factory=set)
    quantization_config: dict[str, Any] | None = None

    def sizes(self, shapes: dict[str, tuple[int, ...]], itemsize: int) -> dict[str, int]:
        """Bytes of each tensor the save writes, in file order."""
        sizes: dict[str, int] = {}
        for name, shape in shapes.items():
            if name in self.mxfp4:
                sizes.update(mxfp4.stored_sizes(name, shape))
            else:
                sizes.update(quantized.stored_sizes({name: shape}, itemsize, self.fp8, self.block))
        return sizes

    def stored(self, name: str, tensor: Tensor, dtype: torch.dtype) -> list[tuple[str, Tensor]]:
        """``[(name, tensor)]`` as the save writes it: a quantized weight as its two tensors."""
        if name in self.mxfp4:
            return mxfp4.stored(name, tensor)
        return quantized.stored(name, tensor, dtype, self.fp8, self.block)


_NOT_RUNNING = (
    "HF export needs the built model and Megatron's parallel state: call it from a hook while the Trainer runs "
    "(e.g. on_train_end, on_validation_end, or a callback's on_train_batch_end)"
)


def check_running(module: nn.Module) -> None:
    """Raise RuntimeError unless ``module``'s chunks are built and Megatron's parallel state is up."""
    from megatron.core import parallel_state

    if not hasattr(module, "chunks") or not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(_NOT_RUNNING)
    if getattr(module, "kernels", None) == "te":
        raise ValueError(
            "HF export maps the torch-native layer names; Transformer Engine layers (kernels='te') name their norms "
            "differently. Build the model with ModelConfig(kernels='torch') to export it"
        )
    # With the parameter all-gather overlapped with the next forward, the last update may still be pending.
    strategy = module.trainer.strategy
    if isinstance(strategy, MegatronRuntime):
        strategy.sync_params()


# ---------------------------------------------------------------------------------------------------- export
Owner = tuple[int, int, Param, int | None]
"""(pipeline rank, chunk index on that rank, param, expert-parallel rank): who holds one exported parameter; the
expert-parallel rank is None for a parameter every expert-parallel rank holds (all but the experts)."""


def _owners(chunks: Sequence[nn.Module], config: ModelConfig, lora: LoRAConfig | None = None) -> list[Owner]:
    """Who holds every HF tensor of the model (with ``lora``: every PEFT tensor of its adapters), in HF order."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tconfig = chunks[0].config
    pp, vpp = tconfig.pipeline_model_parallel_size, tconfig.virtual_pipeline_model_parallel_size
    per_chunk = config.num_layers // (pp * (vpp or 1))
    per_ep_rank = (config.num_moe_experts or 1) // ps.get_expert_model_parallel_world_size()
    stages = []
    for vp in range(vpp or 1):
        for rank in range(pp):
            offset = get_transformer_layer_offset(tconfig, vp if vpp else None, pp_rank=rank)
            pre, post = rank == 0 and vp == 0, rank == pp - 1 and vp == (vpp or 1) - 1
            if lora is None:
                params = chunk_params(config, pre=pre, post=post, offset=offset, num_layers=per_chunk)
            else:
                params = adapter_params(config, lora, offset=offset, num_layers=per_chunk)
            stages.append((offset, rank, vp, params))
    owners, seen = [], set()
    for _, rank, vp, params in sorted(stages, key=lambda s: s[0]):
        for p in params:
            if p.hf[0][0] in seen:  # the last stage's copy of tied embeddings is not exported twice
                continue
            seen.update(name for name, _ in p.hf)
            if p.expert is None:
                owners.append((rank, vp, p, None))
            else:  # all experts' tables, by global index: which EP rank holds it, as its local expert
                ep_rank, local = divmod(p.expert, per_ep_rank)
                owners.append((rank, vp, dataclasses.replace(p, expert=local), ep_rank))
    return owners


def _group[T](
    items: list[T], nbytes: Callable[[T], int], max_bytes: int | None, key: Callable[[T], Any] = lambda _: None
) -> list[list[T]]:
    """Consecutive items in groups of at most ``max_bytes`` (a bigger item alone; each item alone without
    ``max_bytes``), a new group wherever ``key`` changes."""
    groups: list[list[T]] = []
    size = 0
    for item in items:
        n = nbytes(item)
        full = max_bytes is None or (groups and size + n > max_bytes)
        if not groups or full or key(groups[-1][0]) != key(item):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def _buckets(owners: list[Owner], itemsize: int, bucket_bytes: int | None) -> list[list[Owner]]:
    """Consecutive params of one pipeline rank, about ``bucket_bytes`` of HF tensors each (a bigger param alone);
    one param per bucket without ``bucket_bytes``."""

    def nbytes(owner: Owner) -> int:
        return itemsize * sum(int(torch.Size(shape).numel()) for _, shape in owner[2].hf)

    return _group(owners, nbytes, bucket_bytes, key=lambda owner: (owner[0], owner[3]))


def export_weights(
    chunks: Sequence[nn.Module], config: ModelConfig, *, include_tied: bool = True, merged: bool = True,
    lora: LoRAConfig | None = None, bucket_bytes: int | None = None,
) -> Iterator[list[tuple[str, Tensor]]]:  # fmt: skip
    """Yield buckets of ``(hf_name, full tensor)`` on every rank: each param alone, or about ``bucket_bytes`` of
    tensors per bucket, with one tensor-parallel gather and one pipeline broadcast per bucket. ``merged`` adds
    the LoRA adapters to their base weights; ``lora`` streams the adapters alone (PEFT names) instead of the
    model. Collective: every rank must exhaust it."""

    check_exportable(config)  # before any collective: every rank raises alike
    owners = _owners(chunks, config, lora)
    if config.share_embeddings_and_output_weights and include_tied and lora is None:
        rank, vp, embed, _ = owners[0]
        owners.append((rank, vp, dataclasses.replace(embed, hf=(("lm_head.weight", embed.hf[0][1]),)), None))
    buckets = _exported(chunks, owners, config, merged and lora is None, bucket_bytes)
    # Expert adapters (and GPT-OSS's experts) are exported as each expert's piece; PEFT (and GPT-OSS) hold all experts
    # in one tensor.
    yield from _joined(buckets, config.num_moe_experts or 1)


def _exported(
    chunks: Sequence[nn.Module], owners: list[Owner], config: ModelConfig, merged: bool, bucket_bytes: int | None
) -> Iterator[list[tuple[str, Tensor]]]:
    """The buckets of :func:`export_weights`, every table entry's tensors on every rank."""
    from megatron.core import parallel_state as ps

    first = next(chunks[0].parameters())
    pp_group, my_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    ep_group, my_ep = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_rank()
    for bucket in _buckets(owners, first.dtype.itemsize, bucket_bytes):
        (rank, _, _, ep_rank), names = bucket[0], [hf for _, _, p, _ in bucket for hf in p.hf]
        if rank == my_rank and ep_rank in (None, my_ep):
            tensors = _gather(chunks, bucket, config, merged)
        else:
            tensors = [torch.empty(shape, dtype=first.dtype, device=first.device) for _, shape in names]
        if ep_rank is not None and rank == my_rank and ps.get_expert_model_parallel_world_size() > 1:
            # Experts: from the EP rank that holds them to the others of their pipeline stage first.
            tensors = _broadcast(tensors, torch.distributed.get_global_rank(ep_group, ep_rank), ep_group)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            tensors = _broadcast(tensors, torch.distributed.get_global_rank(pp_group, rank), pp_group)
        yield [(name, tensor) for (name, _), tensor in zip(names, tensors, strict=True)]


def _joined(buckets: Iterator[list[tuple[str, Tensor]]], num_experts: int) -> Iterator[list[tuple[str, Tensor]]]:
    """The buckets with each tensor on fused experts (PEFT's, GPT-OSS's) joined from its experts' pieces (in the
    bucket where its last piece arrives; pieces of other expert-parallel ranks come in other buckets)."""
    pending: dict[str, dict[int, Tensor]] = {}
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            whole, expert = expert_piece(name)
            if expert is None:
                out.append((name, tensor))
                continue
            pieces = pending.setdefault(whole, {})
            pieces[expert] = tensor
            if len(pieces) == num_experts:
                del pending[whole]
                joined = join_pieces(whole, [pieces[e] for e in range(num_experts)])
                out.append((whole, joined))
        if out:
            yield out


def _flat(tensors: list[Tensor]) -> Tensor:
    # (Mixed dtypes promote exactly and _unflat casts back; the chunks' parameters share one dtype, which the
    # ranks receiving a pipeline broadcast allocate.)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    sizes = [t.numel() for t in like]
    return [piece.view(t.shape).to(t.dtype) for piece, t in zip(flat.split(sizes), like, strict=True)]


def _broadcast(tensors: list[Tensor], src: int, group: Any) -> list[Tensor]:
    """One broadcast of the bucket's tensors (flattened) from the stage that holds them."""
    flat = _flat(tensors)
    torch.distributed.broadcast(flat, src=src, group=group)
    return _unflat(flat, tensors)


def _local(chunk: nn.Module, p: Param, merged: bool) -> Tensor:
    """This rank's tensor of p; a LoRA-adapted weight with its adapters' product added when ``merged``."""
    from lightning_megatron.gpt.lora.layers import is_adapter

    owner, _, leaf = p.megatron.rpartition(".")
    local = getattr(chunk.get_submodule(owner), leaf).detach()  # a parameter, or a buffer (a router's bias)
    if p.expert is not None:
        local = local[p.expert]
    if merged and leaf == "weight" and is_adapter(module := chunk.get_submodule(owner)):
        delta = module.delta_weight() if p.expert is None else module.delta_weight(p.expert)  # type: ignore[operator]
        local = local + delta.detach().to(local.dtype)
    return local


def _gather(chunks: Sequence[nn.Module], bucket: list[Owner], config: ModelConfig, merged: bool) -> list[Tensor]:
    """Full HF tensors of the bucket's params from this tensor-parallel group's shards: one all-gather."""
    from megatron.core import parallel_state as ps

    if bucket[0][3] is None:
        tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    else:  # a bucket of experts (buckets do not mix them with other params): the expert-TP group's shards
        tp, group = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()
    locals_ = [_local(chunks[vp], p, merged) for _, vp, p, _ in bucket]
    split = [i for i, (_, _, p, _) in enumerate(bucket) if SPLIT_DIM[p.kind] is not None]
    per_rank = {i: [locals_[i]] for i in split}  # param index -> its shard on every TP rank
    if tp > 1 and split:
        flat = _flat([locals_[i] for i in split])
        shards = [torch.empty_like(flat) for _ in range(tp)]
        torch.distributed.all_gather(shards, flat, group=group)
        for i, *pieces in zip(split, *(_unflat(shard, [locals_[i] for i in split]) for shard in shards), strict=True):
            per_rank[i] = pieces
    full: list[Tensor] = []
    for i, (_, _, p, _) in enumerate(bucket):
        if i not in per_rank:  # replicated
            full.append(locals_[i].clone())
            continue
        parts = [split_local(p, shard, config, tp) for shard in per_rank[i]]  # [tp][HF tensors of p]
        full += [join_rank_blocks(p.kind, [rank_parts[j] for rank_parts in parts]) for j in range(len(p.hf))]
    for tensor, (name, shape) in zip(full, [hf for _, _, p, _ in bucket for hf in p.hf], strict=True):
        assert tuple(tensor.shape) == shape, f"{name}: exported {tuple(tensor.shape)}, expected {shape}"
    return full


def save_pretrained(
    module: Any, path: str | Path, *, dtype: torch.dtype | None = None, max_shard_size: int = 5 * 2**30,
    weight_format: WeightFormat = "float",
) -> None:  # fmt: skip
    """Collective: write ``module`` as an HF model directory (config.json + safetensors) with rank 0: ``dtype``
    tensors, or with ``weight_format="fp8_block"`` the weights its block-quantized source stored in fp8 quantized
    again in its blocks, with ``weight_format="mxfp4"`` GPT-OSS's experts in MXFP4 (the rest in ``dtype``)."""
    written = _written(module, weight_format)  # all three before anything is written
    check_running(module)
    check_exportable(config := module.config)
    dtype = dtype or next(module.chunks[0].parameters()).dtype
    is_writer = torch.distributed.get_rank() == 0
    sizes = written.sizes(hf_weight_shapes(config, include_tied=False), dtype.itemsize)
    shards = _group(list(sizes), sizes.__getitem__, max_shard_size)  # files of at most max_shard_size bytes
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    names = names if len(shards) > 1 else [SAFETENSORS_FILE]
    path = Path(path)
    if is_writer:
        path.mkdir(parents=True, exist_ok=True)
        # An earlier save's shards would mix in.
        for old in [*path.glob("model*.safetensors"), path / SAFETENSORS_INDEX]:
            old.unlink(missing_ok=True)
    shard, bucket = 0, {}
    for name, tensor in (pair for b in export_weights(list(module.chunks), config, include_tied=False) for pair in b):
        if not is_writer:
            continue
        for stored_name, stored in written.stored(name, tensor, dtype):  # (a weight, its scales or blocks)
            bucket[stored_name] = stored
            if len(bucket) == len(shards[shard]):
                write_replacing(path / names[shard], functools.partial(save_file, bucket, metadata={"format": "pt"}))
                shard, bucket = shard + 1, {}
    if is_writer:
        _write_metadata(module, path, shards, names, sizes, dtype, written.quantization_config)
    torch.distributed.barrier()


def _written(module: Any, weight_format: WeightFormat) -> _Written:
    """The weights to write quantized, and how: none for ``weight_format="float"``; the source's fp8 weights in its
    blocks; GPT-OSS's experts in MXFP4 (the source's MXFP4 weights, or all experts but those
    ``modules_to_not_convert`` lists)."""
    if weight_format == "float":
        return _Written()
    source: HFCheckpoint | None = getattr(module, "hf_checkpoint", None)
    if weight_format == "mxfp4":
        return _mxfp4_written(module.config, source)
    if weight_format != "fp8_block":
        raise ValueError(
            f"save_hf(weight_format={weight_format!r}): 'float' writes dtype tensors, 'fp8_block' the weights of a "
            "block-quantized HF source in its fp8 blocks, 'mxfp4' GPT-OSS's experts in MXFP4"
        )
    if source is None or source.quantization is None:
        raise ValueError(
            "save_hf(weight_format='fp8_block') writes the weights that a block-quantized HF source (config.json "
            "with quantization_config, quant_method='fp8') stored in fp8, in its blocks; this module's source is "
            f"{'not block-quantized' if source else 'not an HF directory'}: write weight_format='float'"
        )
    return _Written(source.fp8_weights(), source.quantization.block, quantization_config=_source_quantization(source))


def _mxfp4_written(config: ModelConfig, source: HFCheckpoint | None) -> _Written:
    family = check_exportable(config)
    if not family.mxfp4_weights:
        raise ValueError(
            "save_hf(weight_format='mxfp4') writes GPT-OSS's experts in MXFP4; this model is written as "
            f"{family.export_architecture}, which has no MXFP4 weights: write weight_format='float'"
        )
    if source is not None and source.mxfp4 is not None:  # the source's format again
        return _Written(mxfp4=source.mxfp4_weights(), quantization_config=_source_quantization(source))
    quantization = mxfp4.MXFP4(mxfp4.DEFAULT_NOT_CONVERTED)
    names = {
        name for name in hf_weight_shapes(config, include_tied=False)
        if name.endswith(family.mxfp4_weights) and quantization.listed_unconverted(name) is None
    }  # fmt: skip
    return _Written(mxfp4=names, quantization_config=quantization.config_dict())


def _source_quantization(source: HFCheckpoint) -> dict[str, Any]:
    return dict(source.config["quantization_config"])


def _write_metadata(
    module: Any, path: Path, shards: list[list[str]], names: list[str], sizes: dict[str, int], dtype: torch.dtype,
    quantization_config: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    source: HFCheckpoint | None = getattr(module, "hf_checkpoint", None)
    dtype_name = str(dtype).removeprefix("torch.")
    if source is None:
        hf_config = hf_config_dict(module.config, dtype)
    else:
        hf_config = dict(source.config)
        # The files hold `dtype` tensors; say so, or from_pretrained(dtype="auto") would cast them.
        key = "torch_dtype" if "torch_dtype" in hf_config and "dtype" not in hf_config else "dtype"
        hf_config[key] = dtype_name
        # Without quantized weights the files hold `dtype` tensors: transformers would look for fp8 and scales.
        hf_config.pop("quantization_config", None)
        if hf_config.get("num_nextn_predict_layers"):  # import skipped the MTP layers: the files hold none
            hf_config["num_nextn_predict_layers"] = 0
        for side in side_files(source.path, source.config):  # (HFCheckpoint.open checked they lie inside it)
            if source.path.resolve() != path.resolve():
                write_replacing(path / side, functools.partial(shutil.copyfile, source.path / side))
    if quantization_config is not None:
        hf_config["quantization_config"] = quantization_config
    text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    write_replacing(path / "config.json", lambda temporary: temporary.write_text(text))
    if len(shards) > 1:
        total = sum(sizes.values())
        weight_map = {name: names[i] for i, shard in enumerate(shards) for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(index, indent=2) + "\n"
        write_replacing(path / SAFETENSORS_INDEX, lambda temporary: temporary.write_text(text))


def write_replacing(target: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary)`` to a new file beside ``target``, then rename it onto ``target``: a symlink (or hard
    link) planted at ``target`` in an output directory is replaced, never written through, and no half-written
    file is left under the name."""
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: a new file of ours (never a planted link), with the mode the umask gives any new file.
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(temporary)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
