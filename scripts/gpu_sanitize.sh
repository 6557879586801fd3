#!/usr/bin/env bash
# The bad-input cases of rlk.testing.bad_inputs on a GPU in default mode (RLK_VALIDATE unset),
# each in its own process under compute-sanitizer's memcheck, with the caching allocator off
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that every tensor is its own allocation and an access
# past its end is seen. One process per case: a device-side assertion (how a bad index is
# reported without a host sync) ends that process's CUDA context, and must not hide the next
# case. API errors are not reported (that assertion is one); memory access errors are.
#   bash scripts/gpu_sanitize.sh        # logs under $OUT/sanitize (default gpu-out), table last
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/sanitize"
export PYTHONUNBUFFERED=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
unset RLK_VALIDATE
source scripts/gpu_install.sh
SAN=${SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
if [ -z "$SAN" ]; then
  echo "compute-sanitizer not found (set SANITIZER=/path/to/compute-sanitizer)" | tee "$OUT/sanitize.txt"
  exit 2
fi
"$SAN" --version > "$OUT/sanitize/version.txt" 2>&1
python3 scripts/bad_inputs.py --device cuda --logs "$OUT/sanitize" \
  --wrap "$SAN --tool memcheck --report-api-errors no --print-limit 100" 2>&1 | tee "$OUT/sanitize.txt"
exit "${PIPESTATUS[0]}"
