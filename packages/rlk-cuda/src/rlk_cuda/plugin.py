"""Registers backend "cuda": rlk-triton kernels with NVIDIA tuning, on NVIDIA GPUs."""

from __future__ import annotations

import importlib.util

from rlk.plugins import BackendImpl, BackendSpec, hookimpl


def _available() -> tuple[bool, str]:
    import torch

    if getattr(torch.version, "hip", None):
        return False, "this torch is a ROCm build (use backend 'rocm')"
    if torch.version.cuda is None:
        return False, "this torch has no CUDA support (a CPU build)"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


def _load() -> BackendImpl:
    from rlk_cuda.tables import NVIDIA
    from rlk_triton import backend

    return backend.make_vendor_impl(NVIDIA)


@hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name="cuda",
            priority=100,
            device_types=("cuda",),
            is_available=_available,
            load=_load,
            description="rlk-triton kernels with NVIDIA SM80/SM90 tuning",
            distribution="rlk-cuda",
        )
    ]
