"""The dense Hugging Face models of ``tests/hf_dense_models.py`` (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Gemma 2)
at TP=2 and PP=2 (Llama with PP=2 x VPP=2, with packed rows at TP=2, CP=2 and PP=2 x VPP=2), and at TP=2 x PP=2 for
Qwen3 and Llama (VPP=2), in one 2-process and one 4-process worker run (``tests/hf_worker.py``): validation loss and
logits equal ``transformers`` in float32 with eager attention on every rank, and the export is the HF checkpoint;
training at TP=2 saves what ``transformers`` loads; LoRA on the HF weights at TP=2 + SP and PP=2 follows one process
(run here) and exports merged weights and a PEFT adapter; a PEFT adapter at TP=2 gives PEFT's logits.
The same models at one process: ``tests/test_hf.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import child_env, run_forked
from tests.hf_dense_models import (
    JOBS,
    hf_forward,
    hf_state_shapes,
    layout_results,
    layout_runs,
    lora_one_process,
    make_peft_adapter,
    total_elements,
)
from tests.hf_moe_models import hf_per_document


@pytest.fixture(scope="module")
def multi(hf_models: dict[str, Path], hf_tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every job: one 2-process and one 4-process worker run (after the one-process LoRA run they resume from)."""
    tmp = tmp_path_factory.mktemp("multi")
    make_peft_adapter(hf_models["llama"], tmp / "peft-adapter")
    results = {"lora_one_process": lora_one_process(hf_models["llama"], hf_tokens, tmp / "lora")}
    runs = layout_runs(hf_models, hf_tokens, tmp)
    for args in runs:  # one after the other: the 4-process run alone fills CI's two cores
        devices = args["devices"]
        expect = Path(f"{args['out']}.rank{devices - 1}.json")
        run_forked("hf_worker:main", args, devices, tmp, child_env(CUDA_VISIBLE_DEVICES=""), expect=expect)
    return {**results, **layout_results(runs)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in JOBS if "trained" not in n and "adapter" not in n])
def test_tp_pp_match_transformers(name: str, multi: dict, hf_models: dict, hf_tokens: torch.Tensor) -> None:
    job = JOBS[name]
    logits, loss = hf_forward(hf_models[job["arch"]], hf_tokens)
    want = hf_state_shapes(hf_models[job["arch"]])
    shards = job.get("tp", 1) * job.get("pp", 1)
    for got in multi[name]["ranks"]:  # the same loss on every rank
        assert got["val_loss"] == pytest.approx(loss, rel=1e-5)
        # Exported during validation: the source tensors exactly, with HF's names and shapes, on every rank.
        assert got["export_max_diff"] == 0.0
        assert {k: tuple(v) for k, v in got["export_shapes"].items()} == want
        # No rank reads the whole model, only about 1/(tp*pp) of it: its slice of each matrix and its stage's
        # layers (plus replicated norms; with tied embeddings the first and the last stage both read the embedding).
        assert 0.8 / shards < got["elements_read"] / total_elements(hf_models[job["arch"]]) < 1.2 / shards
    for rank_logits in multi[name]["logits"]:  # full-vocabulary logits on every rank
        torch.testing.assert_close(rank_logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n, job in JOBS.items() if job.get("packed")])
def test_packed_rows_at_tp_pp_cp_match_each_document_alone(name: str, multi: dict, hf_models: dict) -> None:
    want_loss, want_logprobs = hf_per_document(hf_models[JOBS[name]["arch"]])
    for got in multi[name]["ranks"]:  # on every rank
        assert got["packed_val_loss"] == pytest.approx(want_loss, rel=1e-5)
        torch.testing.assert_close(torch.tensor(got["packed_logprobs"]), want_logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
def test_train_at_tp2_save_and_load_in_transformers(multi: dict, hf_models: dict, hf_tokens: torch.Tensor) -> None:
    got = multi["llama_tp2_trained"]
    saved = got["save"]
    assert (saved / "model.safetensors.index.json").is_file()  # small shards in this test: the index is written
    logits, loss = hf_forward(saved, hf_tokens)
    assert loss != pytest.approx(hf_forward(hf_models["llama"], hf_tokens)[1], rel=1e-3)  # the weights did change
    for rank in range(2):
        assert got["ranks"][rank]["val_loss"] == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(got["logits"][rank], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
def test_lora_at_tp2_sp_and_pp2_follows_one_process(multi: dict) -> None:
    """LoRA from the same HF weights and seed: the 1-process curve at TP=2 + SP and at PP=2 (adapters sharded as
    the base, the base frozen), the same validation loss and logits after training; the 1-process adapter-only
    checkpoint of step 2 resumed at TP=2 continues the curve."""
    one = multi["lora_one_process"]
    assert len(set(one["train"])) == 3  # the adapters move (random tokens: the loss need not fall)
    for name in ("llama_tp2_sp_lora_trained", "llama_pp2_lora_trained", "llama_tp2_lora_resumed_trained"):
        steps = slice(2, None) if "resumed" in name else slice(None)
        for rank, got in enumerate(multi[name]["ranks"]):
            assert got["trainable"] == ["lora_A", "lora_B"], (name, rank)
            assert got["train_losses"] == pytest.approx(one["train"][steps], rel=2e-4), (name, rank)
            assert got["val_loss"] == pytest.approx(one["val_loss"], rel=2e-4), (name, rank)
        for rank_logits in multi[name]["logits"]:
            torch.testing.assert_close(rank_logits, one["logits"], rtol=1e-3, atol=1e-3)


@pytest.mark.multiprocess
def test_lora_at_tp2_and_pp2_exports_merged_weights_and_a_peft_adapter(
    multi: dict, hf_models: dict, hf_tokens: torch.Tensor
) -> None:
    """The adapters trained at TP=2 + SP (and at PP=2): ``peft`` loads the adapter onto the untouched base with
    the logits of the merged export, which ``transformers`` loads with the module's own logits; bucketed exports
    (one gather / broadcast per bucket) equal the per-tensor one."""
    import peft

    for name in ("llama_tp2_sp_lora_trained", "llama_pp2_lora_trained"):
        got = multi[name]
        merged, _ = hf_forward(got["save"], hf_tokens)
        for rank_logits in got["logits"]:
            torch.testing.assert_close(rank_logits, merged, rtol=1e-4, atol=1e-4)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32,
                                                                 attn_implementation="eager")  # fmt: skip
        with torch.no_grad():
            adapted = peft.PeftModel.from_pretrained(base, f"{got['save']}-adapter").eval()(input_ids=hf_tokens).logits
        torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
        for rank in got["ranks"]:
            buckets = rank["buckets"]
            assert buckets["equal"], (name, buckets)
            assert buckets["count"] < buckets["tensors"] / 3, (name, buckets)
            assert max(buckets["bytes"]) <= 100_000, (name, buckets)


@pytest.mark.multiprocess
def test_a_peft_adapter_at_tp2_gives_peft_logits(multi: dict, hf_models: dict, hf_tokens: torch.Tensor) -> None:
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32,
                                                             attn_implementation="eager")  # fmt: skip
    adapter = multi["llama_tp2_peft_adapter"]["save"].parent / "peft-adapter"
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=hf_tokens).logits
    for rank_logits in multi["llama_tp2_peft_adapter"]["logits"]:
        torch.testing.assert_close(rank_logits, want, rtol=1e-4, atol=1e-4)
