"""The tiny random Hugging Face mixture-of-experts models of the MoE tests (Qwen3-MoE, Qwen2-MoE, Mixtral,
DeepSeek-V3, GLM-4.5 and GPT-OSS, written with ``save_pretrained``; nothing is downloaded), the transformers side of
their comparisons, the one-process Trainer and export recorder the HF tests share, and the jobs of the shared
two-process MoE launch (``LAYOUTS``: run once per session by ``tests/conftest.py``'s ``moe_layouts`` fixture through
``tests/hf_worker.py``).

A helper module, not a test module: test modules import its names; it imports no test module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, pack_sequences
from tests.hf_gpt_oss_models import make_mxfp4

SEQ = 16
BASE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "initializer_range": 0.1, "rms_norm_eps": 1e-6,
}  # fmt: skip
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # Layer 1 dense (mlp_only_layers), renormalised top-2 of 4 experts, q/k norms.
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 16}),
    # A gated shared expert, top-2 kept unrenormalised, q/k/v biases, tied embeddings.
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                                     "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # Multi-Latent Attention with a q latent, layer 0 dense, then 8 experts in 4 groups (top-4 of the best 2 groups),
    # one shared expert, the sigmoid router with its correction bias and scaling factor.
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4,
                                         "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                                         "norm_topk_prob": True, "q_lora_rank": 24, "kv_lora_rank": 32,
                                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                                         "num_key_value_heads": 4}),
    # GLM-4.5: the same MoE part on GQA attention with q/k/v biases, q/k norms and RoPE on half of each head.
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                   "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                   "routed_scaling_factor": 2.5, "norm_topk_prob": True, "head_dim": 16,
                                   "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True}),
    # GPT-OSS: q/k/v/o biases and sinks, a window of 4 then full attention, YaRN, biased router and experts.
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                 "head_dim": 16, "sliding_window": 4, "swiglu_limit": 0.5,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 8}}),
}  # fmt: skip
FAMILY = {"qwen3_moe": "Qwen3MoE", "qwen2_moe": "Qwen2MoE", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3",
          "glm4_moe": "Glm4Moe", "gpt_oss": "GptOss"}  # fmt: skip
SIGMOID_ROUTER = ("deepseek_v3", "glm4_moe")  # the correction bias, which transformers' training leaves as loaded


def make_hf_model(arch: str, path: Path, **extra: Any) -> Path:
    """The tiny random model of ``ARCHS[arch]`` (``extra``: config fields) written to ``path``."""
    config_name, overrides = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**BASE, **overrides, **extra})
    return save_randomised(config, path, sigmoid_router=arch in SIGMOID_ROUTER)


def save_randomised(config: Any, path: Path, sigmoid_router: bool = False) -> Path:
    """A random model of ``config`` (seed 0) written to ``path``, its norms, biases (GPT-OSS's experts' too) and
    buffers (the correction bias) randomised so that a wrong mapping shows; a sigmoid router's weights too (scores
    far from ties)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 1 and biases at 0
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if (tensor.ndim == 1 or name.endswith("_proj_bias")) and "inv_freq" not in name:
                tensor.copy_(torch.randn_like(tensor) * 0.2 + (1.0 if "norm" in name else 0.0))
            elif name.endswith("mlp.gate.weight") and sigmoid_router:
                tensor.copy_(torch.randn_like(tensor))
    model.save_pretrained(path)
    return path


def hf_model(path: Path) -> Any:
    """The transformers model at ``path`` in float32 with eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


# Documents packed first-fit into 4 rows of SEQ tokens: [9, 7], [12, 4], [5, 10, one pad token], [3, 13].
PACKED_LENGTHS = (9, 7, 12, 4, 5, 10, 3, 13)


def packed_documents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=generator) for n in PACKED_LENGTHS]


def hf_per_document(path: Path) -> tuple[float, torch.Tensor]:
    """``transformers`` on each document alone: the token-weighted loss, and the log-probs laid out like the packed
    rows' ``logprobs`` (position t: log p(token t+1); 0 at each document's last token and on padding)."""
    model = hf_model(path)
    rows = pack_sequences(packed_documents(), SEQ)
    want = torch.zeros(len(rows), SEQ)
    total, count = 0.0, 0
    with torch.no_grad():
        for r, row in enumerate(rows):
            starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [SEQ]
            for start, stop in zip(starts[:-1], starts[1:], strict=True):
                doc = row["input_ids"][start:stop]
                if row["labels"][start + 1 : stop].eq(-100).all():
                    continue  # the padding document
                logprobs = model(input_ids=doc[None]).logits[0].log_softmax(-1)
                picked = logprobs[:-1].gather(-1, doc[1:, None]).squeeze(-1)  # [n-1]
                want[r, start : stop - 1] = picked
                total, count = total - float(picked.sum()), count + len(doc) - 1
    return total / count, want


def hf_forward(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Logits, loss and the log-probability of each next token (HF's shift)."""
    with torch.no_grad():
        out = hf_model(path)(input_ids=tokens, labels=tokens)
    logprobs = torch.log_softmax(out.logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return out.logits, float(out.loss), logprobs


def train_both(path: Path, settings: dict[str, Any], overrides: dict[str, Any] | None = None) -> tuple:
    """Three steps of full fine-tuning from the HF checkpoint at ``path`` on the same 12 rows, 4 a step: transformers +
    ``torch.optim.AdamW(**settings)``, and ``from_hf`` under the strategy with the same settings (no clipping, no
    warm-up, constant LR; ``overrides``: ModelConfig fields). Each side's losses in step order, then the trained
    transformers model and module."""
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(3))
    want, model = hf_adamw_steps(path, samples, settings)
    module = MegatronLMModule.from_hf(path, seq_length=SEQ, clip_grad=0.0, warmup_steps=0, decay_style="constant",
                                      config_overrides=overrides, **settings)  # fmt: skip
    got: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            got.append(float(outputs["loss"]))

    cpu_trainer(2, max_steps=3, callbacks=[Record()], use_distributed_sampler=False).fit(
        module, DataLoader(samples, batch_size=4)
    )
    return want, got, model, module


def hf_adamw_steps(path: Path, samples: torch.Tensor, settings: dict[str, Any]) -> tuple[list[float], Any]:
    """transformers + ``torch.optim.AdamW(**settings)`` from the HF checkpoint at ``path``, one step per 4 rows of
    ``samples``: the losses in step order and the trained model."""
    model = hf_model(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), **settings)
    losses = []
    for batch in samples.split(4):
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    return losses, model


def make_tokens() -> torch.Tensor:
    """The 4 rows of ``SEQ`` tokens the MoE tests predict and validate on."""
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(1))


def cpu_trainer(micro_batch_size: int = 2, **kwargs: Any) -> L.Trainer:
    """A one-process CPU Trainer under ``MegatronStrategy(micro_batch_size=...)``: no logger, progress bar, summary
    or checkpointing unless ``kwargs`` say so."""
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=micro_batch_size), logger=False,
        enable_progress_bar=False, enable_model_summary=False, **{"enable_checkpointing": False, **kwargs},
    )  # fmt: skip


class Export(L.Callback):
    """At the end of ``predict``: the per-tensor export (``tensors``), the bucketed one flattened (``buckets``), and
    ``save_hf`` to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}

    def on_predict_end(self, trainer: L.Trainer, module: MegatronLMModule) -> None:  # type: ignore[override]
        self.tensors = {name: t.clone() for name, t in module.export_hf_weights()}
        self.buckets = [pair for b in module.export_hf_weights(bucket_bytes=20_000) for pair in b]
        module.save_hf(self.path)


ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}

# One 2-process run: each architecture at expert, tensor and pipeline parallelism (qwen3_moe's dense layer 1 on its own
# stage at PP=2, qwen2_moe's tied embeddings on both stages); the same HF checkpoints as the one-process tests.
LAYOUTS = {
    "qwen3_moe_ep2": {"arch": "qwen3_moe", "ep": 2}, "qwen3_moe_tp2": {"arch": "qwen3_moe", "tp": 2},
    "qwen3_moe_pp2": {"arch": "qwen3_moe", "pp": 2}, "qwen2_moe_ep2": {"arch": "qwen2_moe", "ep": 2},
    "qwen2_moe_pp2": {"arch": "qwen2_moe", "pp": 2}, "mixtral_tp2": {"arch": "mixtral", "tp": 2},
    "mixtral_ep2": {"arch": "mixtral", "ep": 2}, "deepseek_v3_ep2": {"arch": "deepseek_v3", "ep": 2},
    "deepseek_v3_tp2": {"arch": "deepseek_v3", "tp": 2}, "deepseek_v3_pp2": {"arch": "deepseek_v3", "pp": 2},
    "glm4_moe_ep2": {"arch": "glm4_moe", "ep": 2}, "glm4_moe_tp2": {"arch": "glm4_moe", "tp": 2},
    "glm4_moe_pp2": {"arch": "glm4_moe", "pp": 2}, "gpt_oss_ep2": {"arch": "gpt_oss", "ep": 2},
    "gpt_oss_tp2": {"arch": "gpt_oss", "tp": 2}, "gpt_oss_pp2": {"arch": "gpt_oss", "pp": 2},
    # Context parallelism: rows of 16 in chunks of 4, the window of 4 and the sinks across the chunks' edges (GPT-OSS,
    # also on packed rows: GPTModel's YaRN table); MLA's YaRN RoPE at each chunk's places, its heads gathered
    "gpt_oss_cp2": {"arch": "gpt_oss", "cp": 2, "packed": True}, "deepseek_v3_cp2": {"arch": "deepseek_v3", "cp": 2},
    # Full training with the experts (and their biases) split over expert tensor parallelism, checkpointed at step 2
    "gpt_oss_tp2_sp_trained": {"arch": "gpt_oss", "tp": 2, "sp": True, "train_steps": 3, "grad_norms": True,
                               "ckpt": True},
    # LoRA on every linear: attention, the experts (one adapter per expert and projection), the shared expert
    "qwen2_moe_ep2_lora": {"arch": "qwen2_moe", "ep": 2, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0,
                                                                                    "seed": 3}, "peft": False},
    # LoRA on the experts split over expert-parallel ranks, exported as a PEFT adapter (no dense MLPs: PEFT can name
    # the experts' adapters apart)
    "mixtral_ep2_lora": {"arch": "mixtral", "ep": 2, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0, "seed": 5}},
    # LoRA on every linear with the experts split over expert tensor parallelism, checkpointed at step 2
    "mixtral_tp2_lora": {"arch": "mixtral", "tp": 2, "sp": True, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0,
                                                                                           "seed": 4}, "ckpt": True},
    # LoRA on GPT-OSS's experts (their biases frozen) split over expert tensor parallelism: fc1's B by rows, which
    # PEFT interleaves (gate, up, gate, ...)
    "gpt_oss_tp2_lora": {"arch": "gpt_oss", "tp": 2, "sp": True, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0,
                                                                                           "seed": 6}},
    # LoRA on GPT-OSS's experts split over expert-parallel ranks (DP=2), exported merged and as a PEFT adapter
    "gpt_oss_ep2_lora": {"arch": "gpt_oss", "ep": 2, "train_steps": 3, "lora": {"rank": 8, "alpha": 16.0, "seed": 7}},
    # An MXFP4 GPT-OSS (``make_mxfp4`` of the gpt_oss checkpoint: layer 0's experts in MXFP4, layer 1's float), each
    # rank reading its experts' blocks and scales; compared with its dequantized reference
    "gpt_oss_mxfp4_ep2": {"arch": "gpt_oss", "ep": 2, "mxfp4": True},
    # Full fine-tuning of MLA + MoE at TP=2 with SP, as transformers + AdamW (no clipping or warm-up, constant LR, the
    # correction bias fixed as transformers leaves it)
    "deepseek_v3_tp2_train": {"arch": "deepseek_v3", "tp": 2, "sp": True, "train_steps": 3, "sampler": False,
                              "overrides": {"moe_router_bias_update_rate": 0.0},
                              "optim": {**ADAMW, "clip_grad": 0.0, "decay_style": "constant"}},
}  # fmt: skip


def layout_runs(models: dict[str, Path], tokens: torch.Tensor, tmp: Path) -> list[dict[str, Any]]:
    """The arguments of the two 2-process ``hf_worker:main`` runs that together run every ``LAYOUTS`` job (job ``i``
    in run ``i % 2``: side by side, each run's ranks waiting on each other, they keep two cores busy), their files in
    ``tmp``. Each job names its HF checkpoint (``model``) and the float checkpoint its export and transformers'
    results are compared with (``reference``: the model, or an MXFP4 model's dequantized weights)."""
    torch.save(tokens, tmp / "tokens.pt")
    torch.save(pack_sequences(packed_documents(), SEQ), tmp / "packed.pt")  # for the jobs with "packed"
    jobs = []
    for name, job in LAYOUTS.items():
        model = reference = models[job["arch"]]
        if job.get("mxfp4"):
            model, reference = make_mxfp4(models[job["arch"]], tmp / name)
        ckpt = str(tmp / f"ckpt-{name}") if job.get("ckpt") else None
        jobs.append({**job, "name": name, "model": str(model), "reference": str(reference), "logprobs": True,
                     "save": str(tmp / f"saved-{name}"), "ckpt": ckpt})  # fmt: skip
    return [{"devices": 2, "tokens": str(tmp / "tokens.pt"), "packed": str(tmp / "packed.pt"),
             "out": str(tmp / f"result{half}"), "jobs": jobs[half::2]} for half in range(2)]  # fmt: skip


def layout_results(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ``LAYOUTS`` job of the finished ``runs``: each rank's result (``ranks``) and logits, the paths of its
    ``save_hf`` export, checkpoints and reference."""
    results = {}
    for run in runs:
        ranks = [json.loads(Path(f"{run['out']}.rank{r}.json").read_text()) for r in range(2)]
        for i, job in enumerate(run["jobs"]):
            results[job["name"]] = {
                "ranks": [ranks[r][i] for r in range(2)],
                "logits": [torch.load(f"{run['out']}.job{i}.rank{r}.pt") for r in range(2)],
                "save": Path(job["save"]), "ckpt": job["ckpt"], "reference": Path(job["reference"]),
            }  # fmt: skip
    return results
