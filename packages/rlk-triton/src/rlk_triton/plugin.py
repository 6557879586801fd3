"""Registers backend "triton": the portable kernels with the generic tuning table."""

from __future__ import annotations

import importlib.util
import os

from rlk.plugins import BackendImpl, BackendSpec, hookimpl


def triton_status(device_type: str) -> tuple[bool, str]:
    """Whether the Triton kernels can run on ``device_type`` tensors in this process."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    import torch

    if device_type == "cpu":
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "a GPU is present; set TRITON_INTERPRET=1 to run kernels on CPU tensors"
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA/ROCm device"
    return True, ""


def _device_type() -> str:
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def _load() -> BackendImpl:
    from rlk_triton import backend

    return backend.make_impl(backend.default_table())


@hookimpl
def rlk_backends():
    dev = _device_type()
    return [
        BackendSpec(
            name="triton",
            priority=50,
            device_types=(dev,),
            is_available=lambda: triton_status(dev),
            load=_load,
            description="portable Triton kernels, generic tuning"
            + (" (CPU: Triton interpreter)" if dev == "cpu" else ""),
            distribution="rlk-triton",
        )
    ]
