"""Dense layers: linear, rms_norm, silu_and_mul, apply_rotary.

Each computes in float64 and rounds once to the input dtype; autograd through the float64
graph gives the backward (a dtype cast is the identity for gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["linear", "rms_norm", "silu_and_mul", "apply_rotary"]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, table=None
) -> torch.Tensor:
    """``x [T, K] @ weight[N, K].T + bias [N]`` -> ``[T, N]`` in x's dtype."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    table=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x [T, H]`` with ``weight [H]``; with ``residual [T, H]`` returns
    ``(rms_norm(s), s)`` where ``s = x + residual`` rounded to x's dtype. ``x`` may be a heads
    view ``[tokens, heads, H]`` (no residual): normalised as its rows, returned in its shape."""
    if residual is None:
        return _rms(x, weight, eps).to(x.dtype).contiguous()
    s = (x.double() + residual.double()).to(x.dtype)
    return _rms(s, weight, eps).to(x.dtype), s


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None, *, table=None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``: ``[T, 2I]`` -> ``[T, I]``; with ``up``: ``silu(x) * up``."""
    gate, up = x.double().chunk(2, dim=-1) if up is None else (x.double(), up.double())
    return (F.silu(gate) * up).to(x.dtype)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: torch.Tensor | None = None,
    *,
    table=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: ``x [T, H, D]``, ``cos``/``sin [T, D]`` (broadcast over heads); with
    ``k [T, Hk, D]`` returns ``(x', k')``."""
    if k is not None:
        return apply_rotary(x, cos, sin), apply_rotary(k, cos, sin)
    xd = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    cos = cos.double()[:, None, :]
    sin = sin.double()[:, None, :]
    return (xd * cos + rotated * sin).to(x.dtype)
