#!/usr/bin/env bash
# `rlk bench` on a GPU machine (offline) within 10 minutes (DEADLINE), with the GPU checks
# of the kernels changed since the last GPU run.
#   OUT=... bash scripts/gpu_bench.sh   (env: QUICK=1 for --quick; ONLY=fam,fam to run those
#                                        families alone; DEADLINE seconds, default 560;
#                                        LANE0, LANE1: each lane's steps, default below;
#                                        CHECK_OPS: the ops of `checks`, CHECK_SECS its time
#                                        limit, default 300; TESTS: test files of
#                                        `gputests`, TESTS_SECS its time limit, default 240;
#                                        RLK_E2E_MODELS: the models of the e2e families)
# The default lanes leave out e2e-long (the long rollouts, about 5 minutes): run it on its own,
# ONLY=e2e-long. Each family runs as its own `rlk bench --only <family>` process with its own
# time limit (the report is rewritten after every row, so a family cut short keeps what it
# measured). With two GPUs the families are split over two lanes, one per GPU, running at the
# same time; with one they run one after the other. `rlk bench --render` merges the parts into
# $OUT/<kind>.json and $OUT/<kind>.md (h100.json on an H100, h200.json on an H200: each GPU kind
# has its own record, docs/benchmarks/<kind>.json). A summary is printed last.
set -uo pipefail
# Everything is written under W; $OUT receives only <kind>.json, <kind>.md, summary.txt and
# logs.tgz (every file of W), so that the results are a few files to copy off the machine.
RESULTS=${OUT:-gpu-out}; W=$(mktemp -d); OUT=$W
export PYTHONUNBUFFERED=1
source scripts/gpu_install.sh
T0=$(date +%s); DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - $(date +%s) + T0 )); }
Q=(); [ "${QUICK:-0}" = 1 ] && Q=(--quick)
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
KIND=$(python3 -c "import torch; from rlk.bench import gpu_kind; print(gpu_kind(torch.cuda.get_device_name(0)))")

step() {  # step NAME SECONDS CMD...: output to NAME.txt, status and wall time to summary.txt
  local name=$1 secs=$2 t=$(date +%s); shift 2
  local l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  if [ "$secs" -lt 20 ]; then echo "$name: not run (deadline)" >> "$OUT/summary.txt"; return; fi
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - t ))s (limit ${secs}s)" >> "$OUT/summary.txt"
}
fam() { step "bench_$1" "$2" rlk bench "${Q[@]}" --only "$1" --json "$OUT/bench_$1.json"; }
checks() {  # real-shape conformance of the kernels changed since the last GPU run
  # (attention and paged_attention alone took longer than 150 s with --full on the H200)
  RLK_VALIDATE=1 step conformance "${CHECK_SECS:-300}" rlk conformance --backend cuda --full --quiet \
    --ops "${CHECK_OPS:-linear,attention,paged_attention,apply_rotary}"
}
gputests() {  # the GPU tests of the files changed since the last GPU run
  # Four processes on the one GPU when pytest-xdist is there: the tests' time is mostly
  # compiling, on the CPU.
  local par=(); python3 -c "import xdist" 2>/dev/null && par=(-n 4)
  # shellcheck disable=SC2086
  step gpu_tests "${TESTS_SECS:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    "${par[@]}" ${TESTS:-}
}
decode() {  # a decode step's GPU time per kernel and its share of the HBM roofline
  step decode_b64 150 python3 scripts/profile_decode.py --batch 64
  step decode_b8 100 python3 scripts/profile_decode.py --batch 8 --top 6
}
consistency() {  # the contract at this commit on the GPU, both rollout modes
  step consistency 150 rlk consistency --model qwen2-0.5b --prompts 64 --new-tokens 128 \
    --micro-batch 8 --rollout-mode both --quiet --json "$OUT/consistency.json"
}
consistency_graphs() {  # the same, the training recompute replayed as CUDA graphs
  step consistency_graphs 150 rlk consistency --model qwen2-0.5b --prompts 64 --new-tokens 128 \
    --micro-batch 8 --rollout-mode both --train-engine transformers-graphs --quiet \
    --json "$OUT/consistency_graphs.json"
}
consistency_heldout() {  # the held-out shapes at 32 x 128 tokens, recompute as CUDA graphs
  local m
  for m in llama3.2-1b-4layers qwen2.5-1.5b-4layers; do
    step "consistency_$m" 150 rlk consistency --model "$m" --prompts 32 --new-tokens 128 \
      --micro-batch 8 --rollout-mode both --train-engine transformers-graphs --quiet \
      --json "$OUT/consistency_$m.json"
  done
}
lane0() { eval "${LANE0:-fam gemm 150; fam attention 150; fam norm 240; fam sampling 100; checks}"; }
lane1() { eval "${LANE1:-consistency; fam e2e 400; fam e2e-heldout 100; fam logprobs 200}"; }

if [ -n "${ONLY:-}" ]; then
  for f in ${ONLY//,/ }; do fam "$f" 400; done
elif [ "$NGPU" -ge 2 ]; then
  (export CUDA_VISIBLE_DEVICES=0; lane0) &
  (export CUDA_VISIBLE_DEVICES=1; lane1) &
  wait
else
  lane0; lane1
fi
parts=(); for f in "$OUT"/bench_*.json; do [ -s "$f" ] && parts+=("$f"); done
if [ ${#parts[@]} -gt 0 ]; then
  rlk bench --render "${parts[@]}" --json "$OUT/$KIND.json" --markdown "$OUT/$KIND.md" > /dev/null
fi
mkdir -p "$RESULTS"; tar czf "$RESULTS/logs.tgz" -C "$W" .
for f in "$KIND.json" "$KIND.md" summary.txt; do [ -f "$W/$f" ] && cp "$W/$f" "$RESULTS/"; done
echo "== $(( $(date +%s) - T0 ))s; $(tr '\n' ' ' < "$OUT/gpu.txt")"
cat "$OUT/summary.txt"
for f in conformance consistency consistency_graphs consistency_llama3.2-1b-4layers \
  consistency_qwen2.5-1.5b-4layers gpu_tests; do [ -f "$OUT/$f.txt" ] && tail -4 "$OUT/$f.txt"; done
for f in decode_b64 decode_b8; do [ -f "$OUT/$f.txt" ] && tail -9 "$OUT/$f.txt"; done
[ -f "$OUT/$KIND.md" ] && sed -n '/Worst ratio/,/^## /p' "$OUT/$KIND.md"
