"""Hugging Face out: stream or write the full HF state dict of a running model.

:func:`export_weights` yields full HF tensors one at a time (gathered over tensor parallelism, broadcast from the
pipeline stage that owns them); :func:`save_pretrained` writes them as an HF model directory with rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_megatron.config import ModelConfig
from lightning_megatron.contract import MegatronRuntime
from lightning_megatron.hf.config import check_exportable, hf_config_dict
from lightning_megatron.hf.load import SAFETENSORS_FILE, SAFETENSORS_INDEX, HFCheckpoint
from lightning_megatron.hf.mapping import SPLIT_DIM, Param, chunk_params, hf_weight_shapes, split_local

_NOT_RUNNING = (
    "HF export needs the built model and Megatron's parallel state: call it from a hook while the Trainer runs "
    "(e.g. on_train_end, on_validation_end, or a callback's on_train_batch_end)"
)

# Files of an HF model directory that save_pretrained carries over from the directory the model was loaded from.
_SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip


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
def _owners(chunks: Sequence[nn.Module], config: ModelConfig) -> list[tuple[int, int, Param]]:
    """(pipeline rank, chunk index on that rank, param) for every HF tensor of the model, in HF order."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tconfig = chunks[0].config
    pp, vpp = tconfig.pipeline_model_parallel_size, tconfig.virtual_pipeline_model_parallel_size
    per_chunk = config.num_layers // (pp * (vpp or 1))
    stages = []
    for vp in range(vpp or 1):
        for rank in range(pp):
            offset = get_transformer_layer_offset(tconfig, vp if vpp else None, pp_rank=rank)
            pre, post = rank == 0 and vp == 0, rank == pp - 1 and vp == (vpp or 1) - 1
            params = chunk_params(config, pre=pre, post=post, offset=offset, num_layers=per_chunk)
            stages.append((offset, rank, vp, params))
    owners, seen = [], set()
    for _, rank, vp, params in sorted(stages, key=lambda s: s[0]):
        for p in params:
            if p.hf[0][0] not in seen:  # the last stage's copy of tied embeddings is not exported twice
                seen.update(name for name, _ in p.hf)
                owners.append((rank, vp, p))
    return owners


def export_weights(
    chunks: Sequence[nn.Module], config: ModelConfig, *, include_tied: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(hf_name, full tensor)`` one at a time, on every rank. Collective: every rank must exhaust it."""
    from megatron.core import parallel_state as ps

    check_exportable(config)  # before any collective: every rank raises alike
    owners = _owners(chunks, config)
    if config.share_embeddings_and_output_weights and include_tied:
        rank, vp, embed = owners[0]
        owners.append((rank, vp, dataclasses.replace(embed, hf=(("lm_head.weight", embed.hf[0][1]),))))
    first = next(chunks[0].parameters())
    pp_group, my_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    for rank, vp, p in owners:
        tensors = _gather(chunks[vp], p, config) if rank == my_rank else None
        for i, (name, shape) in enumerate(p.hf):
            tensor = tensors[i] if tensors is not None else torch.empty(shape, dtype=first.dtype, device=first.device)
            if ps.get_pipeline_model_parallel_world_size() > 1:
                src = torch.distributed.get_global_rank(pp_group, rank)
                torch.distributed.broadcast(tensor, src=src, group=pp_group)
            yield name, tensor
        del tensors


def _gather(chunk: nn.Module, p: Param, config: ModelConfig) -> list[Tensor]:
    """Full HF tensors of p from this tensor-parallel group's shards."""
    from megatron.core import parallel_state as ps

    local = chunk.get_parameter(p.megatron).detach()
    dim, tp = SPLIT_DIM[p.kind], ps.get_tensor_model_parallel_world_size()
    if dim is None:
        return [local.clone()]
    shards = [local]
    if tp > 1:
        shards = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    per_rank = [split_local(p, shard, config, tp) for shard in shards]  # [tp][HF tensors of p]
    full = [torch.cat([parts[i] for parts in per_rank], dim=dim) for i in range(len(p.hf))]
    for tensor, (name, shape) in zip(full, p.hf, strict=True):
        assert tuple(tensor.shape) == shape, f"{name}: exported {tuple(tensor.shape)}, expected {shape}"
    return full


def save_pretrained(
    module: Any, path: str | Path, *, dtype: torch.dtype | None = None, max_shard_size: int = 5 * 2**30
) -> None:
    """Collective: write ``module`` as an HF model directory (config.json + safetensors) with rank 0."""
    check_running(module)  # both before anything is written
    check_exportable(config := module.config)
    dtype = dtype or next(module.chunks[0].parameters()).dtype
    is_writer = torch.distributed.get_rank() == 0
    shapes = hf_weight_shapes(config, include_tied=False)
    shards = _plan_shards(shapes, dtype.itemsize, max_shard_size)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    names = names if len(shards) > 1 else [SAFETENSORS_FILE]
    path = Path(path)
    if is_writer:
        path.mkdir(parents=True, exist_ok=True)
        # An earlier save's shards would mix in.
        for old in [*path.glob("model*.safetensors"), path / SAFETENSORS_INDEX]:
            old.unlink(missing_ok=True)
    shard, bucket = 0, {}
    for name, tensor in export_weights(list(module.chunks), config, include_tied=False):
        if not is_writer:
            continue
        bucket[name] = tensor.detach().to("cpu", dtype).contiguous()
        if len(bucket) == len(shards[shard]):
            save_file(bucket, path / names[shard], metadata={"format": "pt"})
            shard, bucket = shard + 1, {}
    if is_writer:
        _write_metadata(module, path, shards, names, shapes, dtype)
    torch.distributed.barrier()


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into files of at most ``max_bytes`` (a bigger single tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_metadata(
    module: Any, path: Path, shards: list[list[str]], names: list[str], shapes: dict, dtype: torch.dtype
) -> None:
    source: HFCheckpoint | None = getattr(module, "hf_checkpoint", None)
    dtype_name = str(dtype).removeprefix("torch.")
    if source is None:
        hf_config = hf_config_dict(module.config, dtype)
    else:
        hf_config = dict(source.config)
        # The files hold `dtype` tensors; say so, or from_pretrained(dtype="auto") would cast them.
        key = "torch_dtype" if "torch_dtype" in hf_config and "dtype" not in hf_config else "dtype"
        hf_config[key] = dtype_name
        for side in _SIDE_FILES:
            if (source.path / side).is_file() and source.path.resolve() != path.resolve():
                shutil.copyfile(source.path / side, path / side)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if len(shards) > 1:
        total = sum(dtype.itemsize * int(torch.Size(s).numel()) for s in shapes.values())
        weight_map = {name: names[i] for i, shard in enumerate(shards) for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
