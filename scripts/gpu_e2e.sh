#!/usr/bin/env bash
# End-to-end GPU runs of issues 7, 8 and 11 on a 2-GPU machine (offline), in two lanes that run
# at the same time (one per GPU), then the 2-GPU runs. Every command has its own time limit so
# that a slow one costs its own result only; logs, tables and JSON go to $OUT; a summary is last.
#   OUT=... bash scripts/gpu_e2e.sh            (env: N, L = prompts, new tokens; TPN, TPL for TP;
#                                               SCALE multiplies every time limit, default 1)
# PART=lanes runs the two one-GPU lanes only, PART=tp the 2-GPU runs only (default: both; the
# two parts each fit one 10-minute device call, both together do not).
# Everything under $OUT is also packed into $OUT/all.tgz (the device tool returns few files).
# The limits assume a machine whose Triton cache is cold: 2-3 processes compiling every kernel
# take a minute or more before the first step (the first run of this script, with half these
# limits, lost every TP run to that).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
N=${N:-64}; L=${L:-256}; TPN=${TPN:-64}; TPL=${TPL:-128}
source scripts/gpu_install.sh

SCALE=${SCALE:-1}
run() {  # run NAME SECONDS CMD...: stdout to NAME.txt, stderr to NAME.log, rc to NAME.rc
  local name=$1 secs=$(( $2 * SCALE )); shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  echo "$? $(( $(date +%s) - t0 ))s" > "$OUT/$name.rc"
}
cons() {  # cons NAME SECONDS PROMPTS TOKENS ARGS...
  local name=$1 secs=$2 n=$3 l=$4; shift 4
  run "$name" "$secs" rlk consistency --prompts "$n" --new-tokens "$l" --micro-batch 8 \
    --json "$OUT/$name.json" "$@"
}

PART=${PART:-all}
if [ "$PART" != tp ]; then
# Lane 0 (GPU 0): issue 7, 64 prompts x 256 tokens, both rollout modes.
(
  export CUDA_VISIBLE_DEVICES=0
  cons cons_qwen2-0.5b 200 "$N" "$L" --model qwen2-0.5b --rollout-mode both
  cons cons_qwen3-0.6b 200 "$N" "$L" --model qwen3-0.6b --rollout-mode both
) &
# Lane 1 (GPU 1): the changed logprobs kernels' GPU tests and conformance, Megatron at TP 1.
(
  export CUDA_VISIBLE_DEVICES=1
  RLK_VALIDATE=1 run gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    packages/rlk-triton/tests/test_logprobs.py packages/rlk-triton/tests/test_fused_logprobs.py \
    tests/test_parallel.py
  RLK_VALIDATE=1 run conformance_lp 120 rlk conformance --backend cuda --full --quiet \
    --ops logprobs,linear_logprobs
  cons megatron_tp1 150 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --train-engine megatron \
    --rollout-mode padded
) &
wait
fi
if [ "$PART" != lanes ]; then
# Both GPUs: issue 8 (rollout / training at TP 2 against TP 1) and issue 11 at TP 2.
cons tp_rollout2 200 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --rollout-tp 2 --rollout-mode both
cons tp_train2 150 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --train-tp 2 --rollout-mode padded
cons megatron_tp2 150 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --train-engine megatron \
  --train-tp 2 --rollout-mode padded
run bench_tp 200 python3 benchmarks/bench_tp.py --model qwen2-0.5b --tp 2 --samples 16 --len 256 --repeat 1
fi

tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
echo "=== $(tr '\n' ' ' < "$OUT/gpu.txt")"
for f in "$OUT"/*.rc; do
  n=$(basename "$f" .rc)
  echo "--- $n: rc/time $(cat "$f")"
  grep -E '^(side|stock|rlk) ' "$OUT/$n.txt" 2>/dev/null
  grep -E 'passed|failed|^\| ' "$OUT/$n.txt" 2>/dev/null | tail -3
done
