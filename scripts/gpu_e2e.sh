#!/usr/bin/env bash
# End-to-end GPU runs (rollout vs training at TP 1 and 2, Megatron-core training, the tree GEMM's
# and the log-prob kernels' speed) on a 2-GPU machine (offline), in two lanes that run
# at the same time (one per GPU), then the 2-GPU runs. Every command has its own time limit so
# that a slow one costs its own result only; logs, tables and JSON go to $OUT; a summary is last.
#   OUT=... bash scripts/gpu_e2e.sh            (env: N, L = prompts, new tokens; TPN, TPL for TP;
#                                               SCALE multiplies every time limit, default 1)
# PART=lanes (default) runs the two one-GPU lanes, PART=tp the 2-GPU runs of qwen2-0.5b,
# PART=llama the 2-GPU llama3-8b-4layers runs, PART=recheck the re-checks after a change of the
# logprobs leaves or the tree kernel; each part fits in 10 minutes (DEADLINE).
# Everything under $OUT is also packed into $OUT/all.tgz (one file to copy off the machine).
# The limits assume a machine whose Triton cache is cold: 2-3 processes compiling every kernel
# take a minute or more before the first step (the first run of this script, with half these
# limits, lost every TP run to that).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
N=${N:-64}; L=${L:-256}; TPN=${TPN:-64}; TPL=${TPL:-128}
source scripts/gpu_install.sh

SCALE=${SCALE:-1}
# Every command's limit is cut to what is left before DEADLINE seconds (from here), and a command
# with under 30 s left is not started (its .rc says so), so the script ends within DEADLINE.
T_START=$(date +%s); DEADLINE=${DEADLINE:-540}
run() {  # run NAME SECONDS CMD...: stdout to NAME.txt, stderr to NAME.log, rc to NAME.rc
  local name=$1 secs=$(( $2 * SCALE )); shift 2
  local t0=$(date +%s) left=$(( DEADLINE - $(date +%s) + T_START ))
  if [ "$left" -lt 30 ]; then echo "not run: ${left}s left of the deadline" > "$OUT/$name.rc"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  timeout "$secs" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  echo "$? $(( $(date +%s) - t0 ))s (limit ${secs}s)" > "$OUT/$name.rc"
}
cons() {  # cons NAME SECONDS PROMPTS TOKENS ARGS...
  local name=$1 secs=$2 n=$3 l=$4; shift 4
  run "$name" "$secs" rlk consistency --prompts "$n" --new-tokens "$l" --micro-batch 8 \
    --json "$OUT/$name.json" "$@"
}
megatron() {  # megatron NAME SECONDS MODEL TP
  cons "$1" "$2" "$TPN" "$TPL" --model "$3" --leaves 8 --train-engine megatron --train-tp "$4" \
    --rollout-mode padded
}

PART=${PART:-lanes}
if [ "$PART" = lanes ]; then
# Lane 0 (GPU 0): Megatron-core training at TP 1 (both configs) and its step time; the tree
# GEMM's speed.
(
  export CUDA_VISIBLE_DEVICES=0
  megatron megatron_tp1_qwen2 150 qwen2-0.5b 1
  megatron megatron_tp1_llama3 200 llama3-8b-4layers 1
  run bench_megatron_tp1 120 python3 benchmarks/bench_megatron.py --model qwen2-0.5b --tp 1
  run bench_tree_gemm 150 python3 benchmarks/bench_tree_gemm.py --leaves 2,8
) &
# Lane 1 (GPU 1): the vocabulary-leaf logprobs kernels: GPU tests, conformance, benchmarks.
(
  export CUDA_VISIBLE_DEVICES=1
  RLK_VALIDATE=1 run gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    packages/rlk-triton/tests/test_logprobs.py packages/rlk-triton/tests/test_fused_logprobs.py \
    tests/test_parallel.py
  RLK_VALIDATE=1 run conformance_lp 120 rlk conformance --backend cuda --full --quiet \
    --ops logprobs,linear_logprobs
  run bench_lp 150 rlk bench --quick --only logprobs
) &
wait
fi
if [ "$PART" = tp ]; then
# Both GPUs: rollout / training at TP 2 against TP 1, Megatron-core training at TP 2, step times.
cons tp_rollout2 150 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --rollout-tp 2 --rollout-mode both
cons tp_train2 120 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --train-tp 2 --rollout-mode padded
megatron megatron_tp2_qwen2 120 qwen2-0.5b 2
run bench_tp 150 python3 benchmarks/bench_tp.py --model qwen2-0.5b --tp 2 --samples 16 --len 512 --repeat 1
run bench_megatron_tp2 120 python3 benchmarks/bench_megatron.py --model qwen2-0.5b --tp 2
run bench_tp_halving 150 python3 benchmarks/bench_tp.py --model qwen2-0.5b --tp 2 --samples 16 --len 512 --repeat 3 --exchange halving
fi
if [ "$PART" = recheck ]; then
# After a change of VOCAB_LEAVES (logprobs bits) and the tree kernel: their GPU tests, conformance
# and benchmarks on one GPU each, then the vocabulary-parallel TP 2 runs and TP 2 at 2 leaves.
(
  export CUDA_VISIBLE_DEVICES=0
  RLK_VALIDATE=1 run gpu_tests_lp 130 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    packages/rlk-triton/tests/test_logprobs.py packages/rlk-triton/tests/test_fused_logprobs.py
  RLK_VALIDATE=1 run conformance_lp 110 rlk conformance --backend cuda --full --quiet \
    --ops logprobs,linear_logprobs
  run bench_lp 50 rlk bench --quick --only logprobs
) &
(
  export CUDA_VISIBLE_DEVICES=1
  run bench_tree_gemm 170 python3 benchmarks/bench_tree_gemm.py --leaves 2,8 --configs \
    --shape 2048,4096,4096 --shape 4096,14336,4096 --shape 2048,4864,896
  RLK_VALIDATE=1 run gpu_tests_tree 110 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    packages/rlk-triton/tests/test_tree_gemm.py
) &
wait
cons tp_train2 100 "$TPN" "$TPL" --model qwen2-0.5b --leaves 8 --train-tp 2 --rollout-mode padded
megatron megatron_tp2_qwen2 100 qwen2-0.5b 2
run bench_tp_l2 100 python3 benchmarks/bench_tp.py --model qwen2-0.5b --tp 2 --leaves 2 --samples 16 --len 512 --repeat 1
fi
if [ "$PART" = llama ]; then
megatron megatron_tp2_llama3 200 llama3-8b-4layers 2
run bench_tp_llama3 150 python3 benchmarks/bench_tp.py --model llama3-8b-4layers --tp 2 --samples 16 --len 512 --repeat 1
run bench_megatron_tp2_llama3 150 python3 benchmarks/bench_megatron.py --model llama3-8b-4layers --tp 2
run bench_megatron_tp1_llama3 150 python3 benchmarks/bench_megatron.py --model llama3-8b-4layers --tp 1
fi

tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
echo "=== $(tr '\n' ' ' < "$OUT/gpu.txt")"
for f in "$OUT"/*.rc; do
  n=$(basename "$f" .rc)
  echo "--- $n: rc/time $(cat "$f")"
  grep -E '^(side|stock|rlk) |rlk / stock|tokens/s' "$OUT/$n.txt" 2>/dev/null
  grep -E 'passed|failed|^\| ' "$OUT/$n.txt" 2>/dev/null | tail -12
done
