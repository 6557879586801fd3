"""Registers backend "ascend" (torch-npu). Availability never imports torch_npu.

torch_npu is imported by the loader only, after the backend has been chosen. Without Huawei's
CANN, importing it fails (and, through torch's device-backend autoload, can break
``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); that is reported as a reason.
"""

from __future__ import annotations

import importlib.util
import sys

from rlk.plugins import BackendImpl, BackendSpec, hookimpl


def _available() -> tuple[bool, str]:
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (it needs Huawei CANN; see docs/backends.md)"
    if "torch_npu" in sys.modules:
        import torch

        if not torch.npu.is_available():
            return False, "torch_npu is loaded but sees no Ascend NPU"
    return True, ""


def _load() -> BackendImpl:
    try:
        import torch_npu
    except Exception as e:  # a broken CANN install is a reason, never a crash
        raise RuntimeError(f"torch_npu not importable: {type(e).__name__}: {e}") from e
    import torch

    if not torch.npu.is_available():
        raise RuntimeError("torch_npu is loaded but sees no Ascend NPU")
    from rlk_ascend.backend import make_impl

    return make_impl(npu=torch_npu)


@hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name="ascend",
            priority=100,
            device_types=("npu",),
            is_available=_available,
            load=_load,
            description="fixed-order PyTorch code on torch-npu (fused operators opt-in)",
            distribution="rlk-ascend",
        )
    ]
