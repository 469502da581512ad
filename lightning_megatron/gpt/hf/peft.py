"""PEFT adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``, in PEFT's names.

Our adapters are PEFT's (one per HF projection, :mod:`lightning_megatron.gpt.lora.layers`), so a directory written by
:func:`save_adapter` loads with ``peft.PeftModel.from_pretrained(base, path)``, and one written by PEFT
(``get_peft_model(...).save_pretrained(path)``) opens with :func:`open_adapter`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_megatron.checkpointing.contained import hf_roots, inside
from lightning_megatron.gpt.config import ModelConfig
from lightning_megatron.gpt.hf.load import HFCheckpoint, check_floating, open_safetensors
from lightning_megatron.gpt.hf.mapping import adapter_shapes
from lightning_megatron.gpt.lora.config import (
    HF_BLOCK,
    MLA_PROJECTIONS,
    PROJECTIONS,
    LoRAConfig,
    adapter_parts,
    check_lora,
    is_column,
    layer_linears,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
PICKLED_ADAPTER_FILE = "adapter_model.bin"
# What we write of PEFT's LoraConfig fields beyond rank, alpha, dropout and targets: plain LoRA.
_PLAIN = {
    "use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
    "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    "layer_replication": None, "trainable_token_indices": None, "lora_bias": False, "exclude_modules": None,
}  # fmt: skip
# Fields that do not change an adapter's weights or math once trained (bookkeeping, the init it started from).
_HARMLESS = {
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "init_lora_weights", "megatron_core", "qalora_group_size", "ensure_weight_tying", "r", "lora_alpha",
    "lora_dropout", "target_modules", "target_parameters",
}  # fmt: skip
# PEFT's target_parameters on HF's fused MoE experts (transformers >= 5), and the Megatron linear each adapts (PEFT
# writes them with or without the "mlp.experts." path).
EXPERT_PARAMETERS = {"mlp.experts.gate_up_proj": "linear_fc1", "mlp.experts.down_proj": "linear_fc2"}
# A PEFT adapter tensor's name: its decoder layer's module path, the factor.
_ADAPTER_NAME = re.compile(r"base_model\.model\.model\.layers\.\d+\.(?P<path>.+)\.lora_[AB]\.weight")


def _check_plain(peft_config: dict[str, Any], path: Path) -> None:
    """Any other field -- those of a PEFT version to come too -- must be unset (None, False, empty, ``bias='none'``):
    an allow-list, so that a LoRA variant (DoRA, rsLoRA, LoftQ, aLoRA, ...) is refused, not loaded with wrong math."""
    for field, value in peft_config.items():
        if field not in _HARMLESS and value not in (None, False, {}, [], "none"):
            raise ValueError(
                f"{path / ADAPTER_CONFIG}: {field}={value!r} is not supported: plain LoRA adapters only (that field "
                "unset)"
            )


def hf_targets(lora: LoRAConfig, config: ModelConfig) -> list[str]:
    """PEFT's ``target_modules`` for our adapters: the HF projections that have one (of an MoE model, attention's:
    its experts' are ``target_parameters``)."""
    blocks = [t for t in layer_linears(config) if config.num_moe_experts is None or HF_BLOCK[t] == "self_attn"]
    return [part for target in blocks for part, _, _ in lora.adapted_parts(target, config)]


def hf_target_parameters(lora: LoRAConfig, config: ModelConfig) -> list[str]:
    """PEFT's ``target_parameters`` for our adapters on an MoE model's MLPs: the experts' on HF's fused expert
    tensors, then the dense MLPs' (dense layers ``mlp.gate_proj.weight``, ..., a shared expert
    ``mlp.shared_experts.gate_proj.weight``, ...) by their path in the layer. PEFT (transformers >= 5) reads the
    gate_proj/up_proj/down_proj ``target_modules`` of these models as their experts', so the dense MLPs' adapters
    are named as parameters, which it matches by the end of their name; their tensors have the names of adapters on
    modules."""
    if config.num_moe_experts is None:
        return []
    experts = [name for name, target in EXPERT_PARAMETERS.items() if lora.adapts(target)]
    paths = (match["path"] for name in adapter_shapes(config, lora) if (match := _ADAPTER_NAME.fullmatch(name)))
    dense = [f"{path}.weight" for path in paths if path.startswith("mlp.") and not path.startswith("mlp.experts")]
    return experts + list(dict.fromkeys(dense))


def adapter_config_dict(lora: LoRAConfig, config: ModelConfig, base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of our adapters (PEFT ``LoraConfig`` fields)."""
    experts = {"target_parameters": hf_target_parameters(lora, config)} if hf_target_parameters(lora, config) else {}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": hf_targets(lora, config),
        "inference_mode": True, "init_lora_weights": True, **_PLAIN, **experts,
    }  # fmt: skip


def _targets(peft_targets: Any, config: ModelConfig, path: Path) -> tuple[str, ...]:
    """``LoRAConfig.target_modules`` for a PEFT ``target_modules`` list: Megatron's name for a linear whose every
    projection is adapted, the HF names of the others'."""
    if not isinstance(peft_targets, list):
        raise ValueError(
            f"{path / ADAPTER_CONFIG}: target_modules={peft_targets!r}; only a list of module names is read here "
            "(e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'])"
        )
    if dotted := [name for name in peft_targets if "." in name]:  # e.g. one layer's q_proj: not every layer's
        raise ValueError(
            f"{path / ADAPTER_CONFIG}: target_modules {dotted} name modules by path; only projection names "
            "(q_proj, ...; adapted in every layer) are read here"
        )
    leaves = set(peft_targets)
    if unknown := sorted(leaves - {*PROJECTIONS, *MLA_PROJECTIONS}):
        raise ValueError(f"{path / ADAPTER_CONFIG}: target_modules {unknown} are not projections of a decoder layer")
    targets: list[str] = []
    # Column-parallel linears first: TARGETS' order, which the targets of every linear read back keep.
    for target in sorted(layer_linears(config), key=is_column, reverse=True):
        parts = [part for part, _, _ in adapter_parts(target, config)]
        targets += [target] if set(parts) <= leaves else [part for part in parts if part in leaves]
        leaves -= set(parts)
    return (*targets, *sorted(leaves))  # projections this model lacks: LoRAConfig and check_lora name them


def _mlp_targets(names: Any, config: ModelConfig, path: Path, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The Megatron linears a PEFT ``target_parameters`` list adapts (an MoE model's MLPs: see
    :func:`hf_target_parameters`). A name adapts, as in PEFT, every parameter whose name ends with it; the experts',
    the shared expert's and the dense layers' projections of one linear are adapted together here, or not at all."""
    if not names:
        return ()
    ours = {t: hf_target_parameters(LoRAConfig(target_modules=(t,)), config) for t in ("linear_fc1", "linear_fc2")}
    every = [name for names_of in ours.values() for name in names_of]
    given = names if isinstance(names, list) and all(isinstance(n, str) for n in names) else []
    matched = [{name for name in every if _ends_with(name, n)} for n in given]
    if not given or not all(matched):  # also: no MoE model (no names of ours)
        raise ValueError(
            f"{path / ADAPTER_CONFIG}: target_parameters={names!r}; only a list of an MoE model's MLP projections "
            f"is read here (this model's: {every or 'none, it has no experts'}; or the end of such a name, e.g. "
            "'gate_up_proj')"
        )
    adapted = set().union(*matched)
    for target, names_of in ours.items():
        if adapted & set(names_of) and (missing := [n for n in names_of if n not in adapted]):
            raise ValueError(
                f"{path / ADAPTER_CONFIG}: target_parameters={names!r} leave out {missing}: LoRA here adapts an MoE "
                f"model's {target} projections ({names_of}: its experts', shared expert's and dense layers') "
                "together; adapt them all, or none"
            )
    return tuple(t for t, names_of in ours.items() if adapted & set(names_of) and t not in targets)


def _ends_with(name: str, given: str) -> bool:
    """Whether PEFT's ``target_parameters`` entry ``given`` names ``name`` (the whole or its end, after a dot), ending
    at a projection (not e.g. 'weight' alone, which would name every weight)."""
    projection = given.removesuffix(".weight").rpartition(".")[2]
    proper = projection in ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
    return proper and (name == given or name.endswith(f".{given}"))


def _compared(field: str, lora: LoRAConfig, config: ModelConfig) -> Any:
    # Targets as the projections they adapt: ("linear_qkv",) is ("q_proj", "k_proj", "v_proj").
    return set(hf_targets(lora, config)) if field == "target_modules" else getattr(lora, field)


def open_adapter(
    path: str | Path, config: ModelConfig, lora: LoRAConfig | dict[str, Any] | None = None
) -> tuple[HFCheckpoint, LoRAConfig]:
    """A PEFT LoRA adapter directory for a model of ``config``, checked (settings, names, shapes) before anything
    is built, and the :class:`~lightning_megatron.LoRAConfig` it implies. ``lora`` may add the dropout and seed;
    its rank, alpha and targets must match the adapter's (as a dict: those of them it names)."""
    path = Path(path)
    _check_files(path)
    peft_config = json.loads((path / ADAPTER_CONFIG).read_text())
    if peft_config.get("peft_type") != "LORA":
        raise ValueError(f"{path / ADAPTER_CONFIG}: peft_type={peft_config.get('peft_type')!r}; only 'LORA' loads")
    _check_plain(peft_config, path)
    given = dataclasses.asdict(lora) if isinstance(lora, LoRAConfig) else dict(lora or {})
    targets = _targets(peft_config["target_modules"], config, path)
    targets += _mlp_targets(peft_config.get("target_parameters"), config, path, targets)
    found = LoRAConfig(
        rank=peft_config["r"], alpha=float(peft_config["lora_alpha"]), dropout=float(peft_config["lora_dropout"]),
        target_modules=targets,
    )  # fmt: skip
    found = dataclasses.replace(found, **{k: v for k, v in given.items() if k in ("dropout", "seed")})
    check_lora(found, config)
    for field in (f for f in ("rank", "alpha", "target_modules") if f in given):
        wanted = dataclasses.replace(found, **{field: given[field]})
        if _compared(field, wanted, config) != _compared(field, found, config):
            raise ValueError(
                f"LoRAConfig({field}={given[field]!r}) differs from the adapter in {path} ({field}="
                f"{getattr(found, field)!r}); leave lora= out, or pass a dict of dropout/seed only (lora="
                "{'dropout': 0.05}), to take the adapter's rank, alpha and targets"
            )
    shapes = _shapes(path / ADAPTER_FILE)
    want = adapter_shapes(config, found)
    if wrong := [n for n in set(want) | set(shapes) if want.get(n) != shapes.get(n)]:
        name = sorted(wrong)[0]
        raise ValueError(
            f"{path / ADAPTER_FILE} does not fit this base model: {name} is {shapes.get(name, 'missing')} there and "
            f"{want.get(name, 'not a tensor of the model')} here ({len(wrong)} such tensor(s)); was the adapter "
            "trained on another base?"
        )
    return HFCheckpoint(path=path, config=peft_config, files=dict.fromkeys(shapes, ADAPTER_FILE)), found


def _check_files(path: Path) -> None:
    """The adapter's two files are there, safetensors (no pickle is read) and inside ``path`` (or, for a hub-cache
    snapshot, its repository's blobs)."""
    has_config, has_weights = (path / ADAPTER_CONFIG).is_file(), (path / ADAPTER_FILE).is_file()
    if has_config and not has_weights and (path / PICKLED_ADAPTER_FILE).is_file():
        raise ValueError(
            f"{path / PICKLED_ADAPTER_FILE} is a PyTorch pickle (which can run code when loaded); only {ADAPTER_FILE} "
            "is read. Convert it once with peft: PeftModel.from_pretrained(base, path).save_pretrained(new_path)"
        )
    if not has_config or not has_weights:
        raise FileNotFoundError(f"{path} is not a PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_FILE})")
    roots = hf_roots(path)
    for name in (ADAPTER_CONFIG, ADAPTER_FILE):
        inside(path, name, "the adapter directory", roots)


def _shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the adapter file, its dtype checked (headers only)."""
    with open_safetensors(file) as f:
        slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
        for name, tensor in slices.items():
            check_floating(name, tensor.get_dtype(), file)
        return {name: tuple(tensor.get_shape()) for name, tensor in slices.items()}


def with_adapter(
    adapter: str | Path | None, config: ModelConfig, lora: LoRAConfig | dict[str, Any] | None
) -> tuple[HFCheckpoint | None, LoRAConfig | dict[str, Any] | None]:
    """For ``from_hf(..., adapter=, lora=)``: the opened adapter (None without one) and the module's ``lora``."""
    if adapter is None:
        return None, lora
    return open_adapter(adapter, config, lora)


def save_adapter(module: Any, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Collective: write ``module``'s adapters as a PEFT adapter directory with rank 0."""
    from lightning_megatron.gpt.hf.export import check_running, export_weights, write_replacing

    check_running(module)
    lora, config = module.lora, module.config
    if hf_target_parameters(lora, config) and lora.dropout > 0:
        raise ValueError(
            f"LoRAConfig(dropout={lora.dropout}) on an MoE model's MLPs: PEFT's adapters on parameters "
            "(target_parameters, as the experts' and, on these models, the dense MLPs' are written) take no dropout, "
            "so this adapter would not load there; save the merged weights (save_hf(path)) instead"
        )
    tensors = {}
    is_writer = torch.distributed.get_rank() == 0
    for bucket in export_weights(list(module.chunks), config, lora=lora):
        for name, tensor in bucket:
            if is_writer:
                tensors[name] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    if is_writer:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        write_replacing(path / ADAPTER_FILE, lambda temporary: save_file(tensors, temporary, metadata={"format": "pt"}))
        source = getattr(module, "hf_checkpoint", None)
        base = str(source.path) if source is not None else None
        text = json.dumps(adapter_config_dict(lora, config, base), indent=2) + "\n"
        write_replacing(path / ADAPTER_CONFIG, lambda temporary: temporary.write_text(text))
    torch.distributed.barrier()
