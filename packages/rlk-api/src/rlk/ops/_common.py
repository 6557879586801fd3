"""What every op of :mod:`rlk.ops` uses: the call to the selected backend, the row view, and
the empty tensors of the operators' output shapes (:class:`rlk._catalog.Operator`)."""

from __future__ import annotations

from typing import Any

import torch

from rlk.selection import backend_impl


def _call(op: str, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    return backend_impl(device).ops[op](*args, **kwargs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # A 2-D tensor as it is: a reshape is a few microseconds of host time per call.
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _unrows(y: torch.Tensor, *shape: int) -> torch.Tensor:
    return y if y.dim() == len(shape) else y.reshape(shape)


def f32(*shape: int, like: torch.Tensor) -> torch.Tensor:
    """An empty fp32 tensor of ``shape`` on ``like``'s device."""
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def rows_out(t: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``[t.shape[0], cols]`` tensor of ``dtype`` on ``t``'s device."""
    return torch.empty((t.shape[0], cols), dtype=dtype, device=t.device)
