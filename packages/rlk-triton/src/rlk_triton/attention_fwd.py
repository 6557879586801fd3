"""The forward of varlen and paged attention: one set of numbers for every path.

Shapes: ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hk, D]`` (or paged caches ``[pages, page_size, Hk, D]``),
``cu_seqlens`` int32 ``[B + 1]``. The queries of a sequence are its last ``nq`` tokens: query
``i`` sits at position ``nk - nq + i`` and, when causal, sees keys ``0..nk - nq + i``.

Why every path gives the same bits (training, prefill, chunked prefill, decode, paged):

* KV is read in tiles of ``BLOCK_N`` keys (a module constant, never a tuning parameter) aligned
  to the sequence's logical position 0: tile ``j`` holds positions ``[j*BLOCK_N, (j+1)*BLOCK_N)``.
  Each query row runs the online softmax (fp32 ``m``, ``l``, ``acc``) over tiles ``0, 1, ...``
  in ascending order up to the tile holding its own position; the paged path gathers each
  tile's keys by logical position (``block_table[b, pos // page_size]``, slot
  ``pos % page_size``), so it feeds the very same tile to the very same arithmetic.
* The keys are split at fixed positions too: every ``KV_SPLIT`` keys from position 0 (a
  multiple of ``BLOCK_N``). Each split's online softmax starts from the empty state, and the
  splits merge in ascending order through one helper (:func:`_merge`). A program either runs
  all splits of its rows, keeping the merged state in fp32 scratch between them, or (decode
  configs with ``SPLIT``: many more programs when the batch is small) one split, whose
  partial state :func:`_merge_kernel` merges in the same order. Rows that see at most
  ``KV_SPLIT`` keys have one split, and their launches compile no merge.
* A program holds up to ``BLOCK_M`` rows, each a (query token, query head) pair: the query heads
  sharing a KV head (GQA/MQA) are packed into the M dimension with the tokens, so decode
  (one token) still fills part of the tile and K/V are read once per KV head. Rows never
  interact: scores come from ``tl.dot`` rows, and ``max``/``sum`` run along a row.
  Tiles that are entirely masked for a row (another row of the program needs them) leave
  that row's ``m``, ``l``, ``acc`` untouched through an explicit ``tl.where``.
* Tiles fully visible to every row of the program run an unmasked loop, the others a masked
  loop; both run the same helper, whose only difference is a ``tl.where`` on the raw dot
  result. The scale ``scale * log2(e)`` is applied in fp32 after the dot through explicit
  ``tl.fma`` (exponent ``fma(s, scale*log2e, -m)``, ``l = fma(l, alpha, rowsum(p))``), so no
  mul+add is left for the compiler to contract differently in the two loops.
* GPU instruction kind: on Hopper, ``tl.dot`` is a wgmma when M is a multiple of 64 per
  warpgroup and ``num_warps`` a multiple of 4, otherwise an mma.sync, and the two may round
  differently. Every config here is one of (BLOCK_M=64, 4 warps), (BLOCK_M=128, 4 or 8 warps):
  always wgmma, and always a layout whose warps split M only (warpsPerCTA = [num_warps, 1]),
  so a row's ``BLOCK_N`` scores are held by one warp in the same way and the row reductions
  (``tl.max``, ``tl.sum``) run in the same order for every config. (BLOCK_M=64 with 8 warps
  would split N across two warpgroups and change the row-sum order: never use it.) The
  instruction's N is ``BLOCK_N`` (scores) or ``D`` (output), both fixed by the op.
* The final ``acc / l`` (plus ``+ 0.0``, which maps a possible ``-0.0`` to ``+0.0``) is the
  same epilogue for every path.
* How a tile reaches the kernel is a launch choice: the packed path's full tiles may come
  through tensor descriptors (TMA, a config's ``TMA``) instead of pointer loads. A full tile
  holds only the sequence's own keys, so both bring the same values to the same arithmetic.
  Likewise the row offsets are int32 where every element of the tensors addressed lies below
  offset 2^31 (``OFF32``, :func:`_off32`), else int64: the same rows either way. One config
  of each table (``OFF64``, never chosen) keeps int64 offsets at every size, so that the
  conformance kit's tuning-invariance check compares the two widths bit for bit.

This module holds the forward kernels and their launcher (:func:`_forward`); the launch configs
and the op's public function are in :mod:`rlk_triton.attention`, the backward in
:mod:`rlk_triton.attention_bwd`, the paged op in :mod:`rlk_triton.paged_attention`.
"""

from __future__ import annotations

import torch

from rlk_triton import _bounds, tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl

#: KV tile of the forward pass and of the dQ reduction: fixes the softmax order. Never tune it.
BLOCK_N = 64
#: KV split: every path runs the online softmax over the keys ``[s*KV_SPLIT, (s+1)*KV_SPLIT)``
#: from the empty state and merges the splits in ascending order (:func:`_merge`). A constant
#: of the op like ``BLOCK_N`` (a multiple of it), never a tuning parameter: it fixes the bits of
#: every row that sees more than ``KV_SPLIT`` keys. A launch may then run the splits of a row
#: in one program (merging at each split's end) or in one program per split plus a merge
#: kernel (``SPLIT`` configs: small-batch decode); both merge the same partials in the same
#: order, so they give the same bits.
KV_SPLIT = 4096
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _rows64(rows, OFF32: tl.constexpr):
    """Row (or page, or head) indices as they are under OFF32, else widened to int64 before
    they scale a stride."""
    if not OFF32:
        rows = rows.to(tl.int64)
    return rows


@jit
def _kv_rows(b, kpos, nk, k_start, BT, stride_btb, stride_kt, stride_kp, stride_vt, stride_vp,
             n_pages, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, OFF32: tl.constexpr):  # fmt: skip
    """Element offsets of the K and V cache rows holding logical key positions ``kpos``, and
    (paged) whether each page id is in ``[0, n_pages)``: a row of another page is never read.
    The page ids are loaded once for both caches. OFF32: every row of both caches lies below
    element 2^31 (the launcher's :func:`_span` check), so the offsets of the rows that are read
    fit int32, whose arithmetic takes a quarter fewer instructions per tile than int64 in the
    sm_90 compile; rows whose load is masked off may wrap, and are never read."""
    if PAGED:
        page = tl.load(BT + b * stride_btb + kpos // PAGE_SIZE, mask=kpos < nk, other=0)
        rows = _rows64(page, OFF32)
        slot = _rows64(kpos % PAGE_SIZE, OFF32)
        k_rows = rows * stride_kp + slot * stride_kt
        v_rows = rows * stride_vp + slot * stride_vt
        return k_rows, v_rows, (page >= 0) & (page < n_pages)
    else:
        pos = _rows64(k_start + kpos, OFF32)
        return pos * stride_kt, pos * stride_vt, kpos >= 0


@jit
def _fwd_tile(
    acc, m, l, q, k, v, qk_scale, visible, active, MASK: tl.constexpr, DOT_PREC: tl.constexpr
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASK:
        s = tl.where(visible, s, float("-inf"))
    # The row max commutes with the (monotone) scale multiply. The exponent and the l update
    # are explicit fmas, so the compiler has no mul+add left to contract differently in the
    # masked and unmasked loops.
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    l_new = tl.fma(l, alpha, tl.sum(p, 1))
    acc_new = acc * alpha[:, None]
    acc_new = tl.dot(p.to(v.dtype), v, acc_new, input_precision=DOT_PREC)
    if MASK:
        # A row with no visible key in this tile keeps its state bit for bit.
        acc_new = tl.where(active[:, None], acc_new, acc)
        m_new = tl.where(active, m_new, m)
        l_new = tl.where(active, l_new, l)
    return acc_new, m_new, l_new


@jit
def _offsets_ok(q_start, q_end, k_start, k_end, Tq, Tk):
    """Whether a sequence's offsets keep it inside the tensors: ``0 <= q_start <= q_end <= Tq``
    and ``0 <= k_start``, ``k_end <= Tk``, with at least as many keys as queries. Memory is
    addressed through a sequence only when this holds (paged: ``k_start`` is 0 and ``Tk`` the
    capacity of a block-table row)."""
    # Only comparisons of loaded values until both ranges are known to be ordered and inside
    # [0, T]: a difference of arbitrary int32 values could overflow.
    ok = (q_start >= 0) & (q_start <= q_end) & (q_end <= Tq)
    ok = ok & (k_start >= 0) & (k_start <= k_end) & (k_end <= Tk)
    return ok & (k_end - k_start >= q_end - q_start)


@jit
def _edges_ok(b, n_seq, q_start, q_end, k_start, k_end, Tq, Tk, K_EXACT: tl.constexpr):
    """The first sequence starts at row 0 and the last one ends at the last row (of q, and of k
    when packed). With every sequence's offsets in order too, this means they tile the rows."""
    ok = (b > 0) | ((q_start == 0) & (k_start == 0))
    last = q_end == Tq
    if K_EXACT:
        last = last & (k_end == Tk)
    return ok & ((b < n_seq - 1) | last)


@jit
def _nan_rows(O, LSE, lo, hi, Tq, kvh, hc, stride_ot, stride_oh, Hq, GROUP, D, HG: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr):  # fmt: skip
    """Store NaN in the output rows ``[lo, hi)``, clipped to ``[0, Tq)``, of this program's
    query heads: the defined result of rows that bad offsets leave without a value."""
    TOK: tl.constexpr = BLOCK_M // HG
    lo = tl.minimum(tl.maximum(lo, 0), Tq)
    hi = tl.minimum(tl.maximum(hi, 0), Tq)
    r = tl.arange(0, BLOCK_M)
    g = hc * HG + r % HG
    h = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    nan = tl.full([BLOCK_M, BLOCK_D], float("nan"), tl.float32)
    for t0 in range(lo, hi, TOK):
        tok = t0 + r // HG
        ok = (r // HG < TOK) & (tok < hi) & (g < GROUP)
        off = tok.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
        mask = ok[:, None] & (d < D)[None, :]
        tl.store(O + off[:, None] + d[None, :], nan.to(O.dtype.element_ty), mask=mask)
        if STORE_LSE:
            tl.store(
                LSE + tok.to(tl.int64) * Hq + h,
                tl.full([BLOCK_M], float("nan"), tl.float32),
                mask=ok,
            )


@jit
def _merge(A, M, L, acc, m, l):
    """The state ``(A, M, L)`` of the splits so far, then split ``(acc, m, l)``: ``M`` is the
    larger maximum, ``A`` and ``L`` the two sums rescaled to it (explicit fmas). A row with
    nothing in the new split (``m = -inf``: its keys lie before the split) keeps its state bit
    for bit. The one merge of every path: the forward's own splits and :func:`_merge_kernel`."""
    m_new = tl.maximum(M, m)
    a = tl.math.exp2(M - m_new)
    b = tl.math.exp2(m - m_new)
    l_new = tl.fma(l, b, L * a)
    acc_new = tl.fma(acc, b[:, None], A * a[:, None])
    keep = m == float("-inf")
    return (
        tl.where(keep[:, None], A, acc_new),
        tl.where(keep, M, m_new),
        tl.where(keep, L, l_new),
    )


@jit
def _program(CU_Q, CU_K, SEQ_LENS, GROUP, Tq, Tk, max_nq, max_nk, N_SPLITS, HG: tl.constexpr,
             PAGED: tl.constexpr):  # fmt: skip
    """What a forward program works on: ``(b, kvh, hc, pid_m, n_pid_m, split, q_start, q_end,
    k_start, k_end, seq_ok)``. Axis 0 enumerates (query tile, split) pairs, the last query
    tiles first (causal: they do the most work); axis 1 (KV head, chunk of its query heads);
    axis 2 the sequence. A paged sequence's keys are ``[0, seq_lens[b])`` of its block-table
    row (Tk is then a row's capacity: pages per row x page size). ``seq_ok``: its offsets lie
    inside q and k, and within the grid's bounds ``max_nq``/``max_nk`` (a caller's bound that
    a sequence exceeds would leave its last rows unwritten)."""
    n_pid_m = tl.num_programs(0) // N_SPLITS
    pid_m = n_pid_m - 1 - tl.program_id(0) // N_SPLITS
    split = tl.program_id(0) % N_SPLITS
    pid_h = tl.program_id(1)
    b = tl.program_id(2)
    n_hc = tl.cdiv(GROUP, HG)
    q_start = tl.load(CU_Q + b)
    q_end = tl.load(CU_Q + b + 1)
    if PAGED:
        k_start = 0
        k_end = tl.load(SEQ_LENS + b)
    else:
        k_start = tl.load(CU_K + b)
        k_end = tl.load(CU_K + b + 1)
    seq_ok = _offsets_ok(q_start, q_end, k_start, k_end, Tq, Tk)
    seq_ok = seq_ok & (q_end - q_start <= max_nq) & (k_end - k_start <= max_nk)
    return (b, pid_h // n_hc, pid_h % n_hc, pid_m, n_pid_m, split, q_start, q_end, k_start,
            k_end, seq_ok)  # fmt: skip


@jit
def _rows(t0, nq, q_start, kvh, hc, GROUP, D, Hq, HG: tl.constexpr, TOK: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """The rows of a forward program: ``TOK`` tokens from ``t0`` x ``HG`` query heads of KV
    head ``kvh``'s chunk ``hc`` -> ``(r, tok, h, row_ok, d, d_ok, f32_off)``, ``f32_off`` the
    rows' offsets in an fp32 ``[Tq, Hq, D]`` buffer (the scratch, split 0 of the partials)."""
    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // HG
    g = hc * HG + r % HG
    row_ok = (r // HG < TOK) & (tok < nq) & (g < GROUP)
    h = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    f32_off = (((q_start + tok).to(tl.int64) * Hq + h) * D)[:, None] + d[None, :]
    return r, tok, h, row_ok, d, d_ok, f32_off


@jit
def _tile_range(nk, nq, t0, TOK, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(n_full, n_tiles)`` of the program whose first query row is ``t0``: tiles ``[0,
    n_full)`` are visible to all its rows, ``[0, n_tiles)`` to at least one."""
    t_last = tl.minimum(t0 + TOK, nq) - 1
    if CAUSAL:
        n_full = (nk - nq + t0 + 1) // BLOCK_N
        n_tiles = (nk - nq + t_last) // BLOCK_N + 1
    else:
        n_full = nk // BLOCK_N
        n_tiles = tl.cdiv(nk, BLOCK_N)
    return n_full, n_tiles


@jit
def _keys(j_lo, j_hi, n_full, bad_from, q, K, V, K_DESC, V_DESC, BT, b, nk, k_start, kvh,
          k_head, v_head, stride_btb, stride_kt, stride_kp, stride_vt, stride_vp, n_pages, d,
          d_ok, r, pos, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
          PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
          OFF32: tl.constexpr):  # fmt: skip
    """The online softmax of a program's rows over KV tiles ``[j_lo, j_hi)`` from the empty
    state -> ``(acc, m, l, bad_from)``: the tiles before ``n_full`` without masks, the rest
    masked. ``bad_from`` (paged): the first key position whose page id is out of range."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    dummy = r < BLOCK_M
    # Paged: per key lane, the first position whose page id is out of range (nk when none
    # is), reduced to one position after the loops: no cross-warp reduction per tile.
    bad = tl.full([BLOCK_N], 0, tl.int32) + nk
    for j in range(j_lo, tl.minimum(n_full, j_hi)):
        if TMA:
            # Tensor descriptors over [Tk, Hk * D] (D == BLOCK_D): a full tile is the
            # sequence's own keys, the very values the pointer loads read.
            k = K_DESC.load([k_start + j * BLOCK_N, kvh * BLOCK_D])
            v = V_DESC.load([k_start + j * BLOCK_N, kvh * BLOCK_D])
        else:
            kpos = j * BLOCK_N + n
            k_rows, v_rows, page_ok = _kv_rows(b, kpos, nk, k_start, BT, stride_btb, stride_kt,
                                               stride_kp, stride_vt, stride_vp, n_pages, PAGED,
                                               PAGE_SIZE, OFF32)  # fmt: skip
            if PAGED:
                kv_mask = page_ok[:, None] & d_ok[None, :]
                bad = tl.minimum(bad, tl.where(page_ok, nk, kpos))
            else:
                kv_mask = d_ok[None, :]
            k = tl.load(K + k_head + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + v_head + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc, m, l = _fwd_tile(acc, m, l, q, k, v, qk_scale, dummy[:, None], dummy, False,
                              DOT_PREC)  # fmt: skip
    for j in range(tl.maximum(n_full, j_lo), j_hi):
        kpos = j * BLOCK_N + n
        k_ok = kpos < nk
        k_rows, v_rows, page_ok = _kv_rows(b, kpos, nk, k_start, BT, stride_btb, stride_kt,
                                           stride_kp, stride_vt, stride_vp, n_pages, PAGED,
                                           PAGE_SIZE, OFF32)  # fmt: skip
        if PAGED:
            bad = tl.minimum(bad, tl.where(page_ok | ~k_ok, nk, kpos))
            kv_mask = (k_ok & page_ok)[:, None] & d_ok[None, :]
        else:
            kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + k_head + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + v_head + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # Padding rows (row_ok false) hold q = 0 and stay finite; they are never stored.
        visible = k_ok[None, :] & (r >= 0)[:, None]
        if CAUSAL:
            visible = visible & (kpos[None, :] <= pos[:, None])
            active = j * BLOCK_N <= pos
        else:
            active = r >= 0
        acc, m, l = _fwd_tile(acc, m, l, q, k, v, qk_scale, visible, active, True, DOT_PREC)
    if PAGED:
        bad_from = tl.minimum(bad_from, tl.min(bad, 0))
    return acc, m, l, bad_from


@jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_Q,
    CU_K,
    SEQ_LENS,
    BT,
    OK,
    SCR,
    PART,
    PART_ML,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_kp,
    stride_vt,
    stride_vh,
    stride_vp,
    stride_ot,
    stride_oh,
    stride_btb,
    qk_scale,
    GROUP,
    D,
    Hq,
    Tq,
    Tk,
    n_pages,
    max_nq,
    max_nk,
    N_SPLITS,
    K_DESC,
    V_DESC,
    HG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT_T: tl.constexpr,
    SPLITS: tl.constexpr = False,
    SPLIT_GRID: tl.constexpr = False,
    TMA: tl.constexpr = False,
    OFF32: tl.constexpr = False,
):
    # SPLIT_T: tiles per KV split. With SPLIT_GRID, axis 0 enumerates (query tile, split)
    # pairs, N_SPLITS splits per query tile: a program runs one split of its rows and stores
    # the partial state (PART: acc [N_SPLITS, Tq, Hq, D], PART_ML: m, l [N_SPLITS, 2, Tq, Hq],
    # fp32) for _merge_kernel. With SPLITS a program runs every split of its rows, merging
    # each at its end (SCR: fp32 [Tq, Hq, D] scratch, used by rows of more than one split).
    # With neither, no row of the launch sees more than one split.
    TOK: tl.constexpr = BLOCK_M // HG
    b, kvh, hc, pid_m, n_pid_m, split, q_start, q_end, k_start, k_end, seq_ok = _program(
        CU_Q, CU_K, SEQ_LENS, GROUP, Tq, Tk, max_nq, max_nk, N_SPLITS, HG, PAGED
    )
    nq = q_end - q_start
    nk = k_end - k_start
    t0 = pid_m * TOK
    # Bad offsets (possible in default mode, see rlk_triton._bounds): the sequence's rows that
    # lie inside q are NaN, rows that no sequence can reach are NaN, and the flag is cleared.
    edges_ok = _edges_ok(b, tl.num_programs(2), q_start, q_end, k_start, k_end, Tq, Tk, not PAGED)
    if ~(seq_ok & edges_ok) & (split == 0):
        tl.store(OK, 0)
        # NaN rows: before the first sequence, after the last one, and this program's own
        # when its sequence is bad (the last program's reach to the sequence's end: rows past
        # the grid's max_nq).
        nan_args = (Tq, kvh, hc, stride_ot, stride_oh, Hq, GROUP, D)
        if (pid_m == 0) & (b == 0):
            _nan_rows(O, LSE, 0, q_start, *nan_args, HG, BLOCK_M, BLOCK_D, STORE_LSE)
        if (pid_m == 0) & (b == tl.num_programs(2) - 1):
            _nan_rows(O, LSE, q_end, Tq, *nan_args, HG, BLOCK_M, BLOCK_D, STORE_LSE)
        if ~seq_ok:
            hi = tl.minimum(q_start + t0 + TOK, q_end)
            if pid_m == n_pid_m - 1:
                hi = q_end
            _nan_rows(O, LSE, q_start + t0, hi, *nan_args, HG, BLOCK_M, BLOCK_D, STORE_LSE)
    if ~seq_ok | (t0 >= nq):
        return
    n_full, n_tiles = _tile_range(nk, nq, t0, TOK, BLOCK_N, CAUSAL)
    if SPLIT_GRID:  # noqa: SIM102 (a compile-time branch)
        if split * SPLIT_T >= n_tiles:
            return

    r, tok, h, row_ok, d, d_ok, f32_off = _rows(t0, nq, q_start, kvh, hc, GROUP, D, Hq, HG,
                                                 TOK, BLOCK_M, BLOCK_D)  # fmt: skip
    pos = nk - nq + tok
    out_mask = row_ok[:, None] & d_ok[None, :]

    q_off = (q_start + tok).to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
    q = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh
    # Paged: the first key position whose page id is out of range (nk when none is). Such a
    # page is never read, and the rows that see it are NaN.
    bad_from = nk
    if SPLITS:
        # Every split of the rows in this program, one per iteration from the empty state,
        # merged into the state so far (the first split is the state). A state that more
        # splits follow waits in the fp32 scratch rows (registers hold one accumulator); the
        # barrier orders the store before the next split's load whatever layouts the compiler
        # gives the two. Only launches whose rows may see more than KV_SPLIT keys compile this
        # loop: the plain one below keeps the register budget and pipeline of the unsplit op.
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        m = M
        l = L
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        n_splits = tl.cdiv(n_tiles, SPLIT_T)
        for sp in range(0, n_splits):
            j_lo = sp * SPLIT_T
            j_hi = tl.minimum(j_lo + SPLIT_T, n_tiles)
            acc, m, l, bad_from = _keys(
                j_lo, j_hi, n_full, bad_from, q, K, V, K_DESC, V_DESC, BT, b, nk, k_start, kvh,
                k_head, v_head, stride_btb, stride_kt, stride_kp, stride_vt, stride_vp, n_pages,
                d, d_ok, r, pos, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, PAGED, PAGE_SIZE,
                DOT_PREC, TMA, OFF32,
            )  # fmt: skip
            if sp > 0:
                A = tl.load(SCR + f32_off, mask=out_mask, other=0.0)
                acc, m, l = _merge(A, M, L, acc, m, l)
            if sp + 1 < n_splits:
                tl.store(SCR + f32_off, acc, mask=out_mask)
                tl.debug_barrier()
                M = m
                L = l
    else:
        # One split (SPLIT_GRID), or every key of rows that see at most KV_SPLIT.
        j_lo = 0
        j_hi = n_tiles
        if SPLIT_GRID:
            j_lo = split * SPLIT_T
            j_hi = tl.minimum(j_lo + SPLIT_T, n_tiles)
        acc, m, l, bad_from = _keys(
            j_lo, j_hi, n_full, bad_from, q, K, V, K_DESC, V_DESC, BT, b, nk, k_start, kvh,
            k_head, v_head, stride_btb, stride_kt, stride_kp, stride_vt, stride_vp, n_pages, d,
            d_ok, r, pos, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, PAGED, PAGE_SIZE,
            DOT_PREC, TMA, OFF32,
        )  # fmt: skip

    # A row sees a bad page when it is causal-visible to it.
    sees_bad = (pos >= bad_from) & (bad_from < nk)
    if PAGED:  # noqa: SIM102 (a compile-time branch)
        if bad_from < nk:
            tl.store(OK, 0)
    if SPLIT_GRID:
        if PAGED:
            acc = tl.where(sees_bad[:, None], float("nan"), acc)
            l = tl.where(sees_bad, float("nan"), l)
        part = split.to(tl.int64) * Tq * Hq
        tl.store(PART + part * D + f32_off, acc, mask=out_mask)
        ml_off = part * 2 + (q_start + tok).to(tl.int64) * Hq + h
        tl.store(PART_ML + ml_off, m, mask=row_ok)
        tl.store(PART_ML + ml_off + Tq * Hq, l, mask=row_ok)
        return
    l_safe = tl.where(row_ok, l, 1.0)
    o = acc / l_safe[:, None] + 0.0
    if PAGED:
        o = tl.where(sees_bad[:, None], float("nan"), o)
    o_off = (q_start + tok).to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    tl.store(O + o_off[:, None] + d[None, :], o.to(O.dtype.element_ty), mask=out_mask)
    if STORE_LSE:
        lse = m + tl.math.log2(l_safe)
        tl.store(LSE + (q_start + tok).to(tl.int64) * Hq + h, lse, mask=row_ok)


@jit
def _merge_kernel(
    PART, PART_ML, O, LSE, CU_Q, CU_K, SEQ_LENS, stride_ot, stride_oh, GROUP, D, Hq, Tq, Tk,
    max_nq, max_nk, HG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr, STORE_LSE: tl.constexpr,
    SPLIT_T: tl.constexpr,
):  # fmt: skip
    """The epilogue of a ``SPLIT_GRID`` forward: the rows of one of its query tiles (the same
    grid without the splits), their partials merged in ascending split order from split 0,
    as the one-program forward merges them. Rows of bad sequences were written by the forward."""
    TOK: tl.constexpr = BLOCK_M // HG
    b, kvh, hc, pid_m, _, _, q_start, q_end, k_start, k_end, seq_ok = _program(
        CU_Q, CU_K, SEQ_LENS, GROUP, Tq, Tk, max_nq, max_nk, 1, HG, PAGED
    )
    nq = q_end - q_start
    nk = k_end - k_start
    t0 = pid_m * TOK
    if ~seq_ok | (t0 >= nq):
        return
    _, n_tiles = _tile_range(nk, nq, t0, TOK, BLOCK_N, CAUSAL)
    _, tok, h, row_ok, d, d_ok, f32_off = _rows(t0, nq, q_start, kvh, hc, GROUP, D, Hq, HG,
                                                 TOK, BLOCK_M, BLOCK_D)  # fmt: skip
    out_mask = row_ok[:, None] & d_ok[None, :]
    rows = (q_start + tok).to(tl.int64) * Hq + h
    acc = tl.load(PART + f32_off, mask=out_mask, other=0.0)
    m = tl.load(PART_ML + rows, mask=row_ok, other=float("-inf"))
    l = tl.load(PART_ML + Tq * Hq + rows, mask=row_ok, other=0.0)
    for s in range(1, tl.cdiv(n_tiles, SPLIT_T)):
        part = (s * Hq).to(tl.int64) * Tq
        A = tl.load(PART + part * D + f32_off, mask=out_mask, other=0.0)
        ms = tl.load(PART_ML + part * 2 + rows, mask=row_ok, other=float("-inf"))
        ls = tl.load(PART_ML + part * 2 + Tq * Hq + rows, mask=row_ok, other=0.0)
        acc, m, l = _merge(acc, m, l, A, ms, ls)
    l_safe = tl.where(row_ok, l, 1.0)
    o = acc / l_safe[:, None] + 0.0
    o_off = (q_start + tok).to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    tl.store(O + o_off[:, None] + d[None, :], o.to(O.dtype.element_ty), mask=out_mask)
    if STORE_LSE:
        lse = m + tl.math.log2(l_safe)
        tl.store(LSE + rows, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _group_tile(group: int, block_m: int) -> int:
    """Query heads of a group packed per program (the rest of BLOCK_M holds more tokens)."""
    return min(group, block_m, 64)


#: ``input_precision`` of every attention dot, whatever the dtype. fp32 inputs: the
#: full-precision FMA dot (no TF32). bf16/fp16 inputs take the tensor-core dot whatever the
#: option says (with "tf32" instead, the PTX for sm_80/sm_90 and gfx942's code are byte for byte
#: the same), and Triton's AMD backend refuses "tf32" on gfx90a and gfx950 (``rlk aot``).
DOT_PRECISION = "ieee"


def _stages(cfg, head_dim: int) -> int:
    # Shared memory: K/V tiles of D = 256 do not fit three stages deep (launch only, no bits).
    return min(cfg["num_stages"], 2) if head_dim > 128 else cfg["num_stages"]


_max_len_memo: list = []


def _span(t: torch.Tensor) -> int:
    """One past the largest element offset of ``t`` from its first element (non-negative
    strides; 0 when empty): the kernels' int32 row offsets (``OFF32``) need it below 2^31.
    A contiguous tensor's span is its size (the common case, checked on every call)."""
    if t.is_contiguous() or t.numel() == 0:
        return t.numel()
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def _off32(*tensors: torch.Tensor) -> bool:
    """Whether every element of ``tensors`` lies below offset 2^31 from its first one: the
    kernels may then compute row offsets in int32 (``OFF32``)."""
    return all(_span(t) < 2**31 for t in tensors)


def _descriptors_fit(k: torch.Tensor, v: torch.Tensor, paged: bool) -> bool:
    """Whether the packed forward can read K and V through tensor descriptors: contiguous
    16-bit ``[Tk, Hk, D]`` with D a power of two (a box of D columns is one head's row), 16-byte
    rows and 16-byte aligned bases (a contiguous view may start anywhere in its storage). Not
    on ROCm, whose tables (portable rules for attention) have not been timed with them."""
    d = k.shape[-1]
    return (
        not paged
        and torch.version.hip is None
        and k.dtype in (torch.bfloat16, torch.float16)
        and v.dtype == k.dtype
        and k.is_contiguous()
        and v.is_contiguous()
        and k.data_ptr() % 16 == 0
        and v.data_ptr() % 16 == 0
        and d >= 16
        and d & (d - 1) == 0
        and k.shape[0] > 0
        and (k.shape[1] * d * 2) % 16 == 0
    )


def _max_len(cu: torch.Tensor) -> int:
    """Longest sequence of ``cu`` (a host read). A model's layers pass the same ``cu`` objects
    within a forward, so the last two answers are remembered by object and version."""
    for ref, version, value in _max_len_memo:
        if ref is cu and version == cu._version:
            return value
    value = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    _max_len_memo.insert(0, (cu, cu._version, value))
    del _max_len_memo[2:]
    return value


def _lengths_fit(cu: torch.Tensor, b: int, rows: int, name: str, of: str) -> int:
    """The longest sequence of ``cu`` (a host read that sizes the grid), at most ``rows``. A
    length that cannot fit is an error here, for free; the kernels check the offsets."""
    longest = _max_len(cu) if b else 0
    if longest > rows or longest < 0 or (rows and longest == 0):
        raise ValueError(
            f"{name} does not fit {of}: its longest sequence has {longest} tokens, "
            f"{of} has {rows} rows"
        )
    return longest


def _forward(
    q, k, v, cu_q, cu_k, seq_lens, block_table, causal, scale, key, table, store_lse, bounds=None
):
    """``bounds``: the caller's ``(max_nq, max_nk)`` (no host read of ``cu_q``; the kernel
    checks every sequence against them), else ``max_nq`` is read from ``cu_q``."""
    tq, hq, d = q.shape
    hk = k.shape[-2]
    group = hq // hk
    paged = block_table is not None
    b = cu_q.numel() - 1
    o = torch.empty_like(q)
    lse = torch.empty((tq, hq), dtype=torch.float32, device=q.device) if store_lse else o
    if bounds is None:
        max_nq, max_nk = _lengths_fit(cu_q, b, tq, "cu_seqlens_q", "q"), None
    else:
        max_nq, max_nk = bounds
    if max_nq == 0:
        return o, lse
    if paged:
        # Caches [pages, page_size, Hk, D]: "t" = slot, "p" = page.
        skt, skh, skp = k.stride(1), k.stride(2), k.stride(0)
        svt, svh, svp = v.stride(1), v.stride(2), v.stride(0)
        page_size = k.shape[1]
        bt, sbt, lens, cu_k_arg = block_table, block_table.stride(0), seq_lens, cu_q
        tk, n_pages = block_table.shape[1] * page_size, k.shape[0]
    else:
        skt, skh, skp = k.stride(0), k.stride(1), 0
        svt, svh, svp = v.stride(0), v.stride(1), 0
        page_size = 1
        bt, sbt, lens, cu_k_arg = cu_k, 0, cu_k, cu_k
        tk, n_pages = k.shape[0], 0
    # Without a caller's bound on the keys, the kernels' own checks (keys inside k, at least as
    # many as queries) are the whole bound; one set of offsets for queries and keys (packed
    # self-attention: every nk == nq) bounds them by max_nq, so that a launch whose sequences
    # fit in one KV split compiles no split loop.
    if max_nk is None and cu_k is cu_q and not paged:
        max_nk = max_nq
    max_nk = tk if max_nk is None else max_nk
    keys = min(tk, max_nk)  # no sequence has more keys
    cfg = tuning.config(
        table, key, rows=max_nq * group, group=group, head_dim=d, programs=b * hk, keys=keys
    )
    block_m = cfg["BLOCK_M"]
    hg = _group_tile(group, block_m)
    tok = block_m // hg
    grid_m = cdiv(max_nq, tok)
    # KV splits: one program per split (SPLIT configs) writes partials for _merge_kernel;
    # else a program merges its rows' splits, the state between splits in fp32 scratch.
    if KV_SPLIT % BLOCK_N:
        raise ValueError(f"KV_SPLIT ({KV_SPLIT}) must be a multiple of BLOCK_N ({BLOCK_N})")
    split_grid = bool(cfg.get("SPLIT")) and keys > KV_SPLIT
    splits_in_program = keys > KV_SPLIT and not split_grid
    n_splits = cdiv(keys, KV_SPLIT) if split_grid else 1
    f32 = dict(dtype=torch.float32, device=q.device)
    scratch = part = part_ml = o
    if split_grid:
        part = torch.empty((n_splits, tq, hq, d), **f32)
        part_ml = torch.empty((n_splits, 2, tq, hq), **f32)
    elif splits_in_program:
        scratch = torch.empty((tq, hq, d), **f32)
    grid = (grid_m * n_splits, hk * cdiv(group, hg), b)
    k_desc = v_desc = None
    # Causal FLOPs if every sequence had max_nq queries and keys: a call below the host-bound
    # size reads through pointers (tuning.HOST_BOUND_FLOPS).
    flops = 2 * tq * max_nq * hq * d
    tma = tuning.use_descriptors(cfg, key, flops, q) and _descriptors_fit(k, v, paged)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc, v_desc = (
            TensorDescriptor(x, [tk, hk * d], [hk * d, 1], [BLOCK_N, d]) for x in (k, v)
        )
    # maxnreg is a register cap of NVIDIA's ptxas; Triton's AMD backend has no such option.
    cap = "maxnreg" in cfg and not tuning.launches_on_amd()
    reg_cap = {"maxnreg": cfg["maxnreg"]} if cap else {}
    ok = _bounds.flag(q.device)
    _fwd_kernel[grid](
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k_arg,
        lens,
        bt,
        ok,
        scratch,
        part,
        part_ml,
        q.stride(0),
        q.stride(1),
        skt,
        skh,
        skp,
        svt,
        svh,
        svp,
        o.stride(0),
        o.stride(1),
        sbt,
        scale * _LOG2E,
        group,
        d,
        hq,
        tq,
        tk,
        n_pages,
        max_nq,
        max_nk,
        n_splits,
        k_desc,
        v_desc,
        HG=hg,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=next_power_of_2(max(d, 16)),
        CAUSAL=causal,
        PAGED=paged,
        PAGE_SIZE=page_size,
        STORE_LSE=store_lse,
        DOT_PREC=DOT_PRECISION,
        SPLIT_T=KV_SPLIT // BLOCK_N,
        SPLITS=splits_in_program,
        SPLIT_GRID=split_grid,
        TMA=tma,
        OFF32=_off32(k, v) and not cfg.get("OFF64"),
        num_warps=cfg["num_warps"],
        num_stages=_stages(cfg, d),
        **reg_cap,
    )
    if split_grid:
        _merge_kernel[(grid_m, grid[1], b)](
            part, part_ml, o, lse, cu_q, cu_k_arg, lens, o.stride(0), o.stride(1), group, d, hq,
            tq, tk, max_nq, max_nk, HG=hg, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            BLOCK_D=next_power_of_2(max(d, 16)), CAUSAL=causal, PAGED=paged,
            STORE_LSE=store_lse, SPLIT_T=KV_SPLIT // BLOCK_N, num_warps=cfg["num_warps"],
        )  # fmt: skip
    if paged:
        _bounds.report(
            ok,
            "paged_attention: cu_seqlens_q, seq_lens, block_table or slots out of range "
            f"(offsets outside q's {tq} rows, seq_lens < queries or > {tk} slots of a "
            f"block-table row, a page id outside [0, {n_pages}), or a new token's slot outside "
            f"[0, {n_pages * page_size}))",
        )
    else:
        _bounds.report(
            ok,
            "attention: cu_seqlens_q/cu_seqlens_k out of range (each must start at 0, never "
            f"decrease and end at q's {tq} / k's {tk} rows, with keys >= queries per sequence, "
            f"and no sequence longer than max_seqlen_q = {max_nq} / max_seqlen_k = {max_nk})",
        )
    return o, lse
