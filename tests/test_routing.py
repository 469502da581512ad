"""MoE routing replay: record the routing of a forward pass, replay it (or any other) in a training step."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronLMModule, MegatronStrategy, ParallelSizes, tiny_gpt
from lightning_megatron.data.corpus import synthetic_tokens
from tests.conftest import run_here, run_workers

EXPERTS, TOPK = 4, 2


def _moe(**kwargs: object) -> MegatronLMModule:
    config = tiny_gpt(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_enable_routing_replay=True)
    return MegatronLMModule(config, lr=3e-3, decay_steps=4, **kwargs)


def _trainer(steps: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip


class UsedRouting(L.Callback):
    """Captures the experts each router actually used (its routing map), independent of the replay machinery."""

    def __init__(self) -> None:
        self.maps: list[torch.Tensor] = []
        self.handles: list = []

    def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        from megatron.core.transformer.moe.router import TopKRouter

        for module in pl_module.modules():
            if isinstance(module, TopKRouter):
                self.handles.append(module.register_forward_hook(lambda m, i, out: self.maps.append(out[1].detach())))


def test_replayed_routing_is_used_and_reproduces_the_recorded_loss() -> None:
    tokens = synthetic_tokens(4, 32, 256, seed=6)
    seen: dict = {}

    class Record(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            seen["routing"] = pl_module.record_routing(tokens)
            seen["loss"] = float(trainer.strategy.forward_loss(tokens)["loss"])  # the router's own choice
            shifted = (seen["routing"] + 1) % EXPERTS
            seen["shifted"] = shifted
            seen["shifted_loss"] = float(
                trainer.strategy.forward_loss({"input_ids": tokens, "routing": shifted})["loss"]
            )

    module = _moe()
    _trainer(1, [Record()]).fit(module, DataLoader(tokens, batch_size=4))
    routing = seen["routing"]
    assert routing.shape == (4, 4, 32, TOPK)
    assert routing.min() >= 0
    assert routing.max() < EXPERTS
    assert seen["shifted_loss"] != seen["loss"]  # another routing gives another loss: replay is effective

    # A training step whose batch carries the recorded routing computes exactly the recorded forward's loss, and
    # the routers use exactly the fed experts.
    losses: list[float] = []
    used = UsedRouting()

    class Loss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    items = [{"input_ids": tokens[i], "routing": seen["shifted"][i]} for i in range(4)]
    _trainer(2, [Loss(), used]).fit(module, DataLoader(items, batch_size=4))
    assert losses[0] == pytest.approx(seen["shifted_loss"], rel=1e-6)
    fed = seen["shifted"]
    # Micro-batch order may be shuffled by Lightning's sampler: compare per layer the set of routed (token, expert).
    maps = used.maps[: 2 * 4]  # first step: 2 micro-batches x 4 MoE layers
    for routing_map in maps:
        assert int(routing_map.sum()) == 2 * 32 * TOPK  # each token of the micro-batch routed to TOPK experts
    assert {tuple(sorted(row.nonzero().flatten().tolist())) for m in maps for row in m} <= {
        tuple(sorted(fed[b, layer, s].tolist())) for b in range(4) for layer in range(4) for s in range(32)
    }


def test_routing_replay_errors() -> None:
    with pytest.raises(ValueError, match=r"moe_enable_routing_replay=True .*dense model"):
        tiny_gpt(moe_enable_routing_replay=True)
    with pytest.raises(ValueError, match=r"record_routing needs"):
        MegatronLMModule(tiny_gpt(num_moe_experts=4)).record_routing(torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sequence_parallel=True"):
        tiny_gpt(num_moe_experts=4, moe_enable_routing_replay=True).validate_parallel(
            ParallelSizes(tp=2, sequence_parallel=True)
        )


@pytest.mark.multiprocess
def test_recorded_routing_is_the_same_with_pipeline_and_expert_parallelism(tmp_path: Path) -> None:
    """Each pipeline stage records its own layers; every rank returns the whole [B, L, S, K] routing."""
    moe = {"model": {"num_moe_experts": EXPERTS, "moe_router_topk": TOPK, "moe_enable_routing_replay": True}}
    ckpt = tmp_path / "ckpt"
    # One process trains 2 steps (checkpointing them) and records the routing with those weights.
    train = {"max_steps": 2, "ckpt_dir": str(ckpt), "ckpt_every": 2, "routing_out": str(tmp_path / "one")}
    run_here({**moe, "devices": 1, "limit_val_batches": 1, **train}, tmp_path)
    args = {**moe, "mode": "routing", "limit_val_batches": 1, "resume": str(ckpt / "epoch=0-step=2.ckpt")}
    one = torch.load(tmp_path / "one.rank0.pt")
    assert one.shape == (8, 4, 32, TOPK)
    # The PP=2 and the EP=2 runs are independent: launched side by side.
    layouts = {"pp2": {"pp": 2}, "ep2": {"ep": 2}}
    runs = [{**args, "devices": 2, **layout, "pred_out": str(tmp_path / name)} for name, layout in layouts.items()]
    results = run_workers(runs, tmp_path)
    assert [result["routing_sizes"] for result in results] == [{"pp": 2, "ep": 1}, {"pp": 1, "ep": 2}]
    for name in layouts:
        for rank in range(2):
            assert torch.equal(torch.load(tmp_path / f"{name}.rank{rank}.pt"), one), name


def test_routing_replay_on_packed_rows() -> None:
    """Packed rows (documents with their own positions) record and replay routing like plain rows."""
    from lightning_megatron import pack_sequences

    flat = synthetic_tokens(8, 32, 256, seed=8).flatten()
    lengths = [5, 11, 16, 7, 9, 14, 3, 12, 20, 6, 13, 8]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = pack_sequences([flat[s : s + n] for s, n in zip(starts, lengths, strict=True)], 32)[:4]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    assert (batch["position_ids"] == 0).sum() > 4  # several documents per row
    config = tiny_gpt(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_enable_routing_replay=True, kernels="torch")
    module = MegatronLMModule(config, lr=3e-3, decay_steps=4)
    seen: dict = {}

    class Record(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            shifted = (pl_module.record_routing(batch) + 1) % EXPERTS
            seen["shifted"] = shifted
            seen["own"] = float(trainer.strategy.forward_loss(batch)["loss"])
            seen["replayed"] = float(trainer.strategy.forward_loss({**batch, "routing": shifted})["loss"])

    _trainer(1, [Record()]).fit(module, DataLoader(rows, batch_size=4))
    assert seen["replayed"] != seen["own"]
    losses: list[float] = []

    class Loss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            losses.append(float(outputs["loss"]))

    items = [{**row, "routing": seen["shifted"][i]} for i, row in enumerate(rows)]
    _trainer(1, [Loss()]).fit(module, DataLoader(items, batch_size=4, shuffle=False))
    assert losses[0] == pytest.approx(seen["replayed"], rel=1e-6)
