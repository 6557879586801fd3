#!/usr/bin/env bash
# `rlk bench` on an H200 machine (offline) inside one 10-minute device call, after the GPU
# checks of the kernels changed since the last GPU run.
#   OUT=... bash scripts/gpu_bench.sh      (env: QUICK=1 for --quick; DEADLINE seconds, def. 570)
# With two GPUs the kernel families run on GPU 0 and the end-to-end family on GPU 1 at the same
# time (two processes of one run); `rlk bench --render` merges them into $OUT/h200.json and
# $OUT/h200.md. With one GPU they run one after the other. A summary is printed last.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_install.sh
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
left() { echo $(( DEADLINE - $(date +%s) + T0 )); }
Q=(); [ "${QUICK:-0}" = 1 ] && Q=(--quick)
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")

# Checks: the rotary kernel's GPU tests and its conformance (every config of every table).
RLK_VALIDATE=1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
  packages/rlk-triton/tests/test_rotary.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$OUT/summary.txt"
RLK_VALIDATE=1 timeout 120 rlk conformance --backend cuda --full --quiet --ops apply_rotary \
  > "$OUT/conformance.txt" 2>&1
echo "conformance rc=$?" >> "$OUT/summary.txt"

kernels=(rlk bench "${Q[@]}" --only gemm,attention,norm,logprobs,sampling --json "$OUT/kernels.json")
e2e=(rlk bench "${Q[@]}" --only e2e --json "$OUT/e2e.json")
if [ "$NGPU" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(left) "${kernels[@]}" > "$OUT/kernels.txt" 2> "$OUT/kernels.log" &
  CUDA_VISIBLE_DEVICES=1 timeout $(left) "${e2e[@]}" > "$OUT/e2e.txt" 2> "$OUT/e2e.log" &
  wait
else
  timeout $(left) "${kernels[@]}" > "$OUT/kernels.txt" 2> "$OUT/kernels.log"
  timeout $(left) "${e2e[@]}" > "$OUT/e2e.txt" 2> "$OUT/e2e.log"
fi
parts=(); for f in kernels e2e; do [ -s "$OUT/$f.json" ] && parts+=("$OUT/$f.json"); done
if [ ${#parts[@]} -gt 0 ]; then
  rlk bench --render "${parts[@]}" --json "$OUT/h200.json" --markdown "$OUT/h200.md" > /dev/null
fi
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude=logs.tgz . 2>/dev/null
echo "== $(( $(date +%s) - T0 ))s; $(cat "$OUT/gpu.txt" | tr '\n' ' ')"
cat "$OUT/summary.txt"
tail -3 "$OUT/gpu_tests.txt"; tail -4 "$OUT/conformance.txt"
for f in kernels e2e; do echo "-- $f: $(tail -2 "$OUT/$f.log" | tr '\n' ' ')"; done
[ -f "$OUT/h200.md" ] && sed -n '/Worst ratio/,/^## gemm/p' "$OUT/h200.md"
