"""Real-sized HF check: a random-weight Llama (1.0B shape by default) imported at a parallel layout, exported back,
compared tensor by tensor, and its loss compared with transformers'. Prints one JSON line.

    python benchmarks/hf_roundtrip.py --devices 2 --tp 2      # on 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy
from lightning_megatron.data.corpus import synthetic_tokens


def make_model(path: Path, shape: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {"1b": (2048, 16, 16, 5632), "tiny": (256, 2, 4, 512)}[shape]
    hidden, layers, heads, ffn = sizes
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        intermediate_size=ffn, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


class Compare(L.Callback):
    """Export on every rank during validation and compare with the files, tensor by tensor (on rank 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.result: dict = {}

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        from safetensors import safe_open

        files = sorted(self.path.glob("*.safetensors"))
        handles = [safe_open(f, framework="pt") for f in files]
        where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
        start, worst, count = time.perf_counter(), 0.0, 0
        for name, tensor in pl_module.export_hf_weights():
            if trainer.is_global_zero:
                worst = max(worst, float((tensor.float().cpu() - where[name].get_tensor(name).float()).abs().max()))
            count += 1
        self.result = {
            "exported_tensors": count,
            "max_abs_diff": worst,
            "export_s": round(time.perf_counter() - start, 1),
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--shape", default="1b")
    p.add_argument("--dir", default="/tmp/hf_llama")
    p.add_argument("--accelerator", default="gpu")
    args = p.parse_args()
    path = Path(args.dir)
    if not (path / "config.json").exists():
        make_model(path, args.shape)
    tokens = synthetic_tokens(4, 256, 32000, seed=0)
    start = time.perf_counter()
    module = MegatronLMModule.from_hf(path, seq_length=256)
    compare = Compare(path)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[compare],
        strategy=MegatronStrategy(tp=args.tp, pp=args.pp, micro_batch_size=2),
    )  # fmt: skip
    val = trainer.validate(module, DataLoader(tokens, batch_size=4), verbose=False)[0]["val_loss"]
    if not trainer.is_global_zero:
        return
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.accelerator == "gpu" else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device)
    with torch.no_grad():
        hf_loss = float(hf(tokens.to(device), labels=tokens.to(device)).loss)
    print(json.dumps({
        "shape": args.shape, "devices": args.devices, "tp": args.tp, "pp": args.pp, **compare.result,
        "val_loss": val, "transformers_loss": hf_loss, "rel_diff": abs(val - hf_loss) / hf_loss,
        "import_validate_export_s": round(time.perf_counter() - start, 1), "device": device_name,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
