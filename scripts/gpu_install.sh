# Sourced by the GPU scripts (offline machine): the carried wheels, the packages, and what the
# machine is into $OUT/gpu.txt.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
for p in rlk-reference rlk-api rlk-triton rlk-cuda rlk-rocm rlk-ascend rlk-integrations; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "packages/$p" >/dev/null || exit 1
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" >> "$OUT/gpu.txt" 2>/dev/null
