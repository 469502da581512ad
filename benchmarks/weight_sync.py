"""Weight-sync export speed: ``export_hf_weights`` per tensor vs in buckets, to GPU tensors and to pinned host memory.

    python benchmarks/weight_sync.py --shape 1b --bucket-mb 512

Builds the model under ``Trainer`` + ``MegatronStrategy`` (bf16-mixed, one training step so the weights are the
trained ones), then at ``on_train_end`` times, on every rank, draining the GPU at both ends: (1) the per-tensor
stream, each tensor kept until the next (what a consumer copying into an engine sees); (2) ``bucket_bytes``
buckets; (3) both again copying every tensor into one preallocated pinned host buffer; (4) with ``--lora-rank``,
the ``lora_only`` stream. Prints one JSON line. On one GPU there are no collectives: the difference per tensor vs
per bucket is then only the bucket's copies; with TP/PP it is one gather/broadcast per tensor vs per bucket.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from benchmarks.throughput import SHAPES, VOCAB


def _timed(fn: Callable[[], int]) -> dict[str, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    nbytes = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 4), "gb": round(nbytes / 1e9, 3), "gb_per_s": round(nbytes / 1e9 / seconds, 2)}


def _consume(stream: Iterable[Any], host: torch.Tensor | None) -> int:
    """Walk a per-tensor or bucketed stream; with ``host``, copy every tensor into it (pinned, asynchronously)."""
    offset = total = 0
    for item in stream:
        for _, tensor in item if isinstance(item, list) else [item]:
            n = tensor.numel()
            if host is not None:
                if offset + n > host.numel():
                    offset = 0  # a ring over the buffer: the copies, not the buffer size, are measured
                host[offset : offset + n].copy_(tensor.reshape(-1), non_blocking=True)
                offset += n
            total += n * tensor.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=list(SHAPES))
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--lora-rank", type=int, default=0, help="also time lora_only (LoRA on all linears)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--devices", type=int, default=1)
    args = p.parse_args()

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_megatron import LoRAConfig, MegatronLMModule, MegatronStrategy, ModelConfig
    from lightning_megatron.data.corpus import synthetic_tokens

    config = ModelConfig(**SHAPES[args.shape], vocab_size=VOCAB, seq_length=512)
    lora = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
    module = MegatronLMModule(config, lr=1e-4, lora=lora)
    results: dict[str, Any] = {"shape": args.shape, "bucket_mb": args.bucket_mb, "tp": args.tp, "pp": args.pp}

    class Measure(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            bucket = args.bucket_mb * 2**20
            host = torch.empty(bucket // 2, dtype=torch.bfloat16, pin_memory=True)  # bucket bytes of bf16
            for _ in range(2):  # the second pass is reported (the first allocates the caching allocator's blocks)
                results["per_tensor_gpu"] = _timed(lambda: _consume(pl_module.export_hf_weights(), None))
                results["buckets_gpu"] = _timed(
                    lambda: _consume(pl_module.export_hf_weights(bucket_bytes=bucket), None)
                )
                results["per_tensor_pinned"] = _timed(lambda: _consume(pl_module.export_hf_weights(), host))
                results["buckets_pinned"] = _timed(
                    lambda: _consume(pl_module.export_hf_weights(bucket_bytes=bucket), host)
                )
                if lora is not None:
                    results["lora_only_gpu"] = _timed(
                        lambda: _consume(pl_module.export_hf_weights(lora_only=True), None)
                    )
            results["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)

    trainer = L.Trainer(
        accelerator="gpu", devices=args.devices, precision="bf16-mixed", max_steps=1, logger=False,
        strategy=MegatronStrategy(tp=args.tp, pp=args.pp, micro_batch_size=1), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()],
    )  # fmt: skip
    trainer.fit(module, DataLoader(synthetic_tokens(args.devices, 512, VOCAB), batch_size=1))
    if trainer.global_rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
