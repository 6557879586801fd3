#!/usr/bin/env bash
# GPU checks on an H200 machine (offline): install, then the stages asked for.
#   bash scripts/gpu_stages.sh tests conformance consistency tp megatron bench [-- bench args]
# Stages: tests (pytest -m gpu), conformance (rlk conformance --full, backends cuda and triton),
# consistency (rlk consistency, 64 prompts x 256 tokens, qwen2-0.5b and qwen3-0.6b, padded and
# paged rollouts), tp (rollout TP=2 / training TP=2 against TP=1, and benchmarks/bench_tp.py; 2
# GPUs), megatron (Megatron-core recompute at TP 1 and 2, and benchmarks/bench_megatron.py),
# bench (rlk bench). Logs and JSON go to $OUT (default ./gpu-out); a summary is last.
# RLK_VALIDATE=1 (value checks that read the device) only for tests and conformance: the timed
# stages run as users run.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
N=${RLK_PROMPTS:-64}; L=${RLK_NEW_TOKENS:-256}
cons() {  # cons NAME ARGS...: one rlk consistency run, its table and JSON into $OUT
  local name=$1; shift
  rlk consistency --prompts "$N" --new-tokens "$L" --micro-batch 8 --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.txt" 2> "$OUT/$name.log"
  summary+=("$name: rc=$? $(grep -E '^rlk' "$OUT/$name.txt" | awk '{print $2 "=" $5}' | tr '\n' ' ')")
}
stages=(); bench_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; bench_args=("$@"); break; fi
  stages+=("$1"); shift
done
source scripts/gpu_install.sh
rlk info > "$OUT/info.txt" 2>&1
summary=()
for s in "${stages[@]}"; do
  t0=$(date +%s)
  case "$s" in
    tests)
      RLK_VALIDATE=1 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf --continue-on-collection-errors packages tests \
        > "$OUT/gpu_tests.log" 2>&1
      summary+=("tests: $(tail -1 "$OUT/gpu_tests.log")") ;;
    conformance)
      for b in cuda triton; do
        RLK_VALIDATE=1 rlk conformance --backend "$b" --full --quiet --json "$OUT/conformance_$b.json" \
          > "$OUT/conformance_$b.txt" 2>&1
        summary+=("conformance $b: $(tail -1 "$OUT/conformance_$b.txt")")
      done ;;
    consistency)
      for m in qwen2-0.5b qwen3-0.6b; do cons "consistency_$m" --model "$m" --rollout-mode both; done ;;
    tp)
      cons tp_rollout2_train1 --model qwen2-0.5b --leaves 8 --rollout-tp 2 --rollout-mode both
      cons tp_rollout1_train2 --model qwen2-0.5b --leaves 8 --train-tp 2 --rollout-mode padded
      python3 benchmarks/bench_tp.py --model qwen2-0.5b --tp 2 > "$OUT/bench_tp.txt" 2>&1
      summary+=("bench_tp: rc=$? $(tail -1 "$OUT/bench_tp.txt")") ;;
    megatron)
      for m in qwen2-0.5b llama3-8b-4layers; do
        cons "megatron_tp1_$m" --model "$m" --leaves 8 --train-engine megatron --rollout-mode padded
        cons "megatron_tp2_$m" --model "$m" --leaves 8 --train-engine megatron --train-tp 2 \
          --rollout-mode padded
      done
      if [ -f benchmarks/bench_megatron.py ]; then
        for tpn in 1 2; do
          python3 benchmarks/bench_megatron.py --model qwen2-0.5b --tp $tpn > "$OUT/bench_megatron_tp$tpn.txt" 2>&1
          summary+=("bench_megatron tp$tpn: rc=$? $(tail -1 "$OUT/bench_megatron_tp$tpn.txt")")
        done
      fi ;;
    bench)
      rlk bench "${bench_args[@]}" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
      summary+=("bench: rc=$? $(grep -c '^| ' "$OUT/bench.txt") table lines") ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
  summary+=("  ($s took $(( $(date +%s) - t0 )) s)")
done
echo "=== $(cat "$OUT/gpu.txt" | tr '\n' ' ')"
for l in "${summary[@]}"; do echo "$l"; done
