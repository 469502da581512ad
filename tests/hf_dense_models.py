"""The tiny random Hugging Face dense models of the HF tests (Llama, Mistral, Qwen2, Qwen3, Gemma 3 and Gemma 2,
written with ``save_pretrained``; nothing is downloaded), the transformers side of their comparisons (logits and loss,
per-document log-probs of packed rows, state-dict shapes, a PEFT adapter), the export recorder, and the jobs of the
dense layout launch (``JOBS``: one 2-process and one 4-process run through ``tests/hf_worker.py``, by
``tests/test_hf_layouts.py``).

A helper module, not a test module: test modules import its names; it imports no test module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, pack_sequences
from tests.hf_moe_models import cpu_trainer, packed_documents, save_randomised
from tests.hf_moe_models import hf_forward as moe_hf_forward

SEQ = 16
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
}  # fmt: skip
BASE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 16384, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
}  # fmt: skip
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # 8 heads in 4 groups: two query groups (of two heads) per tensor-parallel rank at TP=2.
    "llama": ("LlamaConfig", {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                              "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": 64, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 10000.0}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),  # head_dim != hidden / heads
    # Sliding (window 4 of the 16 tokens) and full layers, each with its RoPE base; post norms, (1 + w) gains.
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                                    "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0},
                                                        "full_attention": {"rope_type": "linear",
                                                                           "rope_theta": 500.0, "factor": 2.0}}}),
    # Gemma 3's layer without q/k norms, one RoPE, soft-capped attention scores and logits (caps that bite).
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                                "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
}  # fmt: skip


def make_hf_model(arch: str, path: Path) -> Path:
    """The tiny random model of ``ARCHS[arch]`` (seed 0, norms and biases randomised) written to ``path``."""
    config_name, overrides = ARCHS[arch]
    return save_randomised(getattr(transformers, config_name)(**{**BASE, **overrides}), path)


def make_peft_adapter(base: Path, path: Path, targets: tuple[str, ...] | None = None) -> Path:
    """An adapter made by ``peft`` (default: on every projection), with B away from its zero init (so it changes
    logits)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = targets or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(path)
    return path


def hf_forward(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """transformers' logits and loss on ``tokens`` (float32, eager attention)."""
    logits, loss, _ = moe_hf_forward(path, tokens)
    return logits, loss


def hf_state_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def total_elements(path: Path) -> int:
    """The tensor elements of the checkpoint at ``path``."""
    return sum(t.numel() for t in load_file(path / "model.safetensors").values())


class ExportAndSave(L.Callback):
    """At the end of ``predict``: the exported tensors' shapes (``shapes``) and ``save_hf`` to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shapes: dict[str, tuple[int, ...]] = {}

    def on_predict_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        self.shapes = {name: tuple(t.shape) for name, t in module.export_hf_weights()}
        module.save_hf(self.path)


# ------------------------------------------------------------------------------------------- TP=2 / PP=2
LORA = {"rank": 4, "alpha": 8.0, "seed": 3}
JOBS = {
    "llama_tp2": {"arch": "llama", "tp": 2, "packed": True},
    "llama_cp2": {"arch": "llama", "cp": 2, "packed": True},
    "mistral_tp2": {"arch": "mistral", "tp": 2},
    "qwen2_tp2": {"arch": "qwen2", "tp": 2},
    "qwen3_tp2": {"arch": "qwen3", "tp": 2},
    "llama_pp2_vpp2": {"arch": "llama", "pp": 2, "vpp": 2, "packed": True},
    "mistral_pp2": {"arch": "mistral", "pp": 2},
    "qwen2_pp2": {"arch": "qwen2", "pp": 2},  # tied embeddings: the last stage holds a copy
    "qwen3_pp2": {"arch": "qwen3", "pp": 2},
    "gemma3_tp2": {"arch": "gemma3", "tp": 2, "packed": True},  # windows inside documents, split over TP
    "gemma3_pp2": {"arch": "gemma3", "pp": 2},  # tied embeddings, a sliding and a full layer per stage
    "gemma3_cp2": {"arch": "gemma3", "cp": 2, "packed": True},  # windows across the CP chunks' edges, in documents
    "gemma2_tp2": {"arch": "gemma2", "tp": 2},  # the final soft-cap on each rank's vocabulary shard
    "gemma2_pp2": {"arch": "gemma2", "pp": 2},  # ... on the last stage only
    "gemma2_cp2": {"arch": "gemma2", "cp": 2},  # soft-capped scores and windows across the CP chunks' edges
    "llama_tp2_trained": {"arch": "llama", "tp": 2, "train_steps": 2},
    # LoRA on the frozen HF weights: the same adapters (seeded) and curve at every layout
    "llama_tp2_sp_lora_trained": {"arch": "llama", "tp": 2, "sp": True, "train_steps": 3, "lora": LORA},
    "llama_pp2_lora_trained": {"arch": "llama", "pp": 2, "train_steps": 3, "lora": LORA},
    "llama_tp2_peft_adapter": {"arch": "llama", "tp": 2, "adapter": "peft-adapter"},  # made by peft (multi)
    # the one-process run's adapter-only checkpoint of step 2 (lora_one_process), resumed with B and A sharded
    "llama_tp2_lora_resumed_trained": {"arch": "llama", "tp": 2, "train_steps": 3, "lora": LORA, "resume": "lora"},
    "qwen3_tp2_pp2": {"arch": "qwen3", "tp": 2, "pp": 2, "devices": 4},
    "llama_tp2_pp2_vpp2": {"arch": "llama", "tp": 2, "pp": 2, "vpp": 2, "devices": 4},
}
LORA_SAMPLES = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(0))  # as hf_worker's


def layout_runs(models: dict[str, Path], tokens: torch.Tensor, tmp: Path) -> list[dict[str, Any]]:
    """The arguments of the ``hf_worker:main`` runs that together do every ``JOBS`` job (one 2-process and one
    4-process run, by each job's ``devices``), their files in ``tmp``: ``peft-adapter`` and the one-process LoRA
    checkpoints in ``lora`` (``lora_one_process``) must be there before the runs start."""
    torch.save(tokens, tmp / "tokens.pt")
    torch.save(pack_sequences(packed_documents(), SEQ), tmp / "packed.pt")
    runs = []
    for devices in (2, 4):
        names = [name for name, job in JOBS.items() if job.get("devices", 2) == devices]
        jobs = [{**JOBS[n], "name": n, "model": str(models[JOBS[n]["arch"]]), "save": str(tmp / f"saved-{n}")}
                for n in names]  # fmt: skip
        for job in jobs:
            if "adapter" in job:
                job["adapter"] = str(tmp / job["adapter"])
            if "resume" in job:
                job["resume"] = str(tmp / job["resume"] / "epoch=0-step=2.ckpt")
        runs.append({"devices": devices, "tokens": str(tmp / "tokens.pt"), "packed": str(tmp / "packed.pt"),
                     "out": str(tmp / f"result{devices}"), "jobs": jobs})  # fmt: skip
    return runs


def layout_results(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ``JOBS`` job of the finished ``runs``: each rank's result (``ranks``) and logits, and the path of its
    ``save_hf`` export."""
    results = {}
    for run in runs:
        out, devices = run["out"], run["devices"]
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]
        for i, job in enumerate(run["jobs"]):
            results[job["name"]] = {
                "ranks": [ranks[r][i] for r in range(devices)], "save": Path(job["save"]),
                "logits": [torch.load(f"{out}.job{i}.rank{r}.pt") for r in range(devices)],
            }  # fmt: skip
    return results


def lora_one_process(base: Path, tokens: torch.Tensor, ckpt_dir: Path) -> dict:
    """LoRA on the HF weights at one process: 3 steps (adapter-only checkpoint at step 2), then validate, predict."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = MegatronLMModule.from_hf(base, seq_length=SEQ, lr=1e-2, warmup_steps=0, lora=LORA)

    class Record(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.values.append(float(outputs["loss"]))

    record, saver = Record(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    trainer = cpu_trainer(max_steps=3, num_sanity_val_steps=0, callbacks=[record, saver], enable_checkpointing=True)
    trainer.fit(module, DataLoader(LORA_SAMPLES, batch_size=4))
    loader = DataLoader(tokens, batch_size=tokens.shape[0])
    val_loss = cpu_trainer().validate(module, loader)[0]["val_loss"]
    return {"train": record.values, "val_loss": val_loss, "logits": torch.cat(cpu_trainer().predict(module, loader))}
