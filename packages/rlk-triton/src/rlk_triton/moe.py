"""Mixture-of-experts: the router's softmax / top-k, and the experts' SwiGLU MLPs combined.

``moe_route(logits, top_k, normalize)`` picks each token's experts (DeepSeek-V3's router,
``moe_route_grouped``, is :mod:`rlk_triton.moe_grouped`'s, exported here); ``moe_experts(x,
indices, weights, gate_up, down)`` runs them. The numerics, fixed by this module's code and
constants, never by the batch or a tuning config:

- Routing, one row per token: the top-k by decreasing logit, compared as order-preserving
  int32 keys of the fp32 logits (``-0.0`` counts as ``+0.0``, NaN above ``+inf``), ties to the
  lower expert index (k passes of an integer max, then an integer min over the indices at the
  max: exact in any order). The weights are ``exp(z - max)`` over the row's sum, summed by a
  fixed pairwise tree over ``next_power_of_2(E)`` lanes, or with ``normalize`` over the chosen
  experts' sum, added in rank order; one correctly rounded division, float32 out.
- Dispatch: the (token, rank) pairs are sorted by expert (a stable integer sort) into slots;
  ``offsets[e]`` is expert e's first slot. Which slots a token gets depends on the batch; what
  a slot computes does not.
- The grouped GEMMs (gate/up, down, and the backward's dX and dH): one program per
  ``BLOCK_M`` slots of one expert and ``BLOCK_N`` columns, each slot's row gathered from its
  token, the reduction in ascending ``gemm.BLOCK_K`` tiles by ``tl.dot`` into fp32 from zero:
  rlk's GEMM order, so a row's bits depend on its token's values and the expert's weights only,
  not on how many rows the expert got, nor their order (the MMA tile shapes keep to the wgmma
  family, as in ``gemm.py``). The gate and up halves run as two chains in one program, rounded
  to the input dtype, then ``silu(gate) * up`` in fp32, rounded once (``activation.py``'s
  arithmetic). The down projection stays in fp32.
- The combine: ``out[t] = sum_r weights[t, r] * y[t, r]`` in fp32, in ascending rank r (the
  order of ``indices``' columns), from +0.0, rounded once; no atomics.
- Backward, without float atomics: dX and d(weights) per token, by the same grouped GEMMs and
  combine (d(weights)[t, r] = ``dH_unweighted . h`` over the intermediate axis in fixed 64-wide
  chunks: per-lane running sums, then a pairwise tree); the expert weights' gradients one
  program per (expert, output tile) reducing that expert's slots in ascending ``BLOCK_K``
  chunks, and the router's d(logits) per row from the saved weights.

Index inputs: ``indices`` outside ``[0, E)`` are never used to address memory; their tokens'
outputs are NaN and the call fails (``rlk_triton._bounds``).
"""

from __future__ import annotations

import torch

from rlk_triton import _bounds, moe_grouped, tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl
from rlk_triton.gemm import BLOCK_K
from rlk_triton.logprobs import tree_sum
from rlk_triton.moe_grouped import moe_route_grouped  # noqa: F401  (an op of this family)
from rlk_triton.tuning import Rule

#: Lanes of the d(weights) dot over the intermediate axis (sets its order: a constant).
_CHUNK = 64
_LOG2_CHUNK = 6
_INT_MIN = tl.constexpr(-2147483648)  # below every key of a logit


# ---------------------------------------------------------------------------------------------
# Routing


@jit
def _route_row(L, rows, stride_l, T, E, BLOCK_E: tl.constexpr, LOG2_E: tl.constexpr):
    """Rows ``rows`` of the logits: fp32 logits, the valid-lane mask, ``exp(z - max)`` (0 on
    padding lanes) and its row sum by a fixed pairwise tree."""
    cols = tl.arange(0, BLOCK_E)
    valid = (rows < T)[:, None] & (cols < E)[None, :]
    z = tl.load(L + rows[:, None] * stride_l + cols[None, :], mask=valid, other=float("-inf"))
    z = z.to(tl.float32)
    # tl.max drops NaN: a row holding one gets a NaN max (then NaN weights, as in float64).
    m = tl.max(z, axis=1)
    m = tl.where(tl.max((z != z).to(tl.int32), axis=1) > 0, float("nan"), m)
    e = tl.where(valid, tl.exp(z - m[:, None]), 0.0)
    return z, valid, e, tree_sum(e, LOG2_E)


@jit(do_not_specialize=["T"])
def _route_fwd_kernel(
    L, W, IDX, T, E, stride_l, TOP_K: tl.constexpr, KPAD: tl.constexpr,
    BLOCK_E: tl.constexpr, LOG2_E: tl.constexpr, ROWS: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    z, valid, e, total = _route_row(L, rows, stride_l, T, E, BLOCK_E, LOG2_E)
    # Order-preserving int32 keys: -0.0 as +0.0, every NaN one key above +inf, padding below all.
    bits = tl.where(z == 0.0, 0.0, z).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(z != z, 0x7FFFFFFF, key)
    key = tl.where(valid, key, _INT_MIN)
    ranks = tl.arange(0, KPAD)
    picked = tl.zeros((ROWS, KPAD), dtype=tl.float32)
    chosen = tl.zeros((ROWS, KPAD), dtype=tl.int64)
    picked_sum = tl.zeros((ROWS,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        idx = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        # One lane is the chosen value, the others +0.0: a sum exact in any order.
        val = tl.sum(tl.where(hit, e, 0.0), axis=1)
        key = tl.where(hit, _INT_MIN, key)
        picked = tl.where(ranks[None, :] == r, val[:, None], picked)
        chosen = tl.where(ranks[None, :] == r, idx[:, None].to(tl.int64), chosen)
        picked_sum = picked_sum + val
    if NORMALIZE:
        total = picked_sum
    w = tl.math.div_rn(picked, total[:, None])
    mask = (rows < T)[:, None] & (ranks < TOP_K)[None, :]
    offs = rows[:, None] * TOP_K + ranks[None, :]
    tl.store(W + offs, w, mask=mask)
    tl.store(IDX + offs, chosen, mask=mask)


@jit(do_not_specialize=["T"])
def _route_bwd_kernel(
    L, W, IDX, DW, DL, T, E, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    LOG2_E: tl.constexpr, ROWS: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    # Softmax over all experts: dl_j = p_j (g_j - c); over the chosen ones: dl_j = w_j (g_j - c)
    # at the chosen j and 0 elsewhere; g_j = dw at rank r where j = indices[r], c = sum_r dw_r
    # w_r in rank order.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask_r = rows < T
    c = tl.zeros((ROWS,), dtype=tl.float32)
    g = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    wsel = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    chosen = cols[None, :] < 0
    for r in tl.static_range(TOP_K):
        w_r = tl.load(W + rows * TOP_K + r, mask=mask_r, other=0.0)
        d_r = tl.load(DW + rows * TOP_K + r, mask=mask_r, other=0.0).to(tl.float32)
        i_r = tl.load(IDX + rows * TOP_K + r, mask=mask_r, other=-1)
        c = c + d_r * w_r
        hit = cols[None, :] == i_r[:, None]
        g = tl.where(hit, d_r[:, None], g)
        wsel = tl.where(hit, w_r[:, None], wsel)
        chosen = chosen | hit
    if NORMALIZE:
        dl = tl.where(chosen, wsel * (g - c[:, None]), 0.0)
    else:
        z, valid, e, total = _route_row(L, rows, stride_l, T, E, BLOCK_E, LOG2_E)
        dl = tl.math.div_rn(e, total[:, None]) * (g - c[:, None])
    mask = mask_r[:, None] & (cols < E)[None, :]
    tl.store(DL + rows[:, None] * E + cols[None, :], dl.to(DL.dtype.element_ty), mask=mask)


def _route_launch(table, key, T, E):
    cfg = tuning.config(table, key, rows=T, experts=E)
    block_e = next_power_of_2(E)
    return (
        cfg,
        dict(BLOCK_E=block_e, LOG2_E=block_e.bit_length() - 1),
        max(1, cfg["block"] // block_e),
    )


class _RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, normalize, table):
        weights, indices = _route_forward(logits, top_k, normalize, table)
        ctx.save_for_backward(logits, weights, indices)
        ctx.normalize, ctx.table = normalize, table
        ctx.mark_non_differentiable(indices)
        return weights, indices

    @staticmethod
    def backward(ctx, dw, _didx):
        logits, weights, indices = ctx.saved_tensors
        dl = _route_backward(logits, weights, indices, dw, ctx.normalize, ctx.table)
        return dl, None, None, None


def _route_backward(logits, weights, indices, dw, normalize, table):
    """d(logits) ``[T, E]`` from d(weights) ``[T, k]`` (None: zeros) and the forward's outputs."""
    T, E = logits.shape
    dw = torch.zeros_like(weights) if dw is None else dw.contiguous()
    dl = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if T:
        cfg, blocks, rows = _route_launch(table, "moe_route.bwd", T, E)
        _route_bwd_kernel[(cdiv(T, rows),)](
            logits, weights, indices, dw, dl, T, E, logits.stride(0),
            TOP_K=indices.shape[1], **blocks, ROWS=rows, NORMALIZE=normalize,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return dl


def _route_forward(logits, top_k, normalize, table):
    T, E = logits.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        cfg, blocks, rows = _route_launch(table, "moe_route.fwd", T, E)
        _route_fwd_kernel[(cdiv(T, rows),)](
            logits, weights, indices, T, E, logits.stride(0), TOP_K=top_k,
            KPAD=next_power_of_2(top_k), **blocks, ROWS=rows, NORMALIZE=normalize,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return weights, indices


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool = False,
    *,
    table: tuning.TuningTable,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and routing weights from the router's ``logits [T, E]``
    (bf16/fp16/fp32, unit column stride).

    Returns ``(weights, indices)``, float32 and int64 ``[T, top_k]``, ranked by decreasing logit
    with ties to the lower expert index; ``weights`` are the softmax over all E experts at the
    chosen ones, or with ``normalize`` the softmax over the chosen k (transformers'
    ``norm_topk_prob``). A row's results depend on that row alone, bitwise. Differentiable in
    ``logits`` through ``weights``.

    Example::

        w, idx = moe_route(torch.randn(4, 8), 2, normalize=True, table=table)
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RouteFunction.apply(logits, top_k, normalize, table)
    return _route_forward(logits, top_k, normalize, table)


# ---------------------------------------------------------------------------------------------
# Experts: dispatch, grouped GEMMs, combine


@jit
def _expert_tile(OFFS, E, pid, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The expert, first slot and end slot of row tile ``pid``: expert e owns
    ``cdiv(count_e, BLOCK_M)`` consecutive tiles, in expert order (integer arithmetic, exact);
    past the last tile the expert is E and the range empty."""
    ar = tl.arange(0, BLOCK_E)
    lo = tl.load(OFFS + ar, mask=ar < E, other=0)
    hi = tl.load(OFFS + ar + 1, mask=ar < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    e = tl.sum((tl.cumsum(tiles, axis=0) <= pid).to(tl.int32), axis=0)
    before = tl.sum(tl.where(ar < e, tiles, 0), axis=0)
    start = tl.sum(tl.where(ar == e, lo, 0), axis=0)
    end = tl.sum(tl.where(ar == e, hi, 0), axis=0)
    return e, start + (pid - before) * BLOCK_M, end


@jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@jit
def _grouped_kernel(
    A, B, C, H, GATHER, OFFS, E, N, K, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    stride_cm, stride_hm, HAS_GATHER: tl.constexpr, SWIGLU: tl.constexpr,
    STORE_C: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    # C[s, n] = sum_k A[row(s), k] * B[e(s), k, n] for the slots s of one expert's row tile
    # (row(s) = GATHER[s], or s). With SWIGLU, columns n and N + n are the gate and up of one
    # intermediate column: two chains per program, stored (if STORE_C) rounded to C's dtype,
    # and H[s, n] = silu(gate) * up from the rounded values.
    e, row0, end = _expert_tile(OFFS, E, tl.program_id(0), BLOCK_M, BLOCK_E)
    if e >= E:
        return
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rows = row0 + rm
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + rn
    mask_m = rows < end
    mask_n = cols < N
    if HAS_GATHER:
        src = tl.load(GATHER + rows, mask=mask_m, other=0)
    else:
        src = rows
    a_ptrs = A + src[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + e.to(tl.int64) * stride_be + rk[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = rk < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, IEEE)
        if SWIGLU:
            bu_ptrs = b_ptrs + N * stride_bn
            if EVEN_K:
                bu = tl.load(bu_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                bu = tl.load(bu_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_up = _dot(a, bu, acc_up, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask = mask_m[:, None] & mask_n[None, :]
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :]
    if SWIGLU:
        gate = acc.to(C.dtype.element_ty)
        up = acc_up.to(C.dtype.element_ty)
        if STORE_C:
            tl.store(c_ptrs, gate, mask=mask)
            tl.store(c_ptrs + N, up, mask=mask)
        g = gate.to(tl.float32)
        h = g * tl.sigmoid(g) * up.to(tl.float32)
        tl.store(H + rows[:, None] * stride_hm + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)


@jit
def _grouped_dw_kernel(
    A, B, C, GATHER, ORDER, WEIGHTS, OFFS, M, N, stride_as, stride_am, stride_bs, stride_bn,
    stride_ce, stride_cm, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # C[e, m, n] = sum over expert e's slots s of A'[s, m] * B'[s, n]: one program per
    # (output tile, expert), the slots in ascending BLOCK_K chunks from the expert's first.
    # A'[s] = A[s], or with GATHER_A its token's row scaled by the slot's routing weight,
    # w * A[token(s)] in fp32 rounded to A's dtype (dY of the down projection); B'[s] = B[s],
    # or with GATHER_B its token's row.
    e = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    m0 = (tl.program_id(0) // tiles_n).to(tl.int64) * BLOCK_M
    n0 = (tl.program_id(0) % tiles_n).to(tl.int64) * BLOCK_N
    lo = tl.load(OFFS + e)
    hi = tl.load(OFFS + e + 1)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK_K):
        slots = s0 + rk
        mask_s = slots < hi
        if GATHER_A or GATHER_B:
            token = tl.load(GATHER + slots, mask=mask_s, other=0)
        else:
            token = slots
        a_row = token if GATHER_A else slots
        a = tl.load(A + a_row[None, :] * stride_as + rm[:, None] * stride_am,
                    mask=mask_s[None, :] & mask_m[:, None], other=0.0)  # fmt: skip
        if GATHER_A:
            flat = tl.load(ORDER + slots, mask=mask_s, other=0)
            w = tl.load(WEIGHTS + flat, mask=mask_s, other=0.0).to(tl.float32)
            a = (w[None, :] * a.to(tl.float32)).to(A.dtype.element_ty)
        b_row = token if GATHER_B else slots
        b = tl.load(B + b_row[:, None] * stride_bs + rn[None, :] * stride_bn,
                    mask=mask_s[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        acc = _dot(a, b, acc, IEEE)
    c_ptrs = C + e * stride_ce + rm[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@jit(do_not_specialize=["T"])
def _combine_kernel(
    Y, INV, IDX, W, OUT, ok_ptr, T, N, E, stride_y, stride_o, HAS_W: tl.constexpr,
    TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # out[t] = sum_r w[t, r] * Y[slot(t, r)] (or without w), ascending r, fp32 from +0.0.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_r = rows < T
    mask_c = cols < N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    bad = rows < 0
    for r in tl.static_range(TOP_K):
        e = tl.load(IDX + rows * TOP_K + r, mask=mask_r, other=0)
        ok = (e >= 0) & (e < E)
        bad = bad | (mask_r & ((e < 0) | (e >= E)))
        slot = tl.load(INV + rows * TOP_K + r, mask=mask_r, other=0)
        y = tl.load(Y + slot[:, None] * stride_y + cols[None, :],
                    mask=(mask_r & ok)[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
        if HAS_W:
            w = tl.load(W + rows * TOP_K + r, mask=mask_r, other=0.0).to(tl.float32)
            acc = acc + w[:, None] * y
        else:
            acc = acc + y
    acc = tl.where(bad[:, None], float("nan"), acc)
    out_ptrs = OUT + rows[:, None] * stride_o + cols[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_r[:, None] & mask_c[None, :])
    tl.store(ok_ptr + rows * 0, tl.zeros([ROWS], tl.int32), mask=bad)


@jit(do_not_specialize=["n_slots"])
def _swiglu_bwd_kernel(
    G, GU, Hs, WEIGHTS, ORDER, OFFS, DGU, DWEIGHTS, n_slots, I, E, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
):  # fmt: skip
    # Per slot s (flat pair f = ORDER[s], weight w = WEIGHTS[f]): dH = w * G[s] (G = dOut @
    # down_e, unweighted); d(weights)[f] = G[s] . H[s] in CHUNK-wide lanes, ascending chunks,
    # then a pairwise tree; [dgate; dup] from dH, activation.py's formula.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    lo = tl.load(OFFS)
    hi = tl.load(OFFS + E)
    mask_r = (rows >= lo) & (rows < hi) & (rows < n_slots)
    flat = tl.load(ORDER + rows, mask=mask_r, other=0)
    w = tl.load(WEIGHTS + flat, mask=mask_r, other=0.0).to(tl.float32)
    lanes = tl.arange(0, CHUNK)
    dot = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    for c0 in range(0, I, CHUNK):
        cols = c0 + lanes
        mask = mask_r[:, None] & (cols < I)[None, :]
        g = tl.load(G + rows[:, None] * I + cols[None, :], mask=mask, other=0.0)
        h = tl.load(Hs + rows[:, None] * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dot = dot + g * h
        gu_offs = rows[:, None] * (2 * I) + cols[None, :]
        gate = tl.load(GU + gu_offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(GU + gu_offs + I, mask=mask, other=0.0).to(tl.float32)
        dh = w[:, None] * g
        sig = tl.sigmoid(gate)
        dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        dup = dh * (gate * sig)
        tl.store(DGU + gu_offs, dgate.to(DGU.dtype.element_ty), mask=mask)
        tl.store(DGU + gu_offs + I, dup.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DWEIGHTS + flat, tree_sum(dot, LOG2_CHUNK), mask=mask_r)


class _Dispatch:
    """The slots of one call: ``order[s]`` the flat pair (t * k + r) at slot s (sorted by
    expert, stably), ``token[s]`` its token, ``inv[f]`` the slot of flat pair f, and
    ``offsets [E + 1]``, expert e's slots being ``[offsets[e], offsets[e + 1])`` (indices out of
    range sort outside ``[offsets[0], offsets[E])``). Integer ops: the same on every device."""

    def __init__(self, indices: torch.Tensor, experts: int):
        T, k = indices.shape
        dev = indices.device
        flat = indices.reshape(-1).to(torch.int64)
        expert_sorted, self.order = torch.sort(flat, stable=True)
        self.offsets = torch.searchsorted(
            expert_sorted, torch.arange(experts + 1, dtype=torch.int64, device=dev)
        )
        self.token = self.order // k
        n = T * k
        self.inv = torch.empty_like(self.order).scatter_(
            0, self.order, torch.arange(n, dtype=torch.int64, device=dev)
        )
        self.slots, self.experts = n, experts


def _grouped(table, key, d: _Dispatch, a, b, out, *, gather, b_kn, h=None, store_c=True):
    """Grouped product over ``d``'s slots: ``out[s] = a[row(s)] @ B_e`` with ``B_e[k, n] =
    b[e, k, n]`` at the strides ``b_kn`` (its k and n strides); with ``h``, the gate/up SwiGLU
    form (``out`` [slots, 2N] the rounded gate and up, ``h`` [slots, N])."""
    K = a.shape[1]
    N = h.shape[1] if h is not None else out.shape[1]
    if d.slots == 0 or N == 0:
        return
    cfg = tuning.config(table, key, M=d.slots, N=N, K=K, dtype_bytes=a.element_size())
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], BLOCK_K[a.dtype]
    # Every expert with a slot can start a partial tile: at most min(E, slots) extra tiles.
    tiles_m = cdiv(d.slots, bm) + min(d.experts, d.slots)
    _grouped_kernel[(tiles_m, cdiv(N, bn))](
        a, b, out, h if h is not None else out, gather if gather is not None else d.offsets,
        d.offsets, d.experts, N, K, a.stride(0), a.stride(1), b.stride(0), b_kn[0], b_kn[1],
        out.stride(0), h.stride(0) if h is not None else 0, HAS_GATHER=gather is not None,
        SWIGLU=h is not None, STORE_C=store_c, EVEN_K=K % bk == 0,
        IEEE=a.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=next_power_of_2(d.experts), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip


def _grouped_dw(table, d: _Dispatch, a, b, out, *, weights=None, gather_b=False):
    """``out[e] = A'[slots of e].T @ B'[slots of e]`` (``out [E, M, N]``, fp32 sums rounded
    once): ``A'`` is ``a``'s slot rows, or with ``weights`` (flat [T * k]) its token rows
    scaled by the slot's weight; ``B'`` is ``b``'s slot rows, or with ``gather_b`` its token
    rows (see ``_grouped_dw_kernel``)."""
    M, N = out.shape[1], out.shape[2]
    cfg = tuning.config(table, "moe_experts.dw", M=M, N=N, K=d.slots, dtype_bytes=a.element_size())
    bm, bn, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]
    if tuning.launches_on_amd():
        # Triton 3.9's AMD block-pingpong schedule (gfx950, with its asynchronous copies)
        # fails to compile the 128x128 / 8-warp tile at 3 stages; every dW config compiles
        # for gfx90a/942/950 at 2 (``rlk aot``). Stages set how many K chunks load ahead,
        # not the order the dot adds them: the same bits.
        stages = min(stages, _AMD_DW_STAGES)
    _grouped_dw_kernel[(cdiv(M, bm) * cdiv(N, bn), d.experts)](
        a, b, out, d.token, d.order, weights if weights is not None else d.offsets, d.offsets,
        M, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        GATHER_A=weights is not None, GATHER_B=gather_b, IEEE=a.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K[a.dtype], num_warps=cfg["num_warps"],
        num_stages=stages,
    )  # fmt: skip


def _combine(table, d: _Dispatch, y, indices, weights, out):
    T, k = indices.shape
    N = out.shape[1]
    if T == 0 or N == 0:
        return
    cfg = tuning.config(table, "moe_experts.combine", rows=T, cols=N)
    block_n = min(next_power_of_2(N), cfg["block"])
    rows = max(1, cfg["block"] // block_n)
    ok = _bounds.flag(out.device)
    _combine_kernel[(cdiv(T, rows), cdiv(N, block_n))](
        y, d.inv, indices, weights if weights is not None else y, out, ok, T, N, d.experts,
        y.stride(0), out.stride(0), HAS_W=weights is not None, TOP_K=k, ROWS=rows,
        BLOCK_N=block_n, num_warps=cfg["num_warps"],
    )  # fmt: skip
    _bounds.report(ok, f"moe_experts: indices out of range (there are {d.experts} experts)")


def _expert_outputs(x, indices, gate_up, down, table, keep: bool):
    """``(d, gu, h, y)``: the dispatch of ``indices``, and per slot the rounded gate/up
    (``keep``; else a placeholder), the SwiGLU row and the unweighted fp32 expert output ``y
    [slots, H]`` that the combine adds (``rlk_triton.moe_parallel`` adds it on another rank)."""
    H = x.shape[1]
    E, I = down.shape[0], down.shape[2]
    d = _Dispatch(indices, E)
    gu = x.new_empty((d.slots, 2 * I)) if keep else x.new_empty((1, 1))
    h = x.new_empty((d.slots, I))
    # gate_up [E, 2I, H]: B_e[k = h, n] = gate_up[e, n, h]; down [E, H, I]: B_e[k = i, n = h].
    _grouped(table, "moe_experts.gate_up", d, x, gate_up, gu, gather=d.token,
             b_kn=(gate_up.stride(2), gate_up.stride(1)), h=h, store_c=keep)  # fmt: skip
    y = torch.empty((d.slots, H), dtype=torch.float32, device=x.device)
    _grouped(table, "moe_experts.gemm", d, h, down, y, gather=None,
             b_kn=(down.stride(2), down.stride(1)))  # fmt: skip
    return d, gu, h, y


def _experts_forward(x, indices, weights, gate_up, down, table, keep: bool):
    d, gu, h, y = _expert_outputs(x, indices, gate_up, down, table, keep)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _combine(table, d, y, indices, weights, out)
    return out, d, gu, h


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, weights, gate_up, down, table):
        out, d, gu, h = _experts_forward(x, indices, weights, gate_up, down, table, keep=True)
        ctx.save_for_backward(x, indices, weights, gate_up, down, gu, h)
        ctx.dispatch, ctx.table = d, table
        return out

    @staticmethod
    def backward(ctx, dout):
        x, indices, weights, gate_up, down, gu, h = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dw, dgate_up, ddown = _experts_backward(
            dout, x, indices, weights, gate_up, down, gu, h, ctx.dispatch, ctx.table,
            (n[0], n[2], n[3], n[4]),
        )  # fmt: skip
        return dx, None, dw, dgate_up, ddown, None


def _experts_backward(dout, x, indices, weights, gate_up, down, gu, h, d, table, needs,
                      combine=True):  # fmt: skip
    """``(dx, d(weights), d(gate_up), d(down))`` of :func:`moe_experts`, each None unless
    ``needs`` (four bools, in that order) asks; ``gu``/``h`` and the dispatch ``d`` are the
    forward's. ``combine=False``: dx is the fp32 per-slot rows ``[slots, H]`` before the
    combine adds them (``rlk_triton.moe_parallel``)."""
    dout = torch.zeros_like(x) if dout is None else dout.contiguous()
    T, k = indices.shape
    I = down.shape[2]
    # G[s] = dOut[token(s)] @ down_e: down [E, H, I] as B_e[k = h, n = i].
    g = torch.empty((d.slots, I), dtype=torch.float32, device=x.device)
    _grouped(table, "moe_experts.gemm", d, dout, down, g, gather=d.token,
             b_kn=(down.stride(1), down.stride(2)))  # fmt: skip
    dgu = torch.empty_like(gu)
    dweights = torch.full((T * k,), float("nan"), dtype=torch.float32, device=x.device)
    if d.slots:
        w_flat = weights.reshape(-1)
        rows = 16
        _swiglu_bwd_kernel[(cdiv(d.slots, rows),)](
            g, gu, h, w_flat, d.order, d.offsets, dgu, dweights, d.slots, I, d.experts,
            ROWS=rows, CHUNK=_CHUNK, LOG2_CHUNK=_LOG2_CHUNK, num_warps=4,
        )  # fmt: skip
    dx = None
    if needs[0]:
        # dX[t] = sum_r dGU[slot] @ gate_up_e: gate_up [E, 2I, H] as B_e[k = n2, n = h].
        dxs = torch.empty((d.slots, x.shape[1]), dtype=torch.float32, device=x.device)
        _grouped(table, "moe_experts.gemm", d, dgu, gate_up, dxs, gather=None,
                 b_kn=(gate_up.stride(1), gate_up.stride(2)))  # fmt: skip
        dx = torch.empty_like(x) if combine else dxs
        if combine:
            _combine(table, d, dxs, indices, None, dx)
    dgate_up = ddown = None
    if needs[2]:
        dgate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=x.device)
        _grouped_dw(table, d, dgu, x, dgate_up, gather_b=True)
    if needs[3]:
        # dY[s] = w * dOut[token(s)], rounded to the input dtype, as the product's operand.
        ddown = torch.empty(down.shape, dtype=down.dtype, device=x.device)
        _grouped_dw(table, d, dout, h, ddown, weights=weights.reshape(-1))
    dw = dweights.view(T, k).to(weights.dtype) if needs[1] else None
    return dx, dw, dgate_up, ddown


def _route_split_forward(logits, top_k, normalize=False, *, table):
    return _route_forward(logits, top_k, normalize, table), ()


def _route_split_backward(grads, outs, extras, needs, logits, top_k, normalize=False, *, table):
    return (_route_backward(logits, outs[0], outs[1], grads[0], normalize, table),)


def _experts_split_forward(x, indices, weights, gate_up, down, *, table):
    x, indices, weights = x.contiguous(), indices.contiguous(), weights.contiguous()
    out, _, gu, h = _experts_forward(x, indices, weights, gate_up, down, table, keep=True)
    return (out,), (gu, h)


def _experts_split_backward(grads, outs, extras, needs, x, indices, weights, gate_up, down, *,
                            table):  # fmt: skip
    # The dispatch again from the indices (integer sorts: the forward's slots, exactly).
    x, indices, weights = x.contiguous(), indices.contiguous(), weights.contiguous()
    d = _Dispatch(indices, down.shape[0])
    gu, h = extras
    return _experts_backward(grads[0], x, indices, weights, gate_up, down, gu, h, d, table, needs)


#: The MoE ops' forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`_RouteFunction` and
#: :class:`_ExpertsFunction`, the experts' backward reading the forward's gate/up and SwiGLU
#: rows (``gu``, ``h``) as the extras.
AUTOGRAD = {
    "moe_route": (_route_split_forward, _route_split_backward),
    "moe_experts": (_experts_split_forward, _experts_split_backward),
    **moe_grouped.AUTOGRAD,
}


def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """The experts' SwiGLU MLPs, combined: ``out[t] = sum_r weights[t, r] * down[e] @
    (silu(g) * u)`` with ``e = indices[t, r]`` and ``[g; u] = gate_up[e] @ x[t]``.

    Shapes: ``x [T, H]`` (bf16/fp16/fp32), ``indices [T, k]`` (int, in ``[0, E)``),
    ``weights [T, k]`` (float; float32 from :func:`moe_route`), ``gate_up [E, 2I, H]`` (gate
    rows, then up rows: transformers' layout) and ``down [E, H, I]`` in x's dtype -> ``[T, H]``
    in x's dtype. Row t depends only on ``x[t]``, ``indices[t]``, ``weights[t]`` and the weights
    of its experts, bitwise: not on the batch, on how many tokens share an expert, or on the
    tuning. The combine adds the k experts' fp32 outputs in rank order (the columns of
    ``indices``). Differentiable in ``x``, ``weights``, ``gate_up`` and ``down``
    (deterministic, no atomics).

    Example::

        out = moe_experts(x, idx, w, gate_up, down, table=table)
    """
    x = x.contiguous()
    indices = indices.contiguous()
    weights = weights.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, gate_up, down)):
        return _ExpertsFunction.apply(x, indices, weights, gate_up, down, table)
    return _experts_forward(x, indices, weights, gate_up, down, table, keep=False)[0]


def _gemm_cfg(bm, bn, warps, stages):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


# BLOCK_M in {64, 128} and num_warps in {4, 8}: one MMA kind (wgmma on Hopper), as in gemm.py.
_GEMM_CONFIGS = (
    _gemm_cfg(64, 64, 4, 4),  # 0: decode (a few slots per expert)
    _gemm_cfg(64, 128, 4, 4),  # 1: mid
    _gemm_cfg(128, 128, 8, 3),  # 2: many slots per expert
    _gemm_cfg(64, 32, 4, 4),  # 3: narrow N
)
_DW_CONFIGS = (_gemm_cfg(64, 64, 4, 3), _gemm_cfg(128, 128, 8, 3), _gemm_cfg(64, 128, 4, 3))
#: Pipeline stages of a dW launch on an AMD GPU at most (see ``_grouped_dw``).
_AMD_DW_STAGES = 2
_ROW_CONFIGS = ({"block": 2048, "num_warps": 4}, {"block": 1024, "num_warps": 4},
                {"block": 4096, "num_warps": 8})  # fmt: skip


def _choose_gemm(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    # Slots per expert are what a tile covers: few at decode, many in training.
    if dtype_bytes == 4:
        return 0
    if M <= 1024:
        return 0
    return 2 if N >= 512 else 1


def _choose_dw(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    return 1 if dtype_bytes == 2 and M >= 512 and N >= 512 else 0


def _choose_rows(**shape: int) -> int:
    return 0


TUNING = {
    "moe_route.fwd": Rule(configs=_ROW_CONFIGS, choose=_choose_rows),
    "moe_route.bwd": Rule(configs=_ROW_CONFIGS, choose=_choose_rows),
    "moe_route_grouped.fwd": Rule(configs=_ROW_CONFIGS, choose=_choose_rows),
    "moe_route_grouped.bwd": Rule(configs=_ROW_CONFIGS, choose=_choose_rows),
    "moe_experts.gate_up": Rule(configs=_GEMM_CONFIGS, choose=_choose_gemm),
    "moe_experts.gemm": Rule(configs=_GEMM_CONFIGS, choose=_choose_gemm),
    "moe_experts.dw": Rule(configs=_DW_CONFIGS, choose=_choose_dw),
    "moe_experts.combine": Rule(configs=_ROW_CONFIGS, choose=_choose_rows),
}

#: Under the interpreter: the same candidates, the widest tiles (its cost is per program).
_WIDEST = {"gate_up": 2, "gemm": 2, "dw": 1, "fwd": 2, "bwd": 2, "combine": 2}
CPU_TUNING = {
    key: Rule(configs=rule.configs, choose=lambda _i=_WIDEST[key.split(".")[1]], **_: _i)
    for key, rule in TUNING.items()
}
