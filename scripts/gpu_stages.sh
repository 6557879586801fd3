#!/usr/bin/env bash
# GPU checks on an H200 machine (offline): install, then the stages asked for.
#   bash scripts/gpu_stages.sh tests conformance consistency tp megatron moe bench [-- bench args]
# Stages: tests (pytest -m gpu), conformance (rlk conformance --full, backends cuda and triton),
# consistency (rlk consistency, 64 prompts x 256 tokens, qwen2-0.5b and qwen3-0.6b, padded and
# paged rollouts), tp (rollout TP=2 / training TP=2 against TP=1, and benchmarks/bench_tp.py; 2
# GPUs), megatron (Megatron-core recompute at TP 1 and 2, and benchmarks/bench_megatron.py),
# bench (rlk bench), moe (the mixture-of-experts and DeepSeek-V3 checks, below). Logs and JSON go
# to $OUT (default ./gpu-out); a summary is last.
# moe: its parts (MOE_PARTS, default "conformance consistency ep1 tests bench", in order), each
# under a time limit, the stage within MOE_DEADLINE seconds (default 500: one 10-minute call with
# the install; a part cut short or not run says so in the summary: rerun it alone): the MoE ops'
# conformance at real shapes (cuda backend); rlk consistency on deepseek-v3-4layers and
# qwen3-30b-a3b-4layers (padded and paged rollouts, MOE_PROMPTS x MOE_NEW_TOKENS, default 32 x
# 128), and qwen3-30b-a3b-4layers at --ep 1 (the expert-parallel code path); the GPU tests of
# torch.compile(fullgraph=True) of every patched model and of the MoE kernels (4 processes where
# pytest-xdist is installed); `rlk bench --only moe` (MOE_BENCH_ARGS, default --quick, some 80 s
# estimated; all the token counts some 3 minutes, estimated: run them alone, MOE_PARTS=bench
# MOE_BENCH_ARGS=).
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
moe_part() {  # moe_part NAME SECONDS CMD...: CMD under SECONDS or what is left of the moe
  # stage's MOE_DEADLINE, stdout to $OUT/NAME.txt, stderr to $OUT/NAME.log; rc and time summarised
  local name=$1 secs=$2 t; t=$(date +%s); shift 2
  local left=$(( ${MOE_DEADLINE:-500} - t + moe_t0 ))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 20 ]; then summary+=("$name: not run (MOE_DEADLINE spent)"); return 1; fi
  timeout "$secs" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  local rc=$?
  summary+=("$name: rc=$rc $(( $(date +%s) - t )) s (limit $secs s)")
}
moe_stage() {
  local p m par=()
  moe_t0=$(date +%s)
  python3 -c "import xdist" 2>/dev/null && par=(-n 4)
  for p in ${MOE_PARTS:-conformance consistency ep1 tests bench}; do
    case "$p" in
      conformance)
        RLK_VALIDATE=1 moe_part moe_conformance 120 rlk conformance --backend cuda --full --quiet \
          --ops moe_route,moe_route_grouped,moe_experts --json "$OUT/moe_conformance.json" &&
          summary+=("  $(tail -1 "$OUT/moe_conformance.txt")") ;;
      consistency)
        for m in deepseek-v3-4layers qwen3-30b-a3b-4layers; do
          moe_part "consistency_$m" 120 rlk consistency --model "$m" --rollout-mode both \
            --prompts "${MOE_PROMPTS:-32}" --new-tokens "${MOE_NEW_TOKENS:-128}" --micro-batch 8 \
            --json "$OUT/consistency_$m.json" &&
            summary+=("  $(grep -E '^(stock|rlk) ' "$OUT/consistency_$m.txt" |
              awk '{printf "%s/%s differ %s experts %s; ", $1, $2, $7, $8}')")
        done ;;
      ep1)  # the expert-parallel code path (shard_ep, all-to-all) on the one GPU
        moe_part consistency_ep1 150 rlk consistency --model qwen3-30b-a3b-4layers --ep 1 \
          --prompts "${MOE_PROMPTS:-32}" --new-tokens "${MOE_NEW_TOKENS:-128}" --micro-batch 8 \
          --json "$OUT/consistency_ep1.json" &&
          summary+=("  $(grep -E '^(stock|rlk) ' "$OUT/consistency_ep1.txt" |
            awk '{printf "%s/%s differ %s experts %s; ", $1, $2, $7, $8}')") ;;
      tests)
        RLK_VALIDATE=1 moe_part moe_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
          "${par[@]}" packages/rlk-integrations/tests/test_compile_fullgraph.py \
          packages/rlk-triton/tests/test_moe.py &&
          summary+=("  $(tail -1 "$OUT/moe_tests.txt")") ;;
      bench)
        # shellcheck disable=SC2086
        moe_part bench_moe 400 rlk bench --only moe ${MOE_BENCH_ARGS---quick} \
          --json "$OUT/bench_moe.json" &&
          while IFS= read -r m; do summary+=("  $m"); done < <(awk -F'|' '/peer_ms/ {r = 1; next}
            r && $2 ~ /moe_layer/ {gsub(/  +/, " "); print $2 $3 "best peer" $7 "peer/rlk" $9}' \
            "$OUT/bench_moe.txt") ;;
      *) echo "unknown moe part $p"; exit 2 ;;
    esac
  done
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
    moe) moe_stage ;;
    bench)
      rlk bench "${bench_args[@]}" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
      summary+=("bench: rc=$? $(grep -c '^| ' "$OUT/bench.txt") table lines") ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
  summary+=("  ($s took $(( $(date +%s) - t0 )) s)")
done
echo "=== $(cat "$OUT/gpu.txt" | tr '\n' ' ')"
for l in "${summary[@]}"; do echo "$l"; done
