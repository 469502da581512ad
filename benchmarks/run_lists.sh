#!/bin/bash
# Run lists for GPUs, one section per device call (each within the device tool's 600 s per command; the times are
# estimates from earlier one-GPU runs unless a date says when they were measured):
#
#   bash benchmarks/run_lists.sh SECTION        # JSON lines appended to $OUT/SECTION.jsonl ($OUT: ./out)
#
# One GPU (nvidia-h200):
#   versus_hf (a) against (c) HF Llama + Lightning and (d) HF Llama + FSDP2 + compile at 3B and 125M (the 1B shape
#             is measured); (c) at 3B takes 4 sequences a step (8 ran out of memory) (479 s on 2026-12-03)
#   onegpu    the fp8 gradient GPU test on the real GPU path (it ran in CPU mode until 2026-12-03; 24 s), then 125M
#             eager a,b,a,b with the garbage collections of the timed steps in each JSON line (the 125M gap) (196 s
#             on 2026-12-03)
#   stock     1B: stock Megatron-Core's local spec (b0) beside (b) and (a) in one run, then the one-GPU fp8 and CUDA
#             graph tests (the weight-cast cache under graphs) (~6 min)
#   moe       the dense 1B shape, the ~1B-active MoE (moe1b) and Qwen3-30B-A3B's layers (qwen3moe: 8 layers on an
#             H200, 4 on an H100's 80 GB) in one call, variant a (~5 min)
#   moe_tests the grouped-expert GPU tests, then the expert MLP alone (benchmarks/moe_experts.py) (~2 min)
#   checkpoint  1B: three sync and three async saves with their timelines, Megatron's optimizer-state build beside
#             ours, resumes from the disk and from the page cache read by 1 and by 8 threads, the disk's own
#             speed (checkpoints under ./ckbench, ~40 GB at most; ~7 min)
#   checkpoint_lean  the same with CheckpointConfig(save_model_weights=False) (no bf16 weights; ~6 min)
#   ema       1B, variant a without and with MegatronEMA(decay=0.999) updated every step, in turn, twice (~6 min)
#   headline  the README's headline rows from the checked-out (clean) commit: 1B variants a,b,a,b, then fp8 e4m3 with
#             CUDA graphs against bf16 with CUDA graphs (~7 min)
#   ema_update  the EMA update alone (eager, compiled, offloaded) and the GPU weight-averaging tests (~2 min)
#   mla       the GPU tests of the attention variants (FlexAttention windows, sinks, soft-capping against the
#             reference, also at a CP rank) and of MLA (its core attention against float64, also at a CP rank, the
#             fused RoPE against the unfused path), then moe1b beside mla_moe1b (the same MoE with DeepSeek-V3's
#             Multi-Latent Attention), then mla_moe1b again under torch.profiler (its kernel table in $OUT), variant
#             a (~6 min)
#   moe_families  moe1b beside dsv3_1b (a DeepSeek-V3-like stack: MLA, 64 experts top-6 + 2 shared; 8 layers on an
#             H200, 5 on an H100: 16 ran out of an H100's memory on 2026-12-07) and moe1b cut to the same layers,
#             variant a (~5 min; the GPT-OSS-like gptoss1b: section gptoss)
#   moe_ab    the MoE permutation's GPU test, then SHAPE (default moe1b; e.g. mla_moe1b) at BASE (a git revision,
#             default HEAD~1, checked out beside the tree) against the checked-out commit, in turn, twice: one
#             change's effect in one run (~6 min)
#   variants  the attention kernels alone (benchmarks/attention.py: MLA against GQA, a 1024-token window against
#             full causal attention, sinks against none and two candidates for them; PARTS=b,c leaves out part
#             a's ten MLA/GQA cases: on an H100 on 2026-12-07 part a and part b at 8K alone took 200 s), then the 1B
#             shape at 16K tokens all-full against Gemma 3's 5:1 windowed layers (window 1024), variant a (the two
#             16K runs need ~5 min together: give them the call's remaining time; ~8 min)
#   gptoss    moe1b beside gptoss1b (a GPT-OSS-like MoE: window-128/full layers, sinks, biases, clamped GLU, 32
#             experts top-4), then gptoss1b under torch.profiler (its kernel table in $OUT): where its step goes
#             (0.51x moe1b's tokens/s on 2026-12-07 on an H100), variant a (~5 min)
# Two GPUs (nvidia-h200-x2):
#   moe_ep2   the ~1B-active MoE at EP=2 and at DP=2 (the experts replicated), variant a (~3 min)
#   scaling2  1B, variants a and b: one GPU, DP=2, TP=2+SP, PP=2+VPP=2 (8 runs, ~7 min)
#   cp2       1B at 32K tokens per sequence: one GPU against CP=2 (first_losses: the same initial weights and
#             batches, so they should agree), and packed 32K rows at CP=2 against one GPU (the one-GPU runs took
#             95 s and 79 s on one H200 on 2026-12-03; ~6 min)
#   cp2long   1B at 64K tokens per sequence, one GPU against CP=2, both without recompute (one GPU: 97.5 GiB, 52.2%
#             MFU on 2026-12-03) (~4 min; apart from cp2: the two together would pass the 600 s of one device call)
#   fp8tp2    1B at TP=2: bf16 eager against fp8 "e4m3" with CUDA graphs (~2 min)
#   tests2    the two-GPU tier-2 tests (layouts over NCCL, CP=2 among them); the one-GPU ones: pytest -m gpu on a
#             one-GPU machine, one test file per process
# Four GPUs (nvidia-h200-x4):
#   scaling4  3B, variants a and b: TP=2 x PP=2 and TP=2 x DP=2 (4 runs, ~5 min)
#   cp4       1B: CP=4 at 128K tokens, CP=2 at 128K on two of the GPUs with full recompute (only for its
#             first_losses against CP=4: 64K tokens per GPU took 97.5 GiB on one GPU without recompute, and CP adds
#             the all-gathered 128K keys and values), CP=2 x TP=2+SP at 64K (~7 min)
#   tests4    the four-GPU tier-2 tests (TP=2 x PP=2, TP=2+SP x CP=2, the TP=2 x PP=2 checkpoint resumed at DP=4
#             and on CPU)
set -uo pipefail
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on the multi-GPU kinds (the device tool's KINDS.md)
section=${1:?"usage: bash benchmarks/run_lists.sh SECTION (see the header)"}
out=${OUT:-out}
mkdir -p "$out"
log="$out/$section.jsonl"

tp() { timeout 300 python3 benchmarks/throughput.py "$@" | tee -a "$log"; }
packing() { timeout 300 python3 benchmarks/packing.py --mode packed "$@" | tee -a "$log"; }

case "$section" in
versus_hf)
    tp --shape 3b --micro-batch-size 2 --micro-batches 4 --variants a,d
    tp --shape 3b --micro-batch-size 1 --micro-batches 4 --variants a,c
    tp --shape 125m --variants a,c,d --cuda-graphs
    ;;
headline)
    tp --variants a,b,a,b
    tp --variants a --cuda-graphs
    tp --variants a --fp8 e4m3 --cuda-graphs
    ;;
ema_update)
    timeout 100 python3 benchmarks/ema_update.py | tee -a "$log"
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_weight_averaging.py >"$out/$section.log" 2>&1
    tail -3 "$out/$section.log"
    ;;
mla)
    for file in tests/test_attention_variants.py tests/test_mla.py; do  # one process per file (their Megatron states)
        timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider "$file" >>"$out/$section.log" 2>&1
    done
    grep -E "passed|failed|error" "$out/$section.log"
    tp --shape moe1b --variants a
    tp --shape mla_moe1b --variants a
    # where MLA's step goes: three more steps under torch.profiler, the kernel table in $out (not timed)
    tp --shape mla_moe1b --variants a --warmup 3 --steps 3 --profile "$out/mla_moe1b_kernels" >/dev/null
    ;;
moe_families)
    tp --shape moe1b --variants a
    # 16 layers of 64 experts (about 9B parameters) outgrow one GPU's optimizer state: 8 layers on an H200, 5 on an H100
    layers=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? 8 : 5}')
    tp --shape dsv3_1b --num-layers "$layers" --variants a
    tp --shape moe1b --num-layers "$layers" --variants a  # the same depth: the LM head's share of the step alike
    ;;
moe_ab)
    timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_permute.py >"$out/$section.log" 2>&1
    tail -3 "$out/$section.log"
    base=/tmp/ab_base
    rm -rf "$base" && git worktree prune && git worktree add -f --detach "$base" "${BASE:-HEAD~1}" >/dev/null
    for _ in 1 2; do
        (cd "$base" && timeout 300 python3 benchmarks/throughput.py --shape "${SHAPE:-moe1b}" --variants a) | tee -a "$log"
        tp --shape "${SHAPE:-moe1b}" --variants a
    done
    ;;
variants)
    timeout 240 python3 benchmarks/attention.py --parts "${PARTS:-a,b,c}" --iters 10 --warmup 3 2>"$out/$section.log" \
        | tee -a "$log"
    grep -E "Error|Traceback" "$out/$section.log" | tail -3  # the script's own failure (each case's: in its row)
    long=(--shape 1b --variants a --seq-length 16384 --micro-batch-size 1 --micro-batches 2)
    tp "${long[@]}"
    tp "${long[@]}" --window 1024 --window-every 6
    ;;
gptoss)
    tp --shape moe1b --variants a
    tp --shape gptoss1b --variants a
    tp --shape gptoss1b --variants a --warmup 3 --steps 3 --profile "$out/gptoss1b_kernels" >/dev/null
    ;;
ema)
    for _ in 1 2; do
        tp --variants a --steps 20
        tp --variants a --steps 20 --ema 0.999
    done
    ;;
onegpu)
    timeout 200 python3 -m pytest -m gpu -v -s -p no:cacheprovider --durations=5 tests/test_fp8.py -k gradients \
        >"$out/$section.log" 2>&1
    grep -E "fp8 GEMM|PASSED|FAILED|passed|failed" "$out/$section.log"
    tp --shape 125m --variants a,b,a,b
    ;;
stock)
    tp --shape 1b --variants b0,b,a
    for file in tests/test_fp8.py tests/test_cuda_graphs.py; do  # one process per file (their Megatron states)
        timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=5 "$file" >>"$out/$section.log" 2>&1
    done
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/$section.log"
    ;;
moe)
    layers=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? 8 : 4}')
    tp --shape 1b --variants a
    tp --shape moe1b --variants a
    tp --shape qwen3moe --num-layers "$layers" --variants a
    ;;
checkpoint)
    mkdir -p ckbench
    timeout 540 python3 benchmarks/checkpoint.py --out ckbench/run --commit "$(git rev-parse --short HEAD)" \
        --read-threads 1,8 2>"$out/$section.log" | tee -a "$log"
    rm -rf ckbench
    ;;
checkpoint_lean)
    mkdir -p ckbench
    timeout 540 python3 benchmarks/checkpoint.py --out ckbench/run --commit "$(git rev-parse --short HEAD)" \
        --no-model-weights 2>"$out/$section.log" | tee -a "$log"
    rm -rf ckbench
    ;;
moe_tests)
    timeout 150 python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_grouped_experts.py >"$out/$section.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/$section.log"
    timeout 120 python3 benchmarks/moe_experts.py | tee -a "$log"
    ;;
scaling2)
    tp --shape 1b --variants a,b
    tp --shape 1b --devices 2 --variants a,b
    tp --shape 1b --devices 2 --tp 2 --sp --variants a,b
    tp --shape 1b --devices 2 --pp 2 --vpp 2 --micro-batch-size 2 --micro-batches 16 --variants a,b
    ;;
moe_ep2)
    tp --shape moe1b --devices 2 --ep 2 --variants a
    tp --shape moe1b --devices 2 --variants a
    ;;
cp2)
    long=(--shape 1b --variants a --micro-batch-size 1 --micro-batches 2)
    tp "${long[@]}" --seq-length 32768
    tp "${long[@]}" --seq-length 32768 --devices 2 --cp 2
    packing --row-length 32768 --docs-per-step 16
    packing --row-length 32768 --docs-per-step 16 --cp 2
    ;;
cp2long)
    long=(--shape 1b --variants a --micro-batch-size 1 --micro-batches 2)
    tp "${long[@]}" --seq-length 65536
    tp "${long[@]}" --seq-length 65536 --devices 2 --cp 2
    ;;
fp8tp2)
    tp --shape 1b --variants a --devices 2 --tp 2 --sp
    tp --shape 1b --variants a --devices 2 --tp 2 --sp --fp8 e4m3 --cuda-graphs
    ;;
tests2)
    timeout 580 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=10 tests/test_layouts.py \
        -k test_gpu_layout_continues >"$out/$section.log" 2>&1
    tail -30 "$out/$section.log"
    ;;
tests4)
    timeout 580 python3 -m pytest -m gpu -v -p no:cacheprovider --durations=10 tests/test_layouts.py \
        -k "four_gpu_layout or dp4" >"$out/$section.log" 2>&1
    tail -30 "$out/$section.log"
    ;;
scaling4)
    tp --shape 3b --devices 4 --tp 2 --pp 2 --micro-batch-size 2 --micro-batches 8 --variants a,b
    tp --shape 3b --devices 4 --tp 2 --micro-batch-size 2 --micro-batches 4 --variants a,b
    ;;
cp4)
    tp --shape 1b --variants a --devices 4 --cp 4 --seq-length 131072 --micro-batch-size 1 --micro-batches 2
    tp --shape 1b --variants a --devices 2 --cp 2 --seq-length 131072 --micro-batch-size 1 --micro-batches 2 \
        --recompute full
    tp --shape 1b --variants a --devices 4 --cp 2 --tp 2 --sp --seq-length 65536 --micro-batch-size 1 --micro-batches 2
    ;;
*)
    echo "unknown section '$section' (see the header of $0)" >&2
    exit 2
    ;;
esac
