"""A CPU platform for verl (verl 0.9.1 ships CUDA, NPU and ROCm ones only).

verl's engines ask its platform for the device name, the torch device module and the
collective backend; without an accelerator ``get_device_name()`` says ``cuda``. The rlk engine's
CPU tests register this one as ``cpu`` and select it with ``VERL_PLATFORM=cpu``: FSDP2 over gloo,
the same code path as on a GPU except the device; verl's vLLM weight sync moves its buckets
through shared memory (no IPC).
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

NAME = "cpu"


class _CPUDevice(ModuleType):
    """``torch.cpu`` with the cache call verl makes of every device module (its weight
    transfer's clean-up, ``get_torch_device().empty_cache()``), which ``torch.cpu`` lacks:
    the host has no device cache to empty. It compares equal to ``torch.cpu``: verl skips its
    device-memory queries for ``device == torch.cpu``, which the host does not have either."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def __eq__(self, other: object) -> bool:
        return other is self or other is torch.cpu

    def __hash__(self) -> int:
        return hash(torch.cpu)

    @staticmethod
    def empty_cache() -> None:
        pass


_DEVICE = _CPUDevice("torch.cpu")


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    """verl's platform interface on the host CPU: device ``cpu``, collectives by gloo, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
