"""Any LightningModule made of Megatron-Core parts trains under MegatronStrategy.

A tensor-parallel MLP regressor built from ``ColumnParallelLinear`` + ``RowParallelLinear``: the module
implements the three methods of the contract (``build_chunk``, ``forward_step``, ``configure_optimizers``) and
the strategy does the rest (parallel state, DDP, distributed optimizer, schedule, checkpoints).

    python examples/tp_mlp.py --devices 2 --tp 2      # two processes on CPU, weights split across them
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron import ChunkSpec, MegatronLightningModule, MegatronStrategy, OptimizerSpec


class ParallelMLP(MegatronModule):
    """y = W2 gelu(W1 x): W1 split by output columns, W2 by input rows; one all-reduce per forward."""

    def __init__(self, config: TransformerConfig, dim: int, hidden: int) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules ask every chunk
        init = nn.init.xavier_uniform_
        self.up = ColumnParallelLinear(dim, hidden, config=config, init_method=init, bias=True, gather_output=False)
        self.down = RowParallelLinear(
            hidden, dim, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
        )

    def set_input_tensor(self, tensor: Tensor | None) -> None:
        """Megatron's schedules hand each chunk the previous stage's output; one stage has none to take."""

    def forward(self, x: Tensor) -> Tensor:
        hidden, _ = self.up(x)  # [B, hidden / tp] on each rank
        out, _ = self.down(torch.nn.functional.gelu(hidden))  # [B, dim], summed over tp ranks
        return out


class RegressionModule(MegatronLightningModule):
    def __init__(self, dim: int = 16, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.dim, self.hidden, self.lr = dim, hidden, lr

    def build_chunk(self, spec: ChunkSpec) -> nn.Module:
        if not (spec.pre_process and spec.post_process):
            raise ValueError("ParallelMLP is a single pipeline stage; use pp=1")
        # Megatron's schedules read TransformerConfig fields (fp8, MoE, ...) from every chunk's config, so even a
        # model without attention layers carries one; only the parallel fields matter here.
        heads = spec.parallel["tensor_model_parallel_size"]  # unused, but must divide by tp
        config = TransformerConfig(num_layers=1, hidden_size=self.dim, num_attention_heads=heads, **spec.parallel)
        return ParallelMLP(config, self.dim, self.hidden)

    def forward_step(self, batch: dict[str, Tensor], model: nn.Module) -> tuple[Tensor, object]:
        # Batches are dicts; the regression data rides in "input_ids" (inputs) and "labels" (targets).
        prediction = model(batch["input_ids"])

        def loss_fn(output: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            squared = (output - batch["labels"]).pow(2).sum()
            return squared, torch.tensor(batch["labels"].numel(), dtype=torch.int), {}

        return prediction, loss_fn

    def configure_optimizers(self) -> OptimizerSpec:  # type: ignore[override]
        return OptimizerSpec(
            config=OptimizerConfig(optimizer="adam", lr=self.lr, clip_grad=0.0), lr_decay_style="constant"
        )


def regression_data(n: int = 256, dim: int = 16, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator)
    y = torch.tanh(x @ torch.randn(dim, dim, generator=generator) / dim**0.5)
    return TensorDataset(x, y)


def collate(samples: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    x, y = zip(*samples, strict=True)
    return {"input_ids": torch.stack(x), "labels": torch.stack(y)}


def main(devices: int = 2, tp: int = 2, max_steps: int = 30) -> list[float]:
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=MegatronStrategy(tp=tp, micro_batch_size=8),
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    loader = DataLoader(regression_data(), batch_size=32, collate_fn=collate, drop_last=True)
    trainer.fit(RegressionModule(), loader)
    if trainer.global_rank == 0:
        print(f"mse: first {losses[0]:.4f} -> last {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args()
    main(args.devices, args.tp, args.max_steps)
