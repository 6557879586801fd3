"""SwiGLU activation ``silu(gate) * up``: Triton kernels and autograd.

Elementwise: each output depends only on its own gate and up values, computed in fp32 and
rounded once. No reductions, so no launch parameter can change a bit.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import jit, tl, triton
from rlk_triton.tuning import Rule


@jit(do_not_specialize=["n_rows"])
def _silu_and_mul_fwd_kernel(X, Y, n_rows, I, BLOCK_I: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    x_offs = rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    g = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + x_offs + I, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    y_offs = rows.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(Y + y_offs, y.to(Y.dtype.element_ty), mask=mask)


@jit(do_not_specialize=["n_rows"])
def _silu_and_mul_bwd_kernel(X, DY, DX, n_rows, I, BLOCK_I: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    x_offs = rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    y_offs = rows.to(tl.int64)[:, None] * I + cols[None, :]
    g = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + x_offs + I, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + y_offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(DX + x_offs, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + x_offs + I, du.to(DX.dtype.element_ty), mask=mask)


def _choose(*, rows: int, inter: int) -> int:
    """The widest column block that covers ``inter`` with at most 10% of its lanes past the end
    (4096 wastes 41% of them at I = 4864: 289 us against 231 us for 1024-wide blocks at
    T = 32768 on an H200, ``scripts/kernel_sweep.py --parts silu``)."""
    if inter <= 2048:
        return 0
    for block, index in ((4096, 1), (2048, 3), (1024, 2)):
        if triton.cdiv(inter, block) * block <= 1.1 * inter:
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


def _launch(kernel, key, table, x, *tensors):
    T, I = x.shape[0], x.shape[1] // 2
    cfg = tuning.config(table, key, rows=T, inter=I)
    block_i = min(triton.next_power_of_2(I), cfg["block"])
    rows = max(1, cfg["block"] // block_i)
    if T > 0:
        grid = (triton.cdiv(T, rows), triton.cdiv(I, block_i))
        kernel[grid](x, *tensors, T, I, BLOCK_I=block_i, ROWS=rows, num_warps=cfg["num_warps"])


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, table):
        x = x.contiguous()
        y = x.new_empty(x.shape[0], x.shape[1] // 2)
        _launch(_silu_and_mul_fwd_kernel, "silu_and_mul.fwd", table, x, y)
        ctx.save_for_backward(x)
        ctx.table = table
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        _launch(_silu_and_mul_bwd_kernel, "silu_and_mul.bwd", ctx.table, x, dy.contiguous(), dx)
        return dx, None


def silu_and_mul(x: torch.Tensor, *, table: tuning.TuningTable) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` -> ``[T, I]`` in ``x.dtype``.

    See :func:`rlk.silu_and_mul`. Computed in fp32, rounded once; differentiable in ``x``.
    """
    return SiluAndMulFunction.apply(x, table)
