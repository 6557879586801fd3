"""RMSNorm, optionally fused with the residual add before it: Triton kernels and autograd.

Numerics (docs/guide.md, "The numerics contract"):

- A row is normalised in fp32 and rounded once at the store. With a residual, ``s = x + residual``
  is rounded to ``x.dtype`` first and the norm reads the rounded ``s``, so the fused op equals
  ``rms_norm(x + residual)`` bitwise.
- Row sums (the sum of squares; ``sum(dy * w * x_hat)`` in backward) have one value whatever
  tree ``tl.sum`` uses, and that tree changes with ``num_warps``, the rows per program and the
  vector width of the loads. This is what makes those launch parameters safe to tune. A row's
  terms are first added in groups of ``2**PAIR_LEVELS`` adjacent columns by a fixed binary tree
  (:func:`~rlk_triton.logprobs.pair_sums`: ``a + b == b + a`` in IEEE arithmetic, so a pair has
  one sum whichever thread adds it); the group sums are then added *exactly*
  (:func:`_exact_sum`): each becomes a 64-bit fixed-point integer scaled to the row's largest,
  and integers add associatively. The groups make the costly exact part 8x smaller. Rows longer
  than ``MAX_BLOCK`` are summed in chunks of ``MAX_BLOCK`` columns (as above within a chunk,
  chunks added in ascending order in fp32).
- The weight gradient sums ``dy * x_hat`` over rows without atomics: each block of
  ``_dw_rows(H)`` consecutive rows (:data:`DW_ROWS`, or :data:`DW_ROWS_WIDE` for rows of
  2049 to 4096 columns) gives a partial, its rows added one after the other in ascending order
  in fp32, and :func:`_sum_partials` adds the partials exactly in groups of ``DW_GROUP``, level
  after level. The partition is set by these constants and ``H``; never by tuning or the GPU.
- A row's input gradients depend only on that row.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import jit, next_power_of_2, tl
from rlk_triton.logprobs import pair_sums
from rlk_triton.tuning import Rule

#: Longest row held in registers; longer rows are processed in chunks of this many columns.
MAX_BLOCK = 8192
#: Levels of the fixed pairwise tree that adds a row's terms in groups of 2**PAIR_LEVELS adjacent
#: columns before the exact sum (part of the numerics: the group sums are what is summed).
PAIR_LEVELS = 3
#: Rows per weight-gradient partial (the fixed row partition of dweight): DW_ROWS, and
#: DW_ROWS_WIDE for rows of 2049 to 4096 columns (fewer partials to write and sum where each is
#: long). Rows of 8192 columns per block are back at DW_ROWS: a 4096-token batch then has 128
#: programs rather than 64 for 132 SMs (H200, scripts/kernel_sweep.py --parts normbwd at
#: T = 4096, H = 8192: 122.9 -> 77.5 us for the whole backward).
DW_ROWS = 32
DW_ROWS_WIDE = 64
#: Partials added together per program when combining dweight partials.
DW_GROUP = 64

# Fraction bits of the fixed-point terms in _exact_sum: terms below 2^-40 of the row's largest
# are truncated. A term is < 2^41, so int64 cannot overflow for rows shorter than 2^22.
_FRAC_BITS = tl.constexpr(40)


def _block(H: int) -> int:
    return min(next_power_of_2(H), MAX_BLOCK)


def _levels(block_h: int) -> int:
    # A block narrower than a group (H < 8) is one group.
    return min(PAIR_LEVELS, block_h.bit_length() - 1)


def _dw_rows(block_h: int) -> int:
    return DW_ROWS_WIDE if 2048 < block_h <= 4096 else DW_ROWS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@jit
def _pow2(k):
    # 2^k as fp32 for an int32 tensor k in [-126, 127], built from its exponent bits.
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@jit
def _fixed_point_sum(v, m_bits, AXIS: tl.constexpr):
    # The int64 sum of _exact_sum over finite ``v`` whose largest magnitude has the fp32 bits
    # ``m_bits`` (per row along AXIS).
    # floor(log2(m)) from the exponent bits; -127 for zero and subnormals, which still fit.
    e = ((m_bits >> 23) & 0xFF) - 127
    # The shift can exceed fp32's exponent range, so apply it as two exact factors.
    shift = _FRAC_BITS - e
    a = shift >> 1
    b = shift - a
    up = tl.expand_dims(_pow2(a), AXIS) * v
    q = (up * tl.expand_dims(_pow2(b), AXIS)).to(tl.int64)
    return tl.sum(q, axis=AXIS).to(tl.float32) * _pow2(-a) * _pow2(-b)


@jit
def _exact_sum(v, AXIS: tl.constexpr):
    """Sum of fp32 ``v`` along ``AXIS`` whose bits do not depend on the order of the additions.

    Each finite term is scaled by a power of two so that the largest becomes [2^40, 2^41),
    truncated to int64 and the integers are added (exact, so any tree gives the same total);
    the total is rounded to fp32 once and scaled back. Infinities and NaNs are summed apart,
    over the non-finite terms only, which is order-free too (inf, -inf or nan).
    """
    finite = (v == v) & (tl.abs(v) != float("inf"))
    special = tl.sum(tl.where(finite, 0.0, v), axis=AXIS)
    v = tl.where(finite, v, 0.0)
    m = tl.max(tl.abs(v), axis=AXIS)
    total = _fixed_point_sum(v, m.to(tl.int32, bitcast=True), AXIS)
    return tl.where(special == 0.0, total, special)


@jit
def _exact_sum_or_masked(v, AXIS: tl.constexpr):
    """:func:`_exact_sum`, cheaper where every term is finite (the forward's case).

    The largest magnitude is taken on the fp32 bits as integers (positive floats order as
    their bits do; +inf is 0x7F800000 and NaNs lie above), so one max tells whether a term is
    non-finite. Only blocks that hold one pay for the masks; the finite path gives the very
    integers the masked one does, so the branch never changes a bit.
    """
    m_bits = tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=AXIS)
    if tl.max(m_bits) < 0x7F800000:
        total = _fixed_point_sum(v, m_bits, AXIS)
    else:
        total = _exact_sum(v, AXIS)
    return total


@jit
def _rescue_inv(ss, amax):
    """Rows whose sum of squares overflowed to +inf although every element is finite (|x| above
    about 1.8e19): the power of two that brings their largest magnitude into [1, 4), by which
    they are multiplied (exactly) before squaring; 0 for every other row."""
    over = (ss == float("inf")) & (amax < float("inf"))
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # >= 64 where over
    return tl.where(over, _pow2(tl.where(over, tl.maximum(-e, -126), 0)), 0.0)


@jit
def _load_input(X, R, S, x_offs, offs, mask, HAS_RESIDUAL: tl.constexpr,
                STORE_S: tl.constexpr):  # fmt: skip
    # X at x_offs (a heads view's own layout), R and S at the rows' contiguous offs.
    x = tl.load(X + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        if STORE_S:
            tl.store(S + offs, x, mask=mask)
    return x.to(tl.float32)


@jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    X,
    R,
    W,
    Y,
    S,
    RSTD,
    n_rows,
    H,
    eps,
    x_heads,
    stride_xt,
    HAS_RESIDUAL: tl.constexpr,
    HEADS_VIEW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    LEVELS: tl.constexpr,
):
    # HEADS_VIEW: row r of X is head r % x_heads of token r // x_heads, tokens stride_xt apart
    # (q or k as a column view of a fused q/k/v product). Otherwise X's rows are contiguous,
    # as Y's, R's and S's always are.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    base = rows.to(tl.int64)[:, None] * H
    x_base = base
    if HEADS_VIEW:
        rows64 = rows.to(tl.int64)
        x_base = ((rows64 // x_heads) * stride_xt + (rows64 % x_heads) * H)[:, None]
    cols = tl.arange(0, BLOCK_H)
    if NUM_CHUNKS == 1:
        mask = row_ok[:, None] & (cols < H)[None, :]
        offs = base + cols[None, :]
        x = _load_input(X, R, S, x_base + cols[None, :], offs, mask, HAS_RESIDUAL, True)
        ss = _exact_sum_or_masked(pair_sums(x * x, LEVELS), 1)
        rstd = tl.rsqrt(ss / H + eps)
        # Squares of finite inputs can overflow where the float64 reference does not: such rows
        # are summed again scaled by a power of two (exact), and only they (the bits of every
        # other row are unchanged). Tiles without an infinite sum skip this.
        if tl.sum((ss == float("inf")).to(tl.int32)) > 0:
            inv = _rescue_inv(ss, tl.max(tl.abs(x), 1))
            xs = x * inv[:, None]
            ss_s = _exact_sum(pair_sums(xs * xs, LEVELS), 1)
            rs = tl.rsqrt(ss_s / H + eps * inv * inv) * inv
            rstd = tl.where(inv > 0, rs, rstd)
        w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    else:
        ss = tl.zeros([ROWS], dtype=tl.float32)
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_H + cols
            mask = row_ok[:, None] & (ccols < H)[None, :]
            x = _load_input(X, R, S, x_base + ccols[None, :], base + ccols[None, :], mask,
                            HAS_RESIDUAL, True)  # fmt: skip
            ss += _exact_sum_or_masked(pair_sums(x * x, LEVELS), 1)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
        rstd = tl.rsqrt(ss / H + eps)
        # Rows whose squares overflowed: summed again scaled by a power of two (see above).
        inv = _rescue_inv(ss, amax)
        if tl.max(inv, 0) > 0:
            ss2 = tl.zeros([ROWS], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                ccols = c * BLOCK_H + cols
                mask = row_ok[:, None] & (ccols < H)[None, :]
                x = _load_input(X, R, S, x_base + ccols[None, :], base + ccols[None, :], mask,
                                HAS_RESIDUAL, False)  # fmt: skip
                xs = x * inv[:, None]
                ss2 += _exact_sum(pair_sums(xs * xs, LEVELS), 1)
            rs = tl.rsqrt(ss2 / H + eps * inv * inv) * inv
            rstd = tl.where(inv > 0, rs, rstd)
        for c in range(NUM_CHUNKS):
            ccols = c * BLOCK_H + cols
            mask = row_ok[:, None] & (ccols < H)[None, :]
            offs = base + ccols[None, :]
            # Recomputes s from x and residual rather than rereading S that other threads wrote.
            x = _load_input(X, R, S, x_base + ccols[None, :], offs, mask, HAS_RESIDUAL, False)
            w = tl.load(W + ccols, mask=ccols < H, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * w[None, :]
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@jit
def _rms_norm_bwd_c_kernel(
    DY, X, W, RSTD, C, H, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr, LEVELS: tl.constexpr
):
    # Long rows only: c = sum(dy * w * x_hat) / H of one row, chunks in ascending order.
    row = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    rstd = tl.load(RSTD + row)
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([1], dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        ccols = c * BLOCK_H + cols
        col_ok = ccols < H
        offs = row[:, None] * H + ccols[None, :]
        dy = tl.load(DY + offs, mask=col_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=col_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + ccols, mask=col_ok, other=0.0).to(tl.float32)
        acc += _exact_sum_or_masked(pair_sums(dy * w[None, :] * (x * rstd[:, None]), LEVELS), 1)
    tl.store(C + row, acc / H)


@jit(do_not_specialize=["n_rows"])
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    C,
    DS,
    DX,
    DWP,
    n_rows,
    H,
    HAS_DS: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    DW_ROWS: tl.constexpr,
    LEVELS: tl.constexpr,
):
    # Program (block, chunk): rows [block * DW_ROWS, +DW_ROWS), columns of one chunk, a row at
    # a time (a tile of several rows would hold several rows of dweight terms in registers:
    # 230 registers per thread and 12% occupancy at H = 896 on the H200).
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([1, BLOCK_H], dtype=tl.float32)
    for i in range(DW_ROWS):
        rows = block * DW_ROWS + i + tl.arange(0, 1)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        if NUM_CHUNKS == 1:
            c = _exact_sum_or_masked(pair_sums(g * x_hat, LEVELS), 1) / H
        else:
            c = tl.load(C + rows, mask=row_ok, other=0.0)
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            acc += dy * x_hat
    if COMPUTE_DW:
        # A sum over a single row: the row itself, in any order.
        tl.store(DWP + block.to(tl.int64) * H + cols, tl.sum(acc, 0), mask=col_ok)


@jit
def _group_sum(IN, g, n_in, H, cols, GROUP: tl.constexpr):
    # The exact sum of IN[g * GROUP : (g + 1) * GROUP, cols] (rows past n_in add zeros).
    rows = g * GROUP + tl.arange(0, GROUP)
    mask = (rows < n_in)[:, None] & (cols < H)[None, :]
    p = tl.load(IN + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0.0)
    return _exact_sum_or_masked(p, 0)


@jit(do_not_specialize=["n_in"])
def _sum_groups_kernel(IN, OUT, n_in, H, GROUP: tl.constexpr, BLOCK_C: tl.constexpr):
    # OUT[g, cols] = exact sum of IN[g * GROUP : (g + 1) * GROUP, cols].
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    out = _group_sum(IN, g, n_in, H, cols, GROUP)
    tl.store(OUT + g.to(tl.int64) * H + cols, out.to(OUT.dtype.element_ty), mask=cols < H)


@jit(do_not_specialize=["n_in"])
def _sum_two_levels_kernel(IN, OUT, n_in, H, GROUP: tl.constexpr, BLOCK_C: tl.constexpr):
    # Both levels of _sum_groups_kernel in one launch, for at most GROUP groups: the exact sum
    # of each group of GROUP rows, rounded to fp32 as the first level stores it, then the exact
    # sum of those (the second level's one group, padded with zeros as its masked load is).
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    gi = tl.arange(0, GROUP)
    level = tl.zeros([GROUP, BLOCK_C], dtype=tl.float32)
    for g in range(0, tl.cdiv(n_in, GROUP)):
        level = tl.where(gi[:, None] == g, _group_sum(IN, g, n_in, H, cols, GROUP)[None, :], level)
    tl.store(OUT + cols, _exact_sum_or_masked(level, 0).to(OUT.dtype.element_ty), mask=cols < H)


# --------------------------------------------------------------------------------------------
# Tuning: launch parameters only. Thanks to _exact_sum none of them changes a bit.
# --------------------------------------------------------------------------------------------


def _choose_fwd(*, rows: int, hidden: int) -> int:
    # H200, scripts/kernel_sweep.py --parts norm: one row per program up to H = 2048, on one
    # warp up to 1024 columns (59 us at T = 65536, H = 896, against 73 us for two rows on 4
    # warps) and on two up to 2048 (130 us at T = 65536, H = 2048, against 135 us); 2048
    # elements and 4 warps up to 4096 (68 us at T = 16384, H = 4096, as fast as 4096 elements);
    # one row of 8192 on 8 warps (38.6 us at T = 4096, H = 8192, against 50.0 on 16 warps and
    # 57.8 for two rows on 8).
    block = _block(hidden)
    if block <= 1024:
        return 5  # 1024 elements (one row), 1 warp
    if block <= 2048:
        return 6  # one row, 2 warps
    if block <= 4096:
        return 0  # 2048 elements per program, 4 warps
    return 3  # 8192, 8 warps


def _choose_bwd(*, rows: int, hidden: int) -> int:
    # H200, scripts/kernel_sweep.py --parts normbwd (the whole backward): 1 warp up to 1024
    # columns (118 us at T = 65536, H = 896, against 121 us on 4 warps), 4 up to 2048 (253 us
    # at T = 65536, H = 2048), 8 up to 4096 (143 us at T = 16384, H = 4096, against 145 us),
    # 16 beyond (77.5 us at T = 4096, H = 8192, against 78.3 on 8).
    block = _block(hidden)
    if block <= 1024:
        return 3
    return 0 if block <= 2048 else (1 if block <= 4096 else 2)


TUNING = {
    # tile: elements per program (rows per program = tile // BLOCK_H, at least one row).
    "rms_norm.fwd": Rule(
        configs=(
            {"tile": 2048, "num_warps": 4},
            {"tile": 4096, "num_warps": 4},
            {"tile": 4096, "num_warps": 8},
            {"tile": 8192, "num_warps": 8},
            {"tile": 8192, "num_warps": 16},
            {"tile": 1024, "num_warps": 1},
            {"tile": 1024, "num_warps": 2},
        ),
        choose=_choose_fwd,
    ),
    "rms_norm.bwd": Rule(
        configs=({"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}, {"num_warps": 1}),
        choose=_choose_bwd,
    ),
    # The dweight partial sums: 16 columns on 2 warps per program at every H measured (H200,
    # kernel_sweep.py --parts normbwd: 7.1 against 13.8 us for 64 columns at T = 16384,
    # H = 4096; 10.3 against 12.1 us for 32 at T = 65536, H = 2048).
    "rms_norm.dw": Rule(
        configs=(
            {"block_c": 16, "num_warps": 2},
            {"block_c": 32, "num_warps": 4},
            {"block_c": 64, "num_warps": 8},
        ),
    ),
}


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _forward(x, weight, eps, residual, table):
    """``(y, s or None, rstd)``. ``x``: contiguous rows ``[T, H]``, or (no residual) a heads
    view ``[tokens, heads, H]`` with any token stride (``y`` then ``[tokens, heads, H]``)."""
    H = x.shape[-1]
    heads, stride_xt = (x.shape[1], x.stride(0)) if x.dim() == 3 else (1, H)
    T = x.numel() // H
    block = _block(H)
    cfg = tuning.config(table, "rms_norm.fwd", rows=T, hidden=H)
    rows = max(1, cfg["tile"] // block)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    if T > 0:
        _rms_norm_fwd_kernel[(_cdiv(T, rows),)](
            x,
            residual if residual is not None else x,
            weight,
            y,
            s if s is not None else y,
            rstd,
            T,
            H,
            eps,
            heads,
            stride_xt,
            HAS_RESIDUAL=residual is not None,
            HEADS_VIEW=x.dim() == 3,
            BLOCK_H=block,
            NUM_CHUNKS=_cdiv(H, block),
            ROWS=rows,
            LEVELS=_levels(block),
            num_warps=cfg["num_warps"],
        )
    return y, s, rstd


#: Most first-level groups that one launch sums with the second level (a program per column
#: block adds them in sequence): up to this many, two levels cost one launch; beyond, a launch
#: per level spreads the groups over programs.
TWO_LEVELS_MAX_GROUPS = 16


def _sum_partials(part: torch.Tensor, dtype: torch.dtype, table) -> torch.Tensor:
    """Column sums of fp32 ``part [P, H]`` in ``dtype``: exact sums of fixed groups, per level
    (two levels in one launch when the first has 2 to :data:`TWO_LEVELS_MAX_GROUPS` groups;
    the same bits)."""
    H = part.shape[1]
    while True:
        n = part.shape[0]
        groups = _cdiv(n, DW_GROUP)
        cfg = tuning.config(table, "rms_norm.dw", partials=n, hidden=H)
        if 2 <= groups <= TWO_LEVELS_MAX_GROUPS:
            out = torch.empty(H, dtype=dtype, device=part.device)
            _sum_two_levels_kernel[(_cdiv(H, cfg["block_c"]),)](
                part, out, n, H, GROUP=DW_GROUP, BLOCK_C=cfg["block_c"],
                num_warps=cfg["num_warps"],
            )  # fmt: skip
            return out
        out = torch.empty(
            groups, H, dtype=dtype if groups == 1 else torch.float32, device=part.device
        )
        _sum_groups_kernel[(groups, _cdiv(H, cfg["block_c"]))](
            part,
            out,
            n,
            H,
            GROUP=DW_GROUP,
            BLOCK_C=cfg["block_c"],
            num_warps=cfg["num_warps"],
        )
        if groups == 1:
            return out[0]
        part = out


def _backward(dy, ds, x, weight, rstd, need_dw, table):
    T, H = x.shape
    block = _block(H)
    chunks = _cdiv(H, block)
    cfg = tuning.config(table, "rms_norm.bwd", rows=T, hidden=H)
    dx = torch.empty_like(x)
    if T == 0:
        dw = torch.zeros_like(weight) if need_dw else None
        return dx, dw
    dw_rows = _dw_rows(block)
    blocks = _cdiv(T, dw_rows)
    part = torch.empty(blocks, H, dtype=torch.float32, device=x.device) if need_dw else rstd
    c = rstd
    if chunks > 1:
        c = torch.empty_like(rstd)
        _rms_norm_bwd_c_kernel[(T,)](
            dy, x, weight, rstd, c, H, BLOCK_H=block, NUM_CHUNKS=chunks, LEVELS=_levels(block),
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    _rms_norm_bwd_kernel[(blocks, chunks)](
        dy,
        x,
        weight,
        rstd,
        c,
        ds if ds is not None else dy,
        dx,
        part,
        T,
        H,
        HAS_DS=ds is not None,
        COMPUTE_DW=need_dw,
        BLOCK_H=block,
        NUM_CHUNKS=chunks,
        DW_ROWS=dw_rows,
        LEVELS=_levels(block),
        num_warps=cfg["num_warps"],
    )
    dw = _sum_partials(part, weight.dtype, table) if need_dw else None
    return dx, dw


def _grads(dy, ds, xs, weight, rstd, has_residual, needs, table):
    """``(dx, dweight, dresidual)`` from the gradients of ``y`` and ``s`` (None: none), the
    normalised input ``xs`` (``s`` with a residual, else ``x``) and ``rstd``."""
    dy = torch.zeros_like(xs) if dy is None else dy.contiguous()
    if ds is not None:
        ds = ds.contiguous()
    dx, dw = _backward(dy, ds, xs, weight, rstd, needs[1], table)
    return dx, dw, (dx if has_residual and needs[2] else None)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual, table):  # contiguous inputs (rms_norm)
        y, s, rstd = _forward(x, weight, eps, residual, table)
        ctx.has_residual = residual is not None
        ctx.table = table
        ctx.save_for_backward(s if s is not None else x, weight, rstd)
        ctx.set_materialize_grads(False)
        return y if s is None else (y, s)

    @staticmethod
    def backward(ctx, dy, ds=None):
        x, weight, rstd = ctx.saved_tensors
        needs = (None, ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        dx, dw, dres = _grads(dy, ds, x, weight, rstd, ctx.has_residual, needs, ctx.table)
        return dx, dw, None, dres, None


def _split_forward(x, weight, eps, residual, *, table):
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    y, s, rstd = _forward(x, weight, eps, residual, table)
    return ((y,) if s is None else (y, s)), (rstd,)


def _split_backward(grads, outs, extras, needs, x, weight, eps, residual, *, table):
    has_residual = residual is not None
    xs = outs[1] if has_residual else x.contiguous()
    ds = grads[1] if has_residual else None
    return _grads(grads[0], ds, xs, weight.contiguous(), extras[0], has_residual, needs, table)


#: ``rms_norm``'s forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`RMSNormFunction`; the extra is ``rstd``.
AUTOGRAD = {"rms_norm": (_split_forward, _split_backward)}


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    *,
    table: tuning.TuningTable,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of ``x [T, H]`` with ``weight [H]``; see :func:`rlk.rms_norm`.

    Returns ``y [T, H]`` in ``x.dtype``; with ``residual [T, H]`` returns ``(y, s)`` where
    ``s = x + residual`` rounded to ``x.dtype`` and ``y = rms_norm(s)``. Differentiable in
    ``x``, ``weight`` and ``residual``; the weight gradient has ``weight.dtype``.

    ``x`` may also be a heads view ``[tokens, heads, H]`` (no residual; any token stride, heads
    and H contiguous): its rows are read in place where nothing is differentiated, and
    ``y [tokens, heads, H]`` is returned.
    """
    if x.dim() == 3:
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return _forward(x, weight.contiguous(), eps, None, table)[0]
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, None, table=table).view(x.shape)
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (residual is not None and residual.requires_grad)
    ):
        return RMSNormFunction.apply(x, weight, eps, residual, table)
    # Nothing to differentiate (inference, a rollout): the forward alone, without the host
    # cost of an autograd.Function call; the same kernel, so the same bits.
    y, s, _ = _forward(x, weight, eps, residual, table)
    return y if s is None else (y, s)
