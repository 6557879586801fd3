#!/usr/bin/env bash
# One GPU session: install offline, GPU tests, full conformance, the benchmark harness.
# Usage (on the GPU machine, repository root): bash scripts/gpu_session.sh [--quick]
# Writes logs and JSON under $OUT (or ./gpu-out) and prints a short summary last.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RLK_VALIDATE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
for p in rlk-reference rlk-api rlk-triton rlk-cuda rlk-rocm rlk-ascend; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "packages/$p" || exit 1
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
rlk info | tee "$OUT/info.txt"
timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider packages tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
timeout 900 rlk conformance --backend cuda --full --json "$OUT/conformance.json" 2>"$OUT/conformance.err" | tee "$OUT/conformance.txt"
timeout 900 python3 benchmarks/run.py "$@" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
echo "=== summary ==="
tail -3 "$OUT/gpu_tests.log"; tail -1 "$OUT/conformance.txt"; grep -c "^|" "$OUT/bench.txt"
