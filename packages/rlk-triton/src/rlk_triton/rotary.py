"""Rotary position embedding (NeoX / HF rotate-half): Triton kernels and autograd.

``y = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed in fp32
and rounded once. Elementwise in ``x``, so no launch parameter changes a bit. The gradients of
``cos``/``sin`` (only computed when they require grad) sum over heads in ascending order.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl
from rlk_triton.tuning import Rule


@jit
def _rotate_tile(
    X, Y, t, tc_ok, c1, c2, s1, s2, heads, n_heads, cols, HALF, stride_x, stride_y,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    # Rotates the tile [tokens, heads, half] of X [T, n_heads, 2 * HALF] into Y, each with its
    # own token stride (heads and head_dim contiguous: a column slice of a fused qkv product).
    # Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2.
    # Backward applies the transpose: dx1 = d1 c1 + d2 s2, dx2 = d2 c2 - d1 s1.
    mask = tc_ok[:, None, :] & (heads < n_heads)[None, :, None]
    in_head = heads[None, :, None] * (2 * HALF) + cols[None, None, :]  # [1, heads, half]
    offs = t[:, None, None] * stride_x + in_head
    a1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    a2 = tl.load(X + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    offs = t[:, None, None] * stride_y + in_head
    if BACKWARD:
        o1 = a1 * c1 + a2 * s2
        o2 = a2 * c2 - a1 * s1
    else:
        o1 = a1 * c1 - a2 * s1
        o2 = a2 * c2 + a1 * s2
    tl.store(Y + offs, o1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + offs + HALF, o2.to(Y.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    X,
    Y,
    K,
    KY,
    COS,
    SIN,
    n_tokens,
    n_heads,
    k_heads,
    HALF,
    stride_x,
    stride_y,
    stride_k,
    stride_ky,
    BACKWARD: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HEADS_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Program (block of tokens, head block j): X's head block j and, when it has one, K's head
    # block j (k_heads = 0: no K), with cos and sin loaded once for both. Elementwise, so the
    # block sizes change no bit, and a tensor rotated with another is rotated as alone. The
    # head blocks of a token block are consecutive programs, so the ones after the first find
    # that block's cos and sin in L2 (a 2D grid would run every token block's head block 0
    # first, and its last head block after the whole tensor had streamed through L2).
    pid = tl.program_id(0)
    t = (pid // HEAD_BLOCKS).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    j = pid % HEAD_BLOCKS
    cols = tl.arange(0, BLOCK_HALF)
    tc_ok = (t < n_tokens)[:, None] & (cols < HALF)[None, :]  # [tokens, half]
    cs = t[:, None] * (2 * HALF) + cols[None, :]
    c1 = tl.load(COS + cs, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(COS + cs + HALF, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(SIN + cs, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(SIN + cs + HALF, mask=tc_ok, other=0.0).to(tl.float32)[:, None, :]
    if j * BLOCK_HEADS < n_heads:
        heads = j * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        _rotate_tile(X, Y, t, tc_ok, c1, c2, s1, s2, heads, n_heads, cols, HALF, stride_x,
                     stride_y, BACKWARD)  # fmt: skip
    if j * BLOCK_HEADS_K < k_heads:
        heads_k = j * BLOCK_HEADS_K + tl.arange(0, BLOCK_HEADS_K)
        _rotate_tile(K, KY, t, tc_ok, c1, c2, s1, s2, heads_k, k_heads, cols, HALF, stride_k,
                     stride_ky, BACKWARD)  # fmt: skip


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


def _rotate(x, k, cos, sin, backward, table):
    """``(rotate(x), rotate(k) or None)`` in one launch (the transpose when ``backward``).
    ``x`` and ``k`` as :func:`_token_rows` leaves them; the outputs are ``empty_like``'s."""
    T, NH, D = x.shape
    NK = k.shape[1] if k is not None else 0
    y = torch.empty_like(x)
    ky = torch.empty_like(k) if k is not None else None
    key = "apply_rotary.bwd" if backward else "apply_rotary.fwd"
    cfg = tuning.config(table, key, tokens=T, heads=NH, head_dim=D)
    block_heads = min(next_power_of_2(max(NH, 1)), cfg["heads"])
    block_heads_k = min(next_power_of_2(max(NK, 1)), cfg["heads"])
    block_tokens = cfg.get("tokens", 1)
    head_blocks = max(cdiv(NH, block_heads), cdiv(NK, block_heads_k))
    if T > 0 and head_blocks > 0:
        _rotary_kernel[(cdiv(T, block_tokens) * head_blocks,)](
            x,
            y,
            k if k is not None else x,
            ky if ky is not None else y,
            cos,
            sin,
            T,
            NH,
            NK,
            D // 2,
            x.stride(0),
            y.stride(0),
            k.stride(0) if k is not None else 0,
            ky.stride(0) if ky is not None else 0,
            BACKWARD=backward,
            HEAD_BLOCKS=head_blocks,
            BLOCK_TOKENS=block_tokens,
            BLOCK_HEADS=block_heads,
            BLOCK_HEADS_K=block_heads_k,
            BLOCK_HALF=next_power_of_2(D // 2),
            num_warps=cfg["num_warps"],
        )
    return y, ky


def _dcos_dsin(x, dy, cos, sin, table):
    """``(dcos, dsin)`` of one rotated tensor: sums over its heads in ascending order."""
    T, NH, D = x.shape
    dcos, dsin = torch.empty_like(cos), torch.empty_like(sin)
    cfg = tuning.config(table, "apply_rotary.dcos", tokens=T, heads=NH, head_dim=D)
    if T > 0:
        _rotary_dcos_dsin_kernel[(T,)](
            x,
            dy,
            dcos,
            dsin,
            NH,
            D // 2,
            BLOCK_HALF=next_power_of_2(D // 2),
            num_warps=cfg["num_warps"],
        )
    return dcos, dsin


def _grads(dy, dky, x, cos, sin, k, needs, table):
    """``(dx, dcos, dsin, dk)``, each None unless ``needs`` (x, cos, sin, k) asks."""
    need_x, need_cs, need_k = needs[0], needs[1] or needs[2], k is not None and needs[3]
    dy = dy.contiguous()
    dky = dky.contiguous() if need_k or (need_cs and k is not None) else None
    dx = dk = None
    if need_x or need_k:
        dx, dk = _rotate(dy, dky if need_k else None, cos, sin, True, table)
    dcos = dsin = None
    if need_cs:
        # As two separate calls: each tensor's sum over its heads, then their sum (autograd
        # would add the two uses' gradients; two fp32 terms add alike in either order).
        dcos, dsin = _dcos_dsin(x, dy, cos, sin, table)
        if k is not None:
            dcos_k, dsin_k = _dcos_dsin(k, dky, cos, sin, table)
            dcos, dsin = dcos + dcos_k, dsin + dsin_k
    return (dx if need_x else None), dcos, dsin, dk


class ApplyRotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, k, table):  # contiguous inputs (apply_rotary)
        ctx.save_for_backward(x, cos, sin, k)
        ctx.table = table
        y, ky = _rotate(x, k, cos, sin, False, table)
        return y if k is None else (y, ky)

    @staticmethod
    def backward(ctx, dy, dky=None):
        x, cos, sin, k = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (*_grads(dy, dky, x, cos, sin, k, (needs[0], *needs[1:4]), ctx.table), None)


def _token_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t [T, H, D]`` as the kernel reads it: any token stride, heads and head_dim
    contiguous (q or k as column views of a fused qkv product are read in place); any other
    layout is copied first."""
    if t is None or (t.stride(2) == 1 and t.stride(1) == t.shape[2]):
        return t
    return t.contiguous()


def _contiguous(x, cos, sin, k):
    return x.contiguous(), cos.contiguous(), sin.contiguous(), (k if k is None else k.contiguous())


def _split_forward(x, cos, sin, k=None, *, table):
    x, cos, sin, k = _contiguous(x, cos, sin, k)
    y, ky = _rotate(x, k, cos, sin, False, table)
    return ((y,) if k is None else (y, ky)), ()


def _split_backward(grads, outs, extras, needs, x, cos, sin, k=None, *, table):
    x, cos, sin, k = _contiguous(x, cos, sin, k)
    dy = torch.zeros_like(x) if grads[0] is None else grads[0]
    dky = None
    if k is not None:
        dky = torch.zeros_like(k) if grads[1] is None else grads[1]
    return _grads(dy, dky, x, cos, sin, k, needs, table)


#: ``apply_rotary``'s forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`ApplyRotaryFunction`.
AUTOGRAD = {"apply_rotary": (_split_forward, _split_backward)}


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: torch.Tensor | None = None,
    *,
    table: tuning.TuningTable,
):
    """Rotary embedding of ``x [T, H, D]`` (and ``k [T, Hk, D]``) with ``cos``/``sin [T, D]``;
    see :func:`rlk.apply_rotary`.

    Returns ``[T, H, D]`` in ``x.dtype``, or ``(x', k')`` with ``k``: one launch, each bitwise
    the result of its own call. Differentiable in ``x``, ``k``, ``cos`` and ``sin``.
    """
    cos, sin = cos.contiguous(), sin.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, cos, sin, k)):
        x, k = x.contiguous(), (k.contiguous() if k is not None else None)
        return ApplyRotaryFunction.apply(x, cos, sin, k, table)
    # Nothing to differentiate: the forward alone, without an autograd.Function call's host
    # cost; the same kernel, so the same bits. x and k keep their token stride.
    y, ky = _rotate(_token_rows(x), _token_rows(k), cos, sin, False, table)
    return y if k is None else (y, ky)
