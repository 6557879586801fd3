"""Rotary position embedding (NeoX / HF rotate-half): Triton kernels and autograd.

``y = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed in fp32
and rounded once. Elementwise in ``x``, so no launch parameter changes a bit. The gradients of
``cos``/``sin`` (only computed when they require grad) sum over heads in ascending order.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import jit, tl, triton
from rlk_triton.tuning import Rule


@jit
def _rotary_kernel(
    X,
    COS,
    SIN,
    Y,
    n_tokens,
    n_heads,
    HALF,
    BACKWARD: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Program (block of tokens, block of heads); tiles [tokens, heads, half]. Elementwise, so
    # the block sizes change no bit. Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.
    # Backward applies the transpose: dx1 = d1 c1 + d2 s2, dx2 = d2 c2 - d1 s1.
    t = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    tc_ok = (t < n_tokens)[:, None] & (cols < HALF)[None, :]  # [tokens, half]
    mask = tc_ok[:, None, :] & (heads < n_heads)[None, :, None]
    cs = t[:, None] * (2 * HALF) + cols[None, :]
    c1 = tl.load(COS + cs, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(COS + cs + HALF, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(SIN + cs, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(SIN + cs + HALF, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    rows = t[:, None] * n_heads + heads[None, :]  # [tokens, heads]
    offs = rows[:, :, None] * (2 * HALF) + cols[None, None, :]
    a1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    a2 = tl.load(X + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = a1 * c1 + a2 * s2
        o2 = a2 * c2 - a1 * s1
    else:
        o1 = a1 * c1 - a2 * s1
        o2 = a2 * c2 + a1 * s2
    tl.store(Y + offs, o1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + offs + HALF, o2.to(Y.dtype.element_ty), mask=mask)


@jit
def _rotary_dcos_dsin_kernel(X, DY, DCOS, DSIN, n_heads, HALF, BLOCK_HALF: tl.constexpr):
    # dcos = sum_h dy * x, dsin = sum_h dy * rotate_half(x), heads in ascending order.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_ok = cols < HALF
    dc1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dc2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    ds1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    ds2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    for h in range(n_heads):
        offs = (t * n_heads + h) * (2 * HALF) + cols
        x1 = tl.load(X + offs, mask=col_ok, other=0.0).to(tl.float32)
        x2 = tl.load(X + offs + HALF, mask=col_ok, other=0.0).to(tl.float32)
        d1 = tl.load(DY + offs, mask=col_ok, other=0.0).to(tl.float32)
        d2 = tl.load(DY + offs + HALF, mask=col_ok, other=0.0).to(tl.float32)
        dc1 += d1 * x1
        dc2 += d2 * x2
        ds1 -= d1 * x2
        ds2 += d2 * x1
    cs = t * (2 * HALF) + cols
    tl.store(DCOS + cs, dc1.to(DCOS.dtype.element_ty), mask=col_ok)
    tl.store(DCOS + cs + HALF, dc2.to(DCOS.dtype.element_ty), mask=col_ok)
    tl.store(DSIN + cs, ds1.to(DSIN.dtype.element_ty), mask=col_ok)
    tl.store(DSIN + cs + HALF, ds2.to(DSIN.dtype.element_ty), mask=col_ok)


def _choose(*, tokens: int, heads: int, head_dim: int) -> int:
    # From scripts/kernel_sweep.py's rotary part on an H200 (q and k as Llama-3-8B and Qwen2.5
    # rotate them): every head of a token per program at head_dim 128; blocks of 16 tokens with
    # 8 heads at head_dim 64, where one token's heads are too little work for a program.
    return 0 if head_dim >= 128 else 1


_CONFIGS = (
    {"heads": 32, "num_warps": 4},
    {"tokens": 16, "heads": 8, "num_warps": 2},
    {"heads": 8, "num_warps": 4},
    {"heads": 4, "num_warps": 2},
)

TUNING = {
    # tokens: tokens per program (1 when absent); heads: heads per program (capped at the next
    # power of two of the head count).
    "apply_rotary.fwd": Rule(configs=_CONFIGS, choose=_choose),
    "apply_rotary.bwd": Rule(configs=_CONFIGS, choose=_choose),
    "apply_rotary.dcos": Rule(configs=({"num_warps": 1}, {"num_warps": 2}, {"num_warps": 4})),
}

#: Under the Triton interpreter (CPU), whose cost is per program and per op: many tokens per
#: program (``tokens``, 1 when absent). Extra candidates, run by the tuning-invariance checks.
_CPU_ROTARY = {"tokens": 64, "heads": 16, "num_warps": 4}
CPU_TUNING = {
    key: tuning.preferring(TUNING[key], _CPU_ROTARY)
    for key in ("apply_rotary.fwd", "apply_rotary.bwd")
}


def _rotate(x, cos, sin, backward, table):
    T, NH, D = x.shape
    y = torch.empty_like(x)
    key = "apply_rotary.bwd" if backward else "apply_rotary.fwd"
    cfg = tuning.config(table, key, tokens=T, heads=NH, head_dim=D)
    block_heads = min(triton.next_power_of_2(NH), cfg["heads"])
    block_tokens = cfg.get("tokens", 1)
    if T > 0 and NH > 0:
        _rotary_kernel[(triton.cdiv(T, block_tokens), triton.cdiv(NH, block_heads))](
            x,
            cos,
            sin,
            y,
            T,
            NH,
            D // 2,
            BACKWARD=backward,
            BLOCK_TOKENS=block_tokens,
            BLOCK_HEADS=block_heads,
            BLOCK_HALF=triton.next_power_of_2(D // 2),
            num_warps=cfg["num_warps"],
        )
    return y


class ApplyRotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, table):
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(x, cos, sin)
        ctx.table = table
        return _rotate(x, cos, sin, False, table)

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _rotate(dy, cos, sin, True, ctx.table) if ctx.needs_input_grad[0] else None
        dcos = dsin = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            T, NH, D = x.shape
            dcos, dsin = torch.empty_like(cos), torch.empty_like(sin)
            cfg = tuning.config(ctx.table, "apply_rotary.dcos", tokens=T, heads=NH, head_dim=D)
            if T > 0:
                _rotary_dcos_dsin_kernel[(T,)](
                    x,
                    dy,
                    dcos,
                    dsin,
                    NH,
                    D // 2,
                    BLOCK_HALF=triton.next_power_of_2(D // 2),
                    num_warps=cfg["num_warps"],
                )
        return dx, dcos, dsin, None


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, table: tuning.TuningTable
) -> torch.Tensor:
    """Rotary embedding of ``x [T, H, D]`` with ``cos``/``sin [T, D]``; see :func:`rlk.apply_rotary`.

    Returns ``[T, H, D]`` in ``x.dtype``. Differentiable in ``x``, ``cos`` and ``sin``.
    """
    return ApplyRotaryFunction.apply(x, cos, sin, table)
