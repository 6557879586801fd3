"""DeepSeek-V3's group-limited sigmoid router: ``moe_route_grouped`` of the ``moe`` family
(:mod:`rlk_triton.moe` exports it and holds its tuning rules; the kernels live here to keep that
file short).

The numerics, fixed by this module's code, never by the batch or a tuning config; one row per
token, float32 throughout:

- ``s = 1 / (1 + exp(-z))`` (one correctly rounded division), the selection score ``c = s +
  bias``, compared as order-preserving int32 keys (``-0.0`` counts as ``+0.0``, NaN above
  ``+inf``), ties to the lower index (an integer max, then an integer min over the indices at
  the max: exact in any order).
- A group's score: its largest ``c`` plus its second largest (the same max/min passes, the
  second with the first's lane excluded; one float32 addition, larger first). The
  ``topk_group`` groups of largest score by the same integer passes, then ``top_k`` passes over
  the lanes of those groups, in rank order.
- ``weights``: ``s`` at the chosen lanes (each a one-lane sum: exact), with ``normalize``
  divided (``div_rn``) by their sum in rank order plus ``1e-20``, times ``scale``.
- Backward, per row, from the saved indices and the logits (``s`` recomputed by the forward's
  formula): ``dz_j = (scale / S) (g_j - sum_r g_r s_r / S) s_j (1 - s_j)`` at the chosen ``j``
  with ``normalize`` (``S`` the forward's denominator), ``scale g_j s_j (1 - s_j)`` without; 0
  elsewhere. Sums in rank order.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl

_INT_MIN = tl.constexpr(-2147483648)  # below every key of a score


@jit
def _key(c):
    """Order-preserving int32 keys of fp32 ``c``: -0.0 as +0.0, every NaN above +inf."""
    bits = tl.where(c == 0.0, 0.0, c).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(c != c, 0x7FFFFFFF, key)


@jit
def _sigmoid(z):
    return tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))


@jit
def _best(key, cols, NONE: tl.constexpr):
    """Per row: the largest key and the lowest lane holding it (NONE past the last lane)."""
    best = tl.max(key, axis=1)
    return best, tl.min(tl.where(key == best[:, None], cols[None, :], NONE), axis=1)


@jit(do_not_specialize=["T"])
def _grouped_fwd_kernel(
    L, BIAS, W, IDX, T, E, GSIZE, stride_l, scale, TOP_K: tl.constexpr, KPAD: tl.constexpr,
    N_GROUP: tl.constexpr, GPAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_E: tl.constexpr, ROWS: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows < T)[:, None] & (cols < E)[None, :]
    z = tl.load(L + rows[:, None] * stride_l + cols[None, :], mask=valid, other=0.0)
    s = _sigmoid(z.to(tl.float32))
    c = s + tl.load(BIAS + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    key = tl.where(valid, _key(c), _INT_MIN)
    group = cols // GSIZE
    gcols = tl.arange(0, GPAD)
    gkey = tl.full((ROWS, GPAD), _INT_MIN, tl.int32)
    for g in tl.static_range(N_GROUP):
        k = tl.where((group == g)[None, :], key, _INT_MIN)
        _, i1 = _best(k, cols, BLOCK_E)
        k = tl.where(cols[None, :] == i1[:, None], _INT_MIN, k)
        _, i2 = _best(k, cols, BLOCK_E)
        # One lane each, the others +0.0: exact sums.
        v1 = tl.sum(tl.where(cols[None, :] == i1[:, None], c, 0.0), axis=1)
        v2 = tl.sum(tl.where(cols[None, :] == i2[:, None], c, 0.0), axis=1)
        gkey = tl.where(gcols[None, :] == g, _key(v1 + v2)[:, None], gkey)
    allowed = valid & (cols < 0)[None, :]  # all False, the tile's shape
    for _ in tl.static_range(TOPK_GROUP):
        _, gi = _best(gkey, gcols, GPAD)
        gkey = tl.where(gcols[None, :] == gi[:, None], _INT_MIN, gkey)
        allowed = allowed | (group[None, :] == gi[:, None])
    key = tl.where(allowed, key, _INT_MIN)
    ranks = tl.arange(0, KPAD)
    picked = tl.zeros((ROWS, KPAD), dtype=tl.float32)
    chosen = tl.zeros((ROWS, KPAD), dtype=tl.int64)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        _, idx = _best(key, cols, BLOCK_E)
        hit = cols[None, :] == idx[:, None]
        val = tl.sum(tl.where(hit, s, 0.0), axis=1)
        key = tl.where(hit, _INT_MIN, key)
        picked = tl.where(ranks[None, :] == r, val[:, None], picked)
        chosen = tl.where(ranks[None, :] == r, idx[:, None].to(tl.int64), chosen)
        total = total + val
    if NORMALIZE:
        picked = tl.math.div_rn(picked, (total + 1e-20)[:, None])
    w = picked * scale
    mask = (rows < T)[:, None] & (ranks < TOP_K)[None, :]
    offs = rows[:, None] * TOP_K + ranks[None, :]
    tl.store(W + offs, w, mask=mask)
    tl.store(IDX + offs, chosen, mask=mask)


@jit(do_not_specialize=["T"])
def _grouped_bwd_kernel(
    L, IDX, DW, DL, T, E, stride_l, scale, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask_r = rows < T
    total = tl.zeros((ROWS,), dtype=tl.float32)
    dot = tl.zeros((ROWS,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        i_r = tl.load(IDX + rows * TOP_K + r, mask=mask_r, other=0)
        s_r = _sigmoid(tl.load(L + rows * stride_l + i_r, mask=mask_r, other=0.0).to(tl.float32))
        g_r = tl.load(DW + rows * TOP_K + r, mask=mask_r, other=0.0).to(tl.float32)
        total = total + s_r
        dot = dot + g_r * s_r
    total = total + 1e-20
    dl = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        i_r = tl.load(IDX + rows * TOP_K + r, mask=mask_r, other=0)
        s_r = _sigmoid(tl.load(L + rows * stride_l + i_r, mask=mask_r, other=0.0).to(tl.float32))
        g_r = tl.load(DW + rows * TOP_K + r, mask=mask_r, other=0.0).to(tl.float32)
        if NORMALIZE:
            ds = tl.math.div_rn(scale * (g_r - tl.math.div_rn(dot, total)), total)
        else:
            ds = scale * g_r
        dz = ds * (s_r * (1.0 - s_r))
        dl = tl.where(cols[None, :] == i_r[:, None], dz[:, None], dl)
    mask = mask_r[:, None] & (cols < E)[None, :]
    tl.store(DL + rows[:, None] * E + cols[None, :], dl.to(DL.dtype.element_ty), mask=mask)


def _launch(table, key, T, E):
    cfg = tuning.config(table, key, rows=T, experts=E)
    block_e = next_power_of_2(E)
    return cfg, block_e, max(1, cfg["block"] // block_e)


def _forward(logits, bias, top_k, n_group, topk_group, normalize, scale, table):
    T, E = logits.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        cfg, block_e, rows = _launch(table, "moe_route_grouped.fwd", T, E)
        _grouped_fwd_kernel[(cdiv(T, rows),)](
            logits, bias.contiguous(), weights, indices, T, E, E // n_group, logits.stride(0),
            float(scale), TOP_K=top_k, KPAD=next_power_of_2(top_k), N_GROUP=n_group,
            GPAD=next_power_of_2(n_group), TOPK_GROUP=topk_group, BLOCK_E=block_e, ROWS=rows,
            NORMALIZE=normalize, num_warps=cfg["num_warps"],
        )  # fmt: skip
    return weights, indices


def _backward(logits, indices, dw, normalize, scale, table):
    """d(logits) ``[T, E]`` from d(weights) ``[T, k]`` (None: zeros) and the chosen experts."""
    T, E = logits.shape
    dw = torch.zeros(indices.shape, dtype=torch.float32, device=logits.device) if dw is None \
        else dw.contiguous()  # fmt: skip
    dl = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if T:
        cfg, block_e, rows = _launch(table, "moe_route_grouped.bwd", T, E)
        _grouped_bwd_kernel[(cdiv(T, rows),)](
            logits, indices, dw, dl, T, E, logits.stride(0), float(scale),
            TOP_K=indices.shape[1], BLOCK_E=block_e, ROWS=rows, NORMALIZE=normalize,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return dl


class _GroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, normalize, scale, table):
        weights, indices = _forward(logits, bias, top_k, n_group, topk_group, normalize, scale,
                                    table)  # fmt: skip
        ctx.save_for_backward(logits, indices)
        ctx.normalize, ctx.scale, ctx.table = normalize, scale, table
        ctx.mark_non_differentiable(indices)
        return weights, indices

    @staticmethod
    def backward(ctx, dw, _didx):
        logits, indices = ctx.saved_tensors
        dl = _backward(logits, indices, dw, ctx.normalize, ctx.scale, ctx.table)
        return dl, None, None, None, None, None, None, None


def moe_route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    scale: float = 1.0,
    *,
    table: tuning.TuningTable,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router over ``logits [T, E]`` (bf16/fp16/fp32, unit column stride) with
    the selection ``bias [E]``: ``(weights, indices)``, float32 and int64 ``[T, top_k]``, the
    numerics of this module's docstring (the contract: :func:`rlk.moe_route_grouped`). A row's
    results depend on that row alone, bitwise. Differentiable in ``logits``.

    Example::

        w, idx = moe_route_grouped(torch.randn(4, 8), torch.zeros(8), 2, 4, 2, table=table)
    """
    args = (logits, bias, top_k, n_group, topk_group, normalize, scale, table)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _GroupedFunction.apply(*args)
    return _forward(*args)


def _split_forward(logits, bias, top_k, n_group=1, topk_group=1, normalize=True, scale=1.0, *,
                   table):  # fmt: skip
    return _forward(logits, bias, top_k, n_group, topk_group, normalize, scale, table), ()


def _split_backward(grads, outs, extras, needs, logits, bias, top_k, n_group=1, topk_group=1,
                    normalize=True, scale=1.0, *, table):  # fmt: skip
    return (_backward(logits, outs[1], grads[0], normalize, scale, table),)


#: Forward and backward as two calls (``rlk.plugins.OpAutograd``; :mod:`rlk_triton.moe` merges
#: it into its ``AUTOGRAD``).
AUTOGRAD = {"moe_route_grouped": (_split_forward, _split_backward)}
