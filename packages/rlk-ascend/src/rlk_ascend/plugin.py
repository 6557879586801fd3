"""Registers backend "ascend" (torch-npu). Availability never imports torch_npu."""

from __future__ import annotations

import importlib.util
import sys

from rlk import BackendImpl, BackendSpec, hookimpl


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
        import torch_npu  # noqa: F401
    except Exception as e:  # a broken CANN install is a reason, never a crash
        raise RuntimeError(f"torch_npu not importable: {type(e).__name__}: {e}") from e
    from rlk_ascend.backend import make_impl

    return make_impl()


@hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name="ascend",
            priority=100,
            device_types=("npu",),
            is_available=_available,
            load=_load,
            description="torch-npu fused operators and fixed-order PyTorch code",
            distribution="rlk-ascend",
        )
    ]
