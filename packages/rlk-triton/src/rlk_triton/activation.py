"""SwiGLU activation ``silu(gate) * up``: Triton kernels and autograd.

Elementwise: each output depends only on its own gate and up values, computed in fp32 and
rounded once. No reductions, so no launch parameter can change a bit.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl
from rlk_triton.tuning import Rule


@jit(do_not_specialize=["n_rows"])
def _silu_and_mul_fwd_kernel(
    G, U, Y, n_rows, I, stride_g, stride_u, BLOCK_I: tl.constexpr, ROWS: tl.constexpr
):
    # Gate and up rows at their own strides: the halves of one [T, 2I] tensor, or two tensors.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    g, u = g.to(tl.float32), u.to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * I + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit(do_not_specialize=["n_rows"])
def _silu_and_mul_bwd_kernel(
    G,
    U,
    DY,
    DG,
    DU,
    n_rows,
    I,
    stride_g,
    stride_u,
    BLOCK_I: tl.constexpr,
    ROWS: tl.constexpr,
):
    # dG and dU are written at the strides of G and U.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    g_offs = rows[:, None] * stride_g + cols[None, :]
    u_offs = rows[:, None] * stride_u + cols[None, :]
    g = tl.load(G + g_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + u_offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(DG + g_offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + u_offs, du.to(DU.dtype.element_ty), mask=mask)


def _choose(*, rows: int, inter: int) -> int:
    """The widest column block that covers ``inter`` with at most 10% of its lanes past the end
    (4096 wastes 41% of them at I = 4864: 289 us against 231 us for 1024-wide blocks at
    T = 32768 on an H200, ``scripts/kernel_sweep.py --parts silu``)."""
    if inter <= 2048:
        return 0
    for block, index in ((4096, 1), (2048, 3), (1024, 2)):
        if cdiv(inter, block) * block <= 1.1 * inter:
            return index
    return 2


#: block: elements per program (BLOCK_I = min(next_pow2(I), block), the rest is rows).
TUNING = {
    "silu_and_mul.fwd": Rule(
        configs=(
            {"block": 2048, "num_warps": 4},
            {"block": 4096, "num_warps": 8},
            {"block": 1024, "num_warps": 4},
            {"block": 2048, "num_warps": 8},
        ),
        choose=_choose,
    ),
    "silu_and_mul.bwd": Rule(
        configs=(
            {"block": 2048, "num_warps": 4},
            {"block": 4096, "num_warps": 8},
            {"block": 1024, "num_warps": 4},
            {"block": 2048, "num_warps": 8},
        ),
        choose=_choose,
    ),
}


def _launch(kernel, key, table, g, u, *tensors):
    """``kernel`` over gate ``g`` and up ``u`` (``[T, I]`` rows at any stride, unit columns)."""
    T, I = g.shape
    cfg = tuning.config(table, key, rows=T, inter=I)
    block_i = min(next_power_of_2(I), cfg["block"])
    rows = max(1, cfg["block"] // block_i)
    if T > 0:
        grid = (cdiv(T, rows), cdiv(I, block_i))
        kernel[grid](
            g, u, *tensors, T, I, g.stride(0), u.stride(0),
            BLOCK_I=block_i, ROWS=rows, num_warps=cfg["num_warps"],
        )  # fmt: skip


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of ``x [T, 2I]`` (views)."""
    i = x.shape[1] // 2
    return x[:, :i], x[:, i:]


def _forward(x: torch.Tensor, up: torch.Tensor | None, table) -> torch.Tensor:
    """``silu(gate) * up`` of contiguous ``x`` (and ``up``): one launch."""
    g, u = (x, up) if up is not None else _halves(x)
    y = x.new_empty(g.shape)
    _launch(_silu_and_mul_fwd_kernel, "silu_and_mul.fwd", table, g, u, y)
    return y


def _grads(dy, x, up, table):
    """``(dx, dup or None)`` of ``silu_and_mul`` of contiguous ``x`` (and ``up``)."""
    dx = torch.empty_like(x)
    dup = torch.empty_like(up) if up is not None else None
    g, u = (x, up) if up is not None else _halves(x)
    dg, du = (dx, dup) if up is not None else _halves(dx)
    _launch(_silu_and_mul_bwd_kernel, "silu_and_mul.bwd", table, g, u, dy.contiguous(), dg, du)
    return dx, dup


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, up, table):  # contiguous inputs (silu_and_mul)
        y = _forward(x, up, table)
        ctx.save_for_backward(x, up)
        ctx.table = table
        return y

    @staticmethod
    def backward(ctx, dy):
        x, up = ctx.saved_tensors
        return (*_grads(dy, x, up, ctx.table), None)


def _split_forward(x, up=None, *, table):
    return (_forward(x.contiguous(), up.contiguous() if up is not None else None, table),), ()


def _split_backward(grads, outs, extras, needs, x, up=None, *, table):
    return _grads(grads[0], x.contiguous(), up.contiguous() if up is not None else None, table)


#: ``silu_and_mul``'s forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`SiluAndMulFunction`.
AUTOGRAD = {"silu_and_mul": (_split_forward, _split_backward)}


def silu_and_mul(
    x: torch.Tensor, up: torch.Tensor | None = None, *, table: tuning.TuningTable
) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]``, or ``silu(x) * up`` for ``x`` and ``up``
    ``[T, I]``: ``[T, I]`` in ``x.dtype``.

    See :func:`rlk.silu_and_mul`. Computed in fp32, rounded once, by the same kernel for both
    forms; differentiable in ``x`` and ``up``.
    """
    x = x.contiguous()
    up = up.contiguous() if up is not None else None
    if torch.is_grad_enabled() and (x.requires_grad or (up is not None and up.requires_grad)):
        return SiluAndMulFunction.apply(x, up, table)
    # Nothing to differentiate: the forward alone, without an autograd.Function call's host
    # cost; the same kernel, so the same bits.
    return _forward(x, up, table)
