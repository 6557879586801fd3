"""Repository-wide pytest setup: tests marked ``gpu`` are skipped (and shown as skipped) on
machines without a CUDA/ROCm device; value checks that sync the device are always on."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RLK_VALIDATE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (run scripts/gpu_stages.sh there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
