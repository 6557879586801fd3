"""The deterministic backward of :func:`rlk_triton.attention.attention`: kernels and launcher.

Backward (training path; also valid for nq < nk): ``delta = rowsum(dO * O)`` by a kernel with
a fixed config; dK/dV by one program per KV tile looping over query chunks of the constant
``BWD_BLOCK_M`` rows (tokens x the group's query heads, in a fixed order) in ascending order;
dQ by one program per query tile looping over KV tiles of ``BLOCK_N`` in ascending order. No
atomics; a sequence's gradients depend only on that sequence. The tunable block sizes
(``BLOCK_N`` of the dK/dV kernel, ``BLOCK_M`` of the dQ kernel) only tile *outputs*; the extra
tiles a larger block may visit contribute exact zeros.

The helpers both passes use are in :mod:`rlk_triton.attention_fwd` (with the forward); the
tuning rules of both passes (``attention.fwd``, ``attention.bwd``) in :mod:`rlk_triton.attention`.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl
from rlk_triton.attention_fwd import (
    _LOG2E,
    BLOCK_N,
    DOT_PRECISION,
    _group_tile,
    _max_len,
    _nan_rows,
    _off32,
    _offsets_ok,
    _rows64,
    _tile_range,
)

#: Query chunk (rows = tokens x heads) of the dK/dV reduction. Never tune it.
BWD_BLOCK_M = 64
#: Rows of the delta = rowsum(dO * O) kernel (fixed config: it reduces over D).
_DELTA_ROWS = 32


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _delta_kernel(O, DO, DELTA, n_rows, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    mask = (r < n_rows)[:, None] & (d < D)[None, :]
    off = r.to(tl.int64)[:, None] * D + d[None, :]
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + r, tl.sum(o * do, 1), mask=r < n_rows)


@jit
def _q_rows(Q, DO, LSE, DELTA, q_start, tok, h, row_ok, stride_qt, stride_qh, Hq, d, d_ok,
            OFF32: tl.constexpr):  # fmt: skip
    """A backward program's query rows: q, dO, lse and delta (zeros where ``row_ok`` is false).
    OFF32: int32 offsets (q below element 2^31, see the forward's ``_kv_rows``)."""
    row = _rows64(q_start + tok, OFF32)
    q_off = row * stride_qt + _rows64(h, OFF32) * stride_qh
    qmask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_off[:, None] + d[None, :], mask=qmask, other=0.0)
    do = tl.load(DO + q_off[:, None] + d[None, :], mask=qmask, other=0.0)
    stat_off = row * Hq + h
    lse = tl.load(LSE + stat_off, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + stat_off, mask=row_ok, other=0.0)
    return q, do, lse, delta


@jit
def _dq_tile(
    dq, q, do, lse, delta, k, v, qk_scale, visible, MASK: tl.constexpr, DOT_PREC: tl.constexpr
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASK:
        s = tl.where(visible, s, float("-inf"))
    p = tl.math.exp2(tl.fma(s, qk_scale, -lse[:, None]))
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU_Q,
    CU_K,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    qk_scale,
    scale,
    GROUP,
    D,
    Hq,
    Tq,
    Tk,
    HG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    OFF32: tl.constexpr = False,
):
    # q, do, dq share strides (contiguous [Tq, Hq, D]); k, v likewise ([Tk, Hk, D]).
    TOK: tl.constexpr = BLOCK_M // HG
    # Causal: the last query tiles do the most work; start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2)
    n_hc = tl.cdiv(GROUP, HG)
    kvh = pid_h // n_hc
    hc = pid_h % n_hc
    q_start = tl.load(CU_Q + b)
    q_end = tl.load(CU_Q + b + 1)
    k_start = tl.load(CU_K + b)
    k_end = tl.load(CU_K + b + 1)
    nq = q_end - q_start
    nk = k_end - k_start
    t0 = pid_m * TOK
    # Bad offsets: the forward pass has reported them; the rows inside dq are NaN.
    seq_ok = _offsets_ok(q_start, q_end, k_start, k_end, Tq, Tk)
    if ~seq_ok:
        hi = tl.minimum(q_start + t0 + TOK, q_end)
        nan_args = (Tq, kvh, hc, stride_qt, stride_qh, Hq, GROUP, D)
        _nan_rows(DQ, DQ, q_start + t0, hi, *nan_args, HG, BLOCK_M, BLOCK_D, False)
    if ~seq_ok | (t0 >= nq):
        return

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // HG
    g = hc * HG + r % HG
    row_ok = (r // HG < TOK) & (tok < nq) & (g < GROUP)
    h = kvh * GROUP + g
    pos = nk - nq + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q, do, lse, delta = _q_rows(Q, DO, LSE, DELTA, q_start, tok, h, row_ok, stride_qt, stride_qh,
                                Hq, d, d_ok, OFF32)  # fmt: skip
    q_off = (q_start + tok).to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
    qmask = row_ok[:, None] & d_ok[None, :]

    n_full, n_tiles = _tile_range(nk, nq, t0, TOK, BLOCK_N, CAUSAL)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    kv_head = _rows64(kvh, OFF32) * stride_kh
    dummy = r < BLOCK_M
    for j in range(0, n_full):
        kpos = j * BLOCK_N + n
        off = kv_head + _rows64(k_start + kpos, OFF32)[:, None] * stride_kt + d[None, :]
        k = tl.load(K + off, mask=d_ok[None, :], other=0.0)
        v = tl.load(V + off, mask=d_ok[None, :], other=0.0)
        dq = _dq_tile(dq, q, do, lse, delta, k, v, qk_scale, dummy[:, None], False, DOT_PREC)
    for j in range(n_full, n_tiles):
        kpos = j * BLOCK_N + n
        k_ok = kpos < nk
        off = kv_head + _rows64(k_start + kpos, OFF32)[:, None] * stride_kt + d[None, :]
        k = tl.load(K + off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        visible = k_ok[None, :] & (r >= 0)[:, None]
        if CAUSAL:
            visible = visible & (kpos[None, :] <= pos[:, None])
        dq = _dq_tile(dq, q, do, lse, delta, k, v, qk_scale, visible, True, DOT_PREC)
    dq = dq * scale
    tl.store(DQ + q_off[:, None] + d[None, :], dq.to(DQ.dtype.element_ty), mask=qmask)


@jit
def _dkdv_chunk(
    dk, dv, it, hc, kvh, Q, DO, LSE, DELTA, k, v, kpos, k_ok, r, q_start, nq, nk, stride_qt,
    stride_qh, qk_scale, GROUP, Hq, d, d_ok, HG: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr, EARLY_DP: tl.constexpr,
    OFF32: tl.constexpr,
):  # fmt: skip
    """dK/dV of one KV tile += the query chunk ``it`` of head chunk ``hc``. Without MASK the
    caller knows every row of the chunk sees every key; rows the loads zero (a chunk's padding
    rows, heads past the group) then give p = 1 against zero q and dO, which adds exact zeros,
    as the masked p = 0 does."""
    TOK: tl.constexpr = BLOCK_M // HG
    g = hc * HG + r % HG
    h = kvh * GROUP + g
    tok = it * TOK + r // HG
    row_ok = (r // HG < TOK) & (tok < nq) & (g < GROUP)
    q, do, lse, delta = _q_rows(Q, DO, LSE, DELTA, q_start, tok, h, row_ok, stride_qt, stride_qh,
                                Hq, d, d_ok, OFF32)  # fmt: skip

    st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    if EARLY_DP:
        # Issued before the exponent, so that this product can overlap it (see _early_dp).
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    pt = tl.math.exp2(tl.fma(st, qk_scale, -lse[None, :]))
    if MASK:
        visible = k_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            visible = visible & (kpos[:, None] <= (nk - nq + tok)[None, :])
        pt = tl.where(visible, pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
    if not EARLY_DP:
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU_Q,
    CU_K,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    qk_scale,
    scale,
    GROUP,
    D,
    Hq,
    Tq,
    Tk,
    HG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EARLY_DP: tl.constexpr,
    OFF32: tl.constexpr = False,
):
    # BLOCK_N (KV rows of this program) is tunable; BLOCK_M (the query chunk summed by each
    # dot) is the constant BWD_BLOCK_M, so dK/dV add the same partial sums in the same order.
    TOK: tl.constexpr = BLOCK_M // HG
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_end = tl.load(CU_Q + b + 1)
    k_start = tl.load(CU_K + b)
    k_end = tl.load(CU_K + b + 1)
    nq = q_end - q_start
    nk = k_end - k_start
    n0 = pid_n * BLOCK_N
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # Bad offsets: the forward pass has reported them; the rows inside dk/dv are NaN.
    seq_ok = _offsets_ok(q_start, q_end, k_start, k_end, Tq, Tk)
    if ~seq_ok:
        rows = k_start + n0 + n
        inside = (rows >= 0) & (rows < Tk) & (n0 + n < k_end - k_start)
        off = rows.to(tl.int64)[:, None] * stride_kt + kvh.to(tl.int64) * stride_kh + d[None, :]
        nan = tl.full([BLOCK_N, BLOCK_D], float("nan"), tl.float32)
        tl.store(DK + off, nan.to(DK.dtype.element_ty), mask=inside[:, None] & d_ok[None, :])
        tl.store(DV + off, nan.to(DV.dtype.element_ty), mask=inside[:, None] & d_ok[None, :])
    if ~seq_ok | (n0 >= nk):
        return

    kpos = n0 + n
    k_ok = kpos < nk
    kv_mask = k_ok[:, None] & d_ok[None, :]
    kv_off = (
        (k_start + kpos).to(tl.int64)[:, None] * stride_kt
        + kvh.to(tl.int64) * stride_kh
        + d[None, :]
    )
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    if CAUSAL:
        first_tok = tl.maximum(n0 - (nk - nq), 0)
        # The first chunk whose every token sees every key of this tile.
        it_vis = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - (nk - nq), 0), TOK)
    else:
        first_tok = 0
        it_vis = 0
    it0 = first_tok // TOK
    n_it = tl.cdiv(nq, TOK)
    # SPLIT: chunks [it_vis, it_end) run without the mask: all their tokens exist and see the
    # whole tile, whose keys all exist. The others run the masked body. The three loops keep
    # the ascending chunk order, and the mask of a fully visible chunk is all true: the same
    # bits with or without SPLIT (see _split_dkdv).
    it_vis = tl.minimum(tl.maximum(it_vis, it0), n_it)
    it_end = tl.maximum(tl.minimum(nq // TOK, n_it), it_vis)
    if n0 + BLOCK_N > nk:
        it_end = it_vis
    r = tl.arange(0, BLOCK_M)
    n_hc = tl.cdiv(GROUP, HG)
    args = (Q, DO, LSE, DELTA, k, v, kpos, k_ok, r, q_start, nq, nk, stride_qt, stride_qh,
            qk_scale, GROUP, Hq, d, d_ok)  # fmt: skip
    for hc in range(0, n_hc):
        if SPLIT:
            for it in range(it0, it_vis):
                dk, dv = _dkdv_chunk(dk, dv, it, hc, kvh, *args, HG, BLOCK_M, CAUSAL, True,
                                     DOT_PREC, EARLY_DP, OFF32)  # fmt: skip
            for it in range(it_vis, it_end):
                dk, dv = _dkdv_chunk(dk, dv, it, hc, kvh, *args, HG, BLOCK_M, CAUSAL, False,
                                     DOT_PREC, EARLY_DP, OFF32)  # fmt: skip
            for it in range(it_end, n_it):
                dk, dv = _dkdv_chunk(dk, dv, it, hc, kvh, *args, HG, BLOCK_M, CAUSAL, True,
                                     DOT_PREC, EARLY_DP, OFF32)  # fmt: skip
        else:
            for it in range(it0, n_it):
                dk, dv = _dkdv_chunk(dk, dv, it, hc, kvh, *args, HG, BLOCK_M, CAUSAL, True,
                                     DOT_PREC, EARLY_DP, OFF32)  # fmt: skip
    dk = dk * scale
    tl.store(DK + kv_off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _split_dkdv(head_dim: int) -> bool:
    """Whether the dK/dV kernel runs the query chunks that see a whole KV tile without the
    mask (the bits are the same either way). On an H200 that made the causal backward
    1.02-1.05x faster at head_dim 128 and 0.80x as fast at head_dim 64 (GQA 7), where the
    kernel with three loop bodies ran slower."""
    return head_dim > 64


def _early_dp(head_dim: int) -> bool:
    """Whether the dK/dV kernel issues the dO V^T product before the exponent of its chunk
    rather than after dV's product (the same products, so the same bits). On an H200 (causal,
    bf16, ``scripts/kernel_sweep.py`` attnbwd) that kernel took 6725 -> 6325 us at B=8 S=4096
    Hq=32 Hk=8 and 6237 -> 5865 us at B=4 S=8192 Hq=Hk=16 (head_dim 128), and 1406 -> 1444 us at
    head_dim 64 (B=16 S=2048 Hq=14 Hk=2)."""
    return head_dim > 64


def _backward(do, q, k, v, o, lse, cu_q, cu_k, causal, scale, table, max_lens=None):
    tq, hq, d = q.shape
    tk, hk, _ = k.shape
    group = hq // hk
    b = cu_q.numel() - 1
    do = do.contiguous()
    # Zeros are what rows outside any valid sequence keep (possible with bad offsets in default
    # mode); one buffer for dq, dk and dv takes one fill instead of three. q, k and v are
    # contiguous (validated), so contiguous views have their strides.
    nq, nk = q.numel(), k.numel()
    grads = torch.zeros(nq + nk + v.numel(), dtype=q.dtype, device=q.device)
    dq = grads[:nq].view(q.shape)
    dk = grads[nq : nq + nk].view(k.shape)
    dv = grads[nq + nk :].view(v.shape)
    max_nq, max_nk = max_lens or (_max_len(cu_q), _max_len(cu_k))
    if b == 0 or max_nk == 0:
        return dq, dk, dv
    block_d = next_power_of_2(max(d, 16))
    delta = torch.empty((tq, hq), dtype=torch.float32, device=q.device)
    n_rows = tq * hq
    if n_rows:
        _delta_kernel[(cdiv(n_rows, _DELTA_ROWS),)](
            o, do, delta, n_rows, d, ROWS=_DELTA_ROWS, BLOCK_D=block_d, num_warps=4
        )
    cfg = tuning.config(
        table, "attention.bwd", rows=max(max_nq, max_nk) * group, group=group, head_dim=d
    )
    common = dict(
        CAUSAL=causal,
        DOT_PREC=DOT_PRECISION,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    hg = _group_tile(group, BWD_BLOCK_M)
    # int32 row offsets (OFF32) where every element of q and k (v, do and the gradients share
    # their layouts) lies below 2^31: the same rows, so the same bits (int64 under an OFF64
    # config, which the tuning-invariance check runs).
    common["OFF32"] = _off32(q, k) and not cfg.get("OFF64")
    _dkdv_kernel[(cdiv(max_nk, cfg["BLOCK_N"]), hk, b)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        cu_q,
        cu_k,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        scale * _LOG2E,
        scale,
        group,
        d,
        hq,
        tq,
        tk,
        HG=hg,
        BLOCK_M=BWD_BLOCK_M,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_D=block_d,
        SPLIT=_split_dkdv(d),
        EARLY_DP=_early_dp(d),
        **common,
    )
    if max_nq:
        hg = _group_tile(group, cfg["BLOCK_M"])
        tok = cfg["BLOCK_M"] // hg
        _dq_kernel[(cdiv(max_nq, tok), hk * cdiv(group, hg), b)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            cu_q,
            cu_k,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            scale * _LOG2E,
            scale,
            group,
            d,
            hq,
            tq,
            tk,
            HG=hg,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=BLOCK_N,
            BLOCK_D=block_d,
            **common,
        )
    return dq, dk, dv
