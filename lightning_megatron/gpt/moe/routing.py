"""MoE routing replay on top of Megatron-Core's ``RouterReplay``: record a forward pass's top-k expert choices, or
make a forward pass use given ones (recorded at rollout, by us or by an inference engine).

Routing travels as a batch entry ``routing``: a LongTensor [B, num_layers, S, topk] of expert indices per sample,
(global) layer and token. Dense layers' rows are ignored. Megatron's routers see the tokens of a micro-batch in
``[S, B]`` order, flattened; the helpers below convert between the two layouts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn


def routers(chunk: nn.Module) -> Iterator[tuple[int, object]]:
    """(global 0-based layer index, RouterReplay) for every MoE router in a model chunk (wrapped or not)."""
    for module in chunk.modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None:
            yield module.layer_number - 1, replay


def replay(chunk: nn.Module, routing: Tensor) -> None:
    """Make this chunk's next forward use ``routing`` [B, L, S, K] instead of the routers' own top-k."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, replay_state in routers(chunk):
        replay_state.clear_indices()
        per_token = routing[:, layer].transpose(0, 1).reshape(-1, routing.shape[-1])  # [B, S, K] -> [S*B, K]
        replay_state.set_target_indices(per_token)
        replay_state.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def start_recording(chunk: nn.Module) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, replay_state in routers(chunk):
        replay_state.clear_indices()
        replay_state.set_router_replay_action(RouterReplayAction.RECORD)


def recorded(chunk: nn.Module, batch_size: int, seq_length: int) -> dict[int, Tensor]:
    """What the last forward of this chunk routed: {layer: [B, S, K]}."""
    out = {}
    for layer, replay_state in routers(chunk):
        indices = replay_state.get_recorded_indices()  # [S*B, K]
        out[layer] = indices.reshape(seq_length, batch_size, -1).transpose(0, 1)  # -> [B, S, K]
    return out


def route_normally(chunk: nn.Module) -> None:
    for _, replay_state in routers(chunk):
        replay_state.clear_indices()
        replay_state.clear_router_replay_action()


def assemble(
    parts: list[tuple[int, dict[int, Tensor]]],
    batch_size: int,
    num_layers: int,
    seq_length: int,
    topk: int,
    device: torch.device,
) -> Tensor:
    """[B, L, S, K] from (first sample, {layer: [b, S, K]}) parts, then summed over pipeline stages (each holds
    some layers; the others' rows are zero) so every rank returns the whole routing."""
    from megatron.core import parallel_state

    routing = torch.zeros(batch_size, num_layers, seq_length, topk, dtype=torch.long, device=device)
    for start, layers in parts:
        for layer, indices in layers.items():
            routing[start : start + indices.shape[0], layer] = indices
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(routing, group=parallel_state.get_pipeline_model_parallel_group())
    return routing
