"""What every op of :mod:`rlk.ops` uses: the call to the selected backend and the row view."""

from __future__ import annotations

from typing import Any

import torch

from rlk._plugins import backend_impl


def _call(op: str, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    return backend_impl(device).ops[op](*args, **kwargs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # A 2-D tensor as it is: a reshape is a few microseconds of host time per call.
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _unrows(y: torch.Tensor, *shape: int) -> torch.Tensor:
    return y if y.dim() == len(shape) else y.reshape(shape)
