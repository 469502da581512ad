"""The Hugging Face MoE models of ``tests/hf_moe_models.py`` at EP=2, TP=2 and PP=2, from the shared two-process
launch (``tests/conftest.py``: ``moe_layouts``, once per session): validation loss, logits and log-probs equal
``transformers`` and the export is the HF checkpoint (an MXFP4 GPT-OSS at EP=2 too, against its dequantized
weights); LoRA on the experts at EP=2 and TP=2 and full training at TP=2 with sequence parallelism equal one process
(run here) or ``transformers`` + AdamW.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf_moe_models import ADAMW, LAYOUTS, SEQ, hf_adamw_steps, hf_forward, hf_model, hf_per_document


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name, job in LAYOUTS.items() if "train_steps" not in job])
def test_layouts_match_transformers(name: str, moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor) -> None:
    """Validation loss, logits and log-probs equal transformers' on every rank, and the export (experts gathered
    from their expert-parallel ranks, shards from their tensor-parallel ones) is the HF checkpoint; for an MXFP4
    source, transformers runs on the dequantized weights, which the float export equals exactly."""
    job = LAYOUTS[name]
    arch, data_parallel = job["arch"], 2 // (job.get("tp", 1) * job.get("pp", 1) * job.get("cp", 1))
    reference = moe_layouts[name]["reference"]
    weights = load_file(reference / "model.safetensors")
    if job.get("mxfp4"):  # the MXFP4 values differ from the float source's: the comparison tells them apart
        gate_up = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.allclose(weights[gate_up], load_file(moe_models[arch] / "model.safetensors")[gate_up])
    logits, loss, logprobs = hf_forward(reference, hf_tokens)
    shapes = {n: list(t.shape) for n, t in weights.items()}
    for rank, result in enumerate(moe_layouts[name]["ranks"]):
        rows = slice(rank % data_parallel, None, data_parallel)  # the distributed sampler's rows of this DP rank
        assert result["val_loss"] == pytest.approx(loss, rel=1e-5), rank
        torch.testing.assert_close(moe_layouts[name]["logits"][rank], logits[rows], rtol=1e-4, atol=1e-4)
        got = torch.tensor(result["logprobs"])[:, : SEQ - 1]
        torch.testing.assert_close(got, logprobs[rows], rtol=1e-4, atol=1e-5)
        tied = {"lm_head.weight"} if arch == "qwen2_moe" else set()
        assert {n: s for n, s in result["export_shapes"].items() if n not in tied} == shapes
        assert result["export_max_diff"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name, job in LAYOUTS.items() if job.get("packed")])
def test_packed_rows_match_each_document_alone(name: str, moe_layouts: dict, moe_models: dict) -> None:
    """Packed rows (documents of 3-13 tokens) at the job's layout: the validation loss and log-probs of transformers
    run on each document alone, on every rank."""
    want_loss, want_logprobs = hf_per_document(moe_models[LAYOUTS[name]["arch"]])
    for rank, result in enumerate(moe_layouts[name]["ranks"]):
        assert result["packed_val_loss"] == pytest.approx(want_loss, rel=1e-5), rank
        torch.testing.assert_close(torch.tensor(result["packed_logprobs"]), want_logprobs, rtol=1e-4, atol=1e-5)


def _trained_as_one_process(layout: dict, one: dict, one_logits: torch.Tensor, data_parallel: int) -> None:
    """Every rank of a two-process LoRA layout trained as ``one`` process did: the same three distinct losses and
    validation loss, only the adapters trainable, and its data-parallel rank's rows of the logits."""
    assert len(set(one["train_losses"])) == 3
    for rank, result in enumerate(layout["ranks"]):
        assert result["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5), rank
        assert result["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), rank
        assert result["trainable"] == ["lora_A", "lora_B"]
        rows = slice(rank % data_parallel, None, data_parallel)  # DP=1: every row
        torch.testing.assert_close(layout["logits"][rank], one_logits[rows], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
def test_mla_moe_trains_at_tp2_with_sp_as_transformers_and_adamw(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor
) -> None:
    """DeepSeek-V3 (MLA with a query latent, a dense layer, experts with a shared one) trains three steps at TP=2 with
    sequence parallelism as transformers + AdamW does, and its validation loss after them is the trained HF model's:
    every head's share of the RoPE key's gradient counts, not only the heads of the rank holding its columns."""
    samples = torch.randint(0, 128, (4 * 3, SEQ), generator=torch.Generator().manual_seed(0))  # hf_worker's rows
    want, model = hf_adamw_steps(moe_models["deepseek_v3"], samples, ADAMW)
    with torch.no_grad():
        trained_loss = float(model.eval()(input_ids=hf_tokens, labels=hf_tokens).loss)
    assert len(set(want)) == 3
    for rank, result in enumerate(moe_layouts["deepseek_v3_tp2_train"]["ranks"]):
        assert result["train_losses"] == pytest.approx(want, rel=1e-4), rank
        assert result["val_loss"] == pytest.approx(trained_loss, rel=1e-4), rank


@pytest.mark.multiprocess
def test_lora_on_experts_at_ep2_equals_one_process(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor, tmp_path: Path
) -> None:
    """LoRA on every linear of an MoE model, experts split over two ranks, trains as one process does; only the
    adapters change; the merged export loads in transformers with the trained model's logits."""
    import hf_worker

    # One process takes both ranks' batches at once: the same global batches (Lightning's sampler deals the same
    # shuffled order to one rank in batches of 8 as to two in batches of 4).
    job = {**LAYOUTS["qwen2_moe_ep2_lora"], "ep": 1, "batch_size": 8, "model": str(moe_models["qwen2_moe"]),
           "save": str(tmp_path / "one")}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, hf_tokens, [])
    ep2 = moe_layouts["qwen2_moe_ep2_lora"]
    _trained_as_one_process(ep2, one, one_logits, data_parallel=2)
    merged = hf_forward(ep2["save"], hf_tokens)[0]  # the adapters merged into the experts' and the others' weights
    torch.testing.assert_close(merged, one_logits, rtol=1e-4, atol=1e-4)
    base = hf_forward(moe_models["qwen2_moe"], hf_tokens)[0]
    assert not torch.allclose(merged, base, atol=1e-3)  # the adapters moved the logits
    assert all(result["buckets"]["equal"] for result in ep2["ranks"])  # bucketed = per tensor, experts gathered


@pytest.mark.multiprocess
def test_a_peft_adapter_of_experts_at_ep2_gives_the_merged_logits(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor
) -> None:
    """Expert adapters trained with the experts split over two ranks: the PEFT adapter (each expert's pieces joined
    from its rank) on the untouched HF base gives the logits of the merged export, as do the bucketed exports."""
    import peft

    ep2 = moe_layouts["mixtral_ep2_lora"]
    merged = hf_forward(ep2["save"], hf_tokens)[0]
    for rank, rank_logits in enumerate(ep2["logits"]):  # EP=2 with DP=2: each rank predicts its sampler's rows
        torch.testing.assert_close(rank_logits, merged[rank::2], rtol=1e-4, atol=1e-4)
    adapter = load_file(Path(f"{ep2['save']}-adapter") / "adapter_model.safetensors")
    assert any("experts.base_layer.lora_B" in name for name in adapter)  # the experts' fused gate_up adapters
    base = hf_model(moe_models["mixtral"])
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, f"{ep2['save']}-adapter").eval()(input_ids=hf_tokens).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, hf_forward(moe_models["mixtral"], hf_tokens)[0], atol=1e-3)  # the adapters moved
    assert all(result["buckets"]["equal"] for result in ep2["ranks"])


@pytest.mark.multiprocess
def test_lora_on_experts_at_tp2_equals_one_process(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor, tmp_path: Path
) -> None:
    """LoRA on every linear of an MoE model, the experts split over expert tensor parallelism (TP=2 with SP: fc1's B
    split by rows, [gate; up] half by half, fc2's A by columns), trains as one process does; the merged export and
    the PEFT adapter equal one process's; its checkpoint at step 2 resumes at TP=1 to the same step 3."""
    import hf_worker

    job = {**LAYOUTS["mixtral_tp2_lora"], "tp": 1, "sp": False, "model": str(moe_models["mixtral"]),
           "save": str(tmp_path / "one"), "ckpt": None}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, hf_tokens, [])
    tp2 = moe_layouts["mixtral_tp2_lora"]
    _trained_as_one_process(tp2, one, one_logits, data_parallel=1)
    assert all(result["buckets"]["equal"] for result in tp2["ranks"])  # bucketed = per tensor, gathered over TP
    torch.testing.assert_close(hf_forward(tp2["save"], hf_tokens)[0], one_logits, rtol=1e-4, atol=1e-4)  # merged
    ours, theirs = (
        load_file(Path(f"{path}-adapter") / "adapter_model.safetensors") for path in (tp2["save"], job["save"])
    )
    assert ours.keys() == theirs.keys()
    assert any("experts.base_layer.lora_B" in name for name in ours)  # the experts' fused gate_up adapters
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    resumed, _ = hf_worker.run_job(1, {**job, "resume": str(Path(tp2["ckpt"]) / "epoch=0-step=2.ckpt"),
                                       "save": str(tmp_path / "resumed")}, hf_tokens, [])  # fmt: skip
    assert resumed["train_losses"] == pytest.approx(one["train_losses"][2:], rel=1e-5)


@pytest.mark.multiprocess
def test_lora_on_gpt_oss_experts_at_tp2_equals_one_process(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor, tmp_path: Path
) -> None:
    """LoRA on GPT-OSS (experts with biases, the clamped GLU, HF's interleaved gate/up columns) at TP=2 with SP: trains
    as one process does; the merged export and the PEFT adapter (fc1's B gathered over TP, then interleaved) equal
    one process's, and the merged export gives the logits in transformers."""
    import hf_worker

    job = {**LAYOUTS["gpt_oss_tp2_lora"], "tp": 1, "sp": False, "model": str(moe_models["gpt_oss"]),
           "save": str(tmp_path / "one")}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, hf_tokens, [])
    tp2 = moe_layouts["gpt_oss_tp2_lora"]
    _trained_as_one_process(tp2, one, one_logits, data_parallel=1)
    torch.testing.assert_close(hf_forward(tp2["save"], hf_tokens)[0], one_logits, rtol=1e-4, atol=1e-4)  # merged
    ours, theirs = (
        load_file(Path(f"{path}-adapter") / "adapter_model.safetensors") for path in (tp2["save"], job["save"])
    )
    assert ours.keys() == theirs.keys()
    assert any("experts.base_layer.lora_B" in name for name in ours)  # the experts' gate_up_proj adapters
    # fc1's A gets its gradient summed over TP in another order; where an element's gradient is near 0, AdamW's
    # step (lr 1e-2) turns that rounding into ~1e-5: 1e-4 (a missing or doubled gradient is off by ~1e-2).
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.multiprocess
def test_gpt_oss_trains_at_tp2_sp_as_one_process(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor, tmp_path: Path
) -> None:
    """GPT-OSS fully trained at TP=2 with SP -- the experts split over expert tensor parallelism: fc1's bias split
    like its rows (gate and up halves), fc2's whole on each rank and added once; the sinks split by heads -- follows
    one process: the losses, every parameter's gradient norm at every step on every rank (a replicated one's from
    that rank's copy: fc2's bias gets its gradient on both ranks), the validation loss and logits, which the trained
    export gives in transformers; its checkpoint at step 2 resumes at TP=1 to the same step 3."""
    import hf_worker

    job = {**LAYOUTS["gpt_oss_tp2_sp_trained"], "tp": 1, "sp": False, "model": str(moe_models["gpt_oss"]),
           "save": str(tmp_path / "one"), "ckpt": None}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, hf_tokens, [])
    tp2 = moe_layouts["gpt_oss_tp2_sp_trained"]
    assert len(set(one["train_losses"])) == 3
    biases = {name.rsplit("mlp.")[-1] for name in one["grad_norms"][0]}
    assert {"experts.linear_fc1.bias", "experts.linear_fc2.bias"} <= biases  # the expert biases' norms are compared
    for rank, result in enumerate(tp2["ranks"]):
        assert result["train_losses"] == pytest.approx(one["train_losses"], rel=1e-5), rank
        assert result["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), rank
        assert len(result["grad_norms"]) == 3
        # Summed in another order, and AdamW moves small gradients by the full step: 1e-3 (a gradient missing on a
        # rank, or counted twice, is off by 100%).
        for got, want in zip(result["grad_norms"], one["grad_norms"], strict=True):
            assert got == pytest.approx(want, rel=1e-3), rank
        torch.testing.assert_close(tp2["logits"][rank], one_logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(hf_forward(tp2["save"], hf_tokens)[0], one_logits, rtol=1e-3, atol=1e-3)  # the export
    resumed, _ = hf_worker.run_job(1, {**job, "resume": str(Path(tp2["ckpt"]) / "epoch=0-step=2.ckpt"),
                                       "save": str(tmp_path / "resumed")}, hf_tokens, [])  # fmt: skip
    assert resumed["train_losses"] == pytest.approx(one["train_losses"][2:], rel=1e-5)


@pytest.mark.multiprocess
def test_lora_on_gpt_oss_experts_at_ep2_equals_one_process(
    moe_layouts: dict, moe_models: dict, hf_tokens: torch.Tensor, tmp_path: Path
) -> None:
    """LoRA on GPT-OSS's experts split over two expert-parallel ranks (two experts and their adapters each, DP=2)
    trains as one process taking both ranks' batches does; the merged export and the PEFT adapter (each expert's
    adapters from its rank) equal one process's, and the merged export gives the logits in transformers."""
    import hf_worker

    job = {**LAYOUTS["gpt_oss_ep2_lora"], "ep": 1, "batch_size": 8, "model": str(moe_models["gpt_oss"]),
           "save": str(tmp_path / "one")}  # fmt: skip
    one, one_logits = hf_worker.run_job(1, job, hf_tokens, [])
    ep2 = moe_layouts["gpt_oss_ep2_lora"]
    _trained_as_one_process(ep2, one, one_logits, data_parallel=2)
    assert all(result["buckets"]["equal"] for result in ep2["ranks"])  # bucketed = per tensor, experts gathered
    merged = hf_forward(ep2["save"], hf_tokens)[0]
    torch.testing.assert_close(merged, one_logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, hf_forward(moe_models["gpt_oss"], hf_tokens)[0], atol=1e-3)  # adapters moved
    ours, theirs = (
        load_file(Path(f"{path}-adapter") / "adapter_model.safetensors") for path in (ep2["save"], job["save"])
    )
    assert ours.keys() == theirs.keys()
    assert any("experts.base_layer.lora_B" in name for name in ours)  # the experts' gate_up_proj adapters
    # The data-parallel mean of the gradients is summed in another order than one process's; AdamW (lr 1e-2, eps 1e-8)
    # turns that rounding into up to ~6e-5 where an element's gradient is near eps: 1e-4 (an adapter taken from the
    # wrong expert, or a rank's share of a gradient missing, is off by ~1e-2).
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-4, msg=name)
