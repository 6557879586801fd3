#!/usr/bin/env bash
# GPU session on the H200 machine (offline): install, then the stages asked for.
#   bash scripts/gpu_session.sh tests conformance bench [-- bench args]
# Stages: tests (pytest -m gpu), conformance (rlk conformance --full, backends cuda and triton),
# bench (benchmarks/run.py). Logs and JSON go to $OUT (default ./gpu-out); a summary is last.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RLK_VALIDATE=1
stages=(); bench_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; bench_args=("$@"); break; fi
  stages+=("$1"); shift
done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
for p in rlk-reference rlk-api rlk-triton rlk-cuda rlk-rocm rlk-ascend; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "packages/$p" >/dev/null || exit 1
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
rlk info > "$OUT/info.txt" 2>&1
summary=()
for s in "${stages[@]}"; do
  t0=$(date +%s)
  case "$s" in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf --continue-on-collection-errors packages tests \
        > "$OUT/gpu_tests.log" 2>&1
      summary+=("tests: $(tail -1 "$OUT/gpu_tests.log")") ;;
    conformance)
      for b in cuda triton; do
        rlk conformance --backend "$b" --full --quiet --json "$OUT/conformance_$b.json" \
          > "$OUT/conformance_$b.txt" 2>&1
        summary+=("conformance $b: $(tail -1 "$OUT/conformance_$b.txt")")
      done ;;
    bench)
      python3 benchmarks/run.py "${bench_args[@]}" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
      summary+=("bench: rc=$? $(grep -c '^| ' "$OUT/bench.txt") table lines") ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
  summary+=("  ($s took $(( $(date +%s) - t0 )) s)")
done
echo "=== $(cat "$OUT/gpu.txt" | tr '\n' ' ')"
for l in "${summary[@]}"; do echo "$l"; done
