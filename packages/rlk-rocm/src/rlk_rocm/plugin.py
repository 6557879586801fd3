"""Registers backend "rocm": rlk-triton kernels with CDNA tuning, on AMD GPUs."""

from __future__ import annotations

import importlib.util

from rlk.plugins import BackendImpl, BackendSpec, hookimpl


def _available() -> tuple[bool, str]:
    import torch

    if not getattr(torch.version, "hip", None):
        return False, "this torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return False, "no AMD GPU visible to ROCm"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


def _load() -> BackendImpl:
    from rlk_rocm.tables import CDNA3
    from rlk_triton import backend

    return backend.make_vendor_impl(CDNA3)


@hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name="rocm",
            priority=100,
            device_types=("cuda",),  # ROCm builds of torch name AMD GPUs "cuda"
            is_available=_available,
            load=_load,
            description="rlk-triton kernels with AMD CDNA3 tuning",
            distribution="rlk-rocm",
        )
    ]
