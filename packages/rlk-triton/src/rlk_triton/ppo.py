"""PPO's critic side on padded ``[B, L]`` tensors: ``gae_advantages``, ``value_loss``.

Semantics: the docstrings of ``rlk.gae_advantages`` and ``rlk.value_loss`` (the arguments arrive
validated and normalised). Everything is computed in fp32 in an order fixed by this module:

- GAE scans each row backwards, one token after the other (the recurrence is sequential by
  nature), one row per lane of a program: a row's advantages depend on its own row only,
  whatever the batch or the launch config. Whitening (a statistic of the whole batch, by
  definition) runs in one program that adds the batch's tokens lane-wise over tiles of
  :data:`WHITEN_B` x :data:`WHITEN_L` (lane ``(i, j)`` takes rows ``i, i + WHITEN_B, ...`` and
  columns ``j, j + WHITEN_L, ...`` in ascending order), then adds the lanes by the fixed binary
  tree of :func:`rlk_triton.logprobs.tree_sum`.
- The value loss sums each sequence's tokens as ``policy_loss`` does (lanes of ``BLOCK_L``, then
  the tree), and aggregates the sequences with ``policy_loss``'s batch kernel (the same ``agg``
  modes, counts and scales); its backward is per token, without atomics.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._objectives import (
    METRICS,
    NF,
    NI,
    _log2,
    _max2,
    _min2,
    _safe_div,
    agg_flags,
    aggregate,
)
from rlk_triton._triton import cdiv, jit, tl
from rlk_triton.logprobs import tree_sum
from rlk_triton.policy_loss import BLOCK_L, _norms, _rows

#: Rows and columns of the tiles the whitening statistics are added over (lane-wise).
WHITEN_B = 16
WHITEN_L = 64
#: The variance floor of the whitening (verl's ``masked_whiten``).
WHITEN_EPS = 1e-8

# --------------------------------------------------------------------------------------------
# gae_advantages
# --------------------------------------------------------------------------------------------


@jit
def _gae_kernel(
    r_ptr,
    v_ptr,
    m_ptr,
    a_ptr,
    ret_ptr,
    B,
    L,
    s_r,
    s_v,
    s_m,
    gamma,
    gamma_lam,
    SEQS: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    ok = seqs < B
    b = seqs.to(tl.int64)
    v_next = tl.zeros([SEQS], tl.float32)
    a_next = tl.zeros([SEQS], tl.float32)
    for i in range(0, L):
        t = L - 1 - i
        given = tl.load(m_ptr + b * s_m + t, mask=ok, other=0).to(tl.float32)
        here = ok & (given != 0)
        r = tl.load(r_ptr + b * s_r + t, mask=here, other=0.0).to(tl.float32)
        # A mask value other than 0 or 1 (read on the host only with value checks on) is a
        # token of NaN reward: NaN advantages, never those of a mask of 1 (as the reference).
        r = tl.where(here & (given != 1), float("nan"), r)
        v = tl.load(v_ptr + b * s_v + t, mask=here, other=0.0).to(tl.float32)
        a_t = r + gamma * v_next - v + gamma_lam * a_next
        v_next = tl.where(here, v, v_next)
        a_next = tl.where(here, a_t, a_next)
        tl.store(a_ptr + b * L + t, tl.where(here, a_t, 0.0), mask=ok)
        tl.store(ret_ptr + b * L + t, tl.where(here, a_t + v, 0.0), mask=ok)


@jit
def _whiten_tile(a_ptr, m_ptr, s_m, b0, l0, B, L, WB: tl.constexpr, WL: tl.constexpr):
    """A tile of advantages (0 outside ``mask``) and its mask."""
    rows = (b0 + tl.arange(0, WB)).to(tl.int64)[:, None]
    cols = (l0 + tl.arange(0, WL))[None, :]
    ok = (rows < B) & (cols < L)
    m = ok & (tl.load(m_ptr + rows * s_m + cols, mask=ok, other=0).to(tl.float32) != 0)
    return tl.load(a_ptr + rows * L + cols, mask=m, other=0.0), m, rows * L + cols, ok


@jit
def _whiten_kernel(
    a_ptr,
    m_ptr,
    B,
    L,
    s_m,
    eps,
    WB: tl.constexpr,
    WL: tl.constexpr,
    LOG2_WB: tl.constexpr,
    LOG2_WL: tl.constexpr,
):
    acc = tl.zeros([WB, WL], tl.float32)
    n = tl.zeros([1], tl.int32)
    for b0 in range(0, B, WB):
        for l0 in range(0, L, WL):
            a, m, _, _ = _whiten_tile(a_ptr, m_ptr, s_m, b0, l0, B, L, WB, WL)
            acc += a
            n += tl.sum(tl.sum(m.to(tl.int32), axis=1)[None, :], axis=1)
    nf = n.to(tl.float32)
    mu = _safe_div(tree_sum(tree_sum(acc, LOG2_WL)[None, :], LOG2_WB), nf)
    acc = tl.zeros([WB, WL], tl.float32)
    for b0 in range(0, B, WB):
        for l0 in range(0, L, WL):
            a, m, _, _ = _whiten_tile(a_ptr, m_ptr, s_m, b0, l0, B, L, WB, WL)
            c = tl.where(m, a - mu, 0.0)
            acc += c * c
    ss = tree_sum(tree_sum(acc, LOG2_WL)[None, :], LOG2_WB)
    var = tl.where(n >= 2, tl.math.div_rn(ss, tl.maximum(nf - 1.0, 1.0)), 0.0)
    std = tl.sqrt_rn(var + eps)
    for b0 in range(0, B, WB):
        for l0 in range(0, L, WL):
            a, m, offs, ok = _whiten_tile(a_ptr, m_ptr, s_m, b0, l0, B, L, WB, WL)
            tl.store(a_ptr + offs, tl.where(m, tl.math.div_rn(a - mu, std), 0.0), mask=ok)


def _mask_rows(mask: torch.Tensor) -> torch.Tensor:
    mask = _rows(mask)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    table: tuning.TuningTable,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns (semantics: :func:`rlk.gae_advantages`).

    Shapes: ``rewards``, ``values``, ``mask`` (bool or 0/1) ``[B, L]``; returns two fp32
    ``[B, L]`` tensors, 0 outside ``mask``. Not differentiable.

    Example::

        adv, ret = gae_advantages(r, v, mask, gamma=1.0, lam=0.95, table=table)
    """
    B, L = rewards.shape
    r, v, m = _rows(rewards.detach()), _rows(values.detach()), _mask_rows(mask)
    adv = torch.empty(B, L, dtype=torch.float32, device=r.device)
    ret = torch.empty_like(adv)
    if B and L:
        cfg = dict(tuning.config(table, "gae_advantages.scan", B=B, L=L))
        seqs = cfg.pop("SEQS")
        # gamma * lam rounded once to fp32, as a product of two Python floats.
        _gae_kernel[(cdiv(B, seqs),)](
            r,
            v,
            m,
            adv,
            ret,
            B,
            L,
            r.stride(0),
            v.stride(0),
            m.stride(0),
            float(gamma),
            float(gamma) * float(lam),
            SEQS=seqs,
            **cfg,
        )
        if whiten:
            cfg = tuning.config(table, "gae_advantages.whiten", B=B, L=L)
            _whiten_kernel[(1,)](
                adv,
                m,
                B,
                L,
                m.stride(0),
                WHITEN_EPS,
                WB=WHITEN_B,
                WL=WHITEN_L,
                LOG2_WB=_log2(WHITEN_B),
                LOG2_WL=_log2(WHITEN_L),
                **cfg,
            )
    return adv, ret


# --------------------------------------------------------------------------------------------
# value_loss
# --------------------------------------------------------------------------------------------


@jit
def _value_terms(v, old, ret, clip, CLIP: tl.constexpr):
    """Per-token ``(0.5 * max(l1, l2), d / d v, clipped)`` in fp32."""
    d1 = v - ret
    l1 = d1 * d1
    if CLIP:
        vc = _max2(_min2(v, old + clip), old - clip)
        d2 = vc - ret
        l2 = d2 * d2
        was_clipped = l2 > l1
        # Where the clipped term wins, v is outside the clip range: its gradient is 0.
        return 0.5 * _max2(l1, l2), tl.where(was_clipped, 0.0, d1), was_clipped
    return 0.5 * l1, d1, l1 != l1  # never clipped


@jit
def _value_load(v_ptr, old_ptr, ret_ptr, m_ptr, b, l, ok, s_v, s_old, s_ret, s_m):
    given = tl.load(m_ptr + b * s_m + l, mask=ok, other=0).to(tl.float32)
    m = ok & (given != 0)
    v = tl.load(v_ptr + b * s_v + l, mask=m, other=0.0).to(tl.float32)
    # A mask value other than 0 or 1: a token of NaN value, so the loss is NaN (as the reference).
    v = tl.where(m & (given != 1), float("nan"), v)
    old = tl.load(old_ptr + b * s_old + l, mask=m, other=0.0).to(tl.float32)
    ret = tl.load(ret_ptr + b * s_ret + l, mask=m, other=0.0).to(tl.float32)
    return m, v, old, ret


@jit
def _value_seq_kernel(
    v_ptr,
    old_ptr,
    ret_ptr,
    m_ptr,
    seqf_ptr,
    seqi_ptr,
    B,
    L,
    s_v,
    s_old,
    s_ret,
    s_m,
    clip,
    CLIP: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LOG2_BLOCK_L: tl.constexpr,
    SEQS: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    seq_ok = seqs < B
    b = seqs.to(tl.int64)[:, None]
    acc = tl.zeros([SEQS, BLOCK_L], tl.float32)
    n = tl.zeros([SEQS], tl.int32)
    n_clip = tl.zeros([SEQS], tl.int32)
    for l0 in range(0, L, BLOCK_L):
        offs = l0 + tl.arange(0, BLOCK_L)
        ok = seq_ok[:, None] & (offs < L)[None, :]
        m, v, old, ret = _value_load(
            v_ptr, old_ptr, ret_ptr, m_ptr, b, offs[None, :], ok, s_v, s_old, s_ret, s_m
        )
        term, _, was_clipped = _value_terms(v, old, ret, clip, CLIP)
        acc += tl.where(m, term, 0.0)
        n += tl.sum(m.to(tl.int32), axis=1)
        n_clip += tl.sum((m & was_clipped).to(tl.int32), axis=1)
    # The layout of policy_loss's per-sequence stats, which its batch kernel reads: the loss
    # sum, the kept tokens, the clipped ones, the tokens of mask, the sequence kept.
    tl.store(seqf_ptr + seqs * 7, tree_sum(acc, LOG2_BLOCK_L), mask=seq_ok)
    i = seqi_ptr + seqs * 5
    tl.store(i + 0, n, mask=seq_ok)
    tl.store(i + 1, n_clip, mask=seq_ok)
    tl.store(i + 3, n, mask=seq_ok)
    tl.store(i + 4, n * 0 + 1, mask=seq_ok)


@jit
def _value_bwd_kernel(
    g_ptr,
    v_ptr,
    old_ptr,
    ret_ptr,
    m_ptr,
    seqi_ptr,
    coef_ptr,
    dv_ptr,
    B,
    L,
    s_v,
    s_old,
    s_ret,
    s_m,
    s_dv,
    clip,
    CLIP: tl.constexpr,
    PER_SEQ_MEAN: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seq_ok = seqs < B
    ok = seq_ok[:, None] & (offs < L)[None, :]
    b = seqs.to(tl.int64)[:, None]
    m, v, old, ret = _value_load(
        v_ptr, old_ptr, ret_ptr, m_ptr, b, offs[None, :], ok, s_v, s_old, s_ret, s_m
    )
    _, dterm, _ = _value_terms(v, old, ret, clip, CLIP)
    w = tl.zeros([SEQS], tl.float32) + tl.load(coef_ptr)
    if PER_SEQ_MEAN:
        w = _safe_div(w, tl.load(seqi_ptr + seqs * 5, mask=seq_ok, other=0).to(tl.float32))
    dv = tl.where(m, (tl.load(g_ptr) * w)[:, None] * dterm, 0.0)
    tl.store(dv_ptr + b * s_dv + offs[None, :], dv.to(dv_ptr.dtype.element_ty), mask=ok)


def _value_forward(v, old, ret, mask, norms, clip, batch_flags, table):
    """The value loss's launches: ``(loss, metrics, seqi, coef)``, the last two what the
    backward reads (each sequence's integer statistics and the gradient's scale)."""
    B, L = v.shape
    v, old, ret, m = _rows(v), _rows(old), _rows(ret), _mask_rows(mask)
    # Zeros: the batch kernel also reads the stats policy_loss's metrics come from.
    seqf = torch.zeros(B, NF, dtype=torch.float32, device=v.device)
    seqi = torch.zeros(B, NI, dtype=torch.int32, device=v.device)
    if B:
        cfg = dict(tuning.config(table, "value_loss.seq", B=B, L=L))
        seqs = cfg.pop("SEQS")
        _value_seq_kernel[(cdiv(B, seqs),)](
            v,
            old,
            ret,
            m,
            seqf,
            seqi,
            B,
            L,
            v.stride(0),
            old.stride(0),
            ret.stride(0),
            m.stride(0),
            0.0 if clip is None else float(clip),
            CLIP=clip is not None,
            BLOCK_L=BLOCK_L,
            LOG2_BLOCK_L=_log2(BLOCK_L),
            SEQS=seqs,
            **cfg,
        )
    loss, metrics, coef = aggregate(seqf, seqi, norms, batch_flags, table, "value_loss.batch", L)
    return loss, metrics, seqi, coef


def _value_backward(g_loss, v, old, ret, mask, seqi, coef, clip, per_seq_mean, table):
    """The value loss's gradient with respect to ``v``: one launch on the forward's inputs
    and its ``seqi`` and ``coef``."""
    B, L = v.shape
    v, old, ret, m = _rows(v), _rows(old), _rows(ret), _mask_rows(mask)
    dv = torch.empty(B, L, dtype=v.dtype, device=v.device)
    if B and L:
        cfg = dict(tuning.config(table, "value_loss.bwd", B=B, L=L))
        seqs, block = cfg.pop("SEQS"), cfg.pop("BLOCK")
        g = g_loss.detach().float().reshape(1).contiguous()
        _value_bwd_kernel[(cdiv(B, seqs), cdiv(L, block))](
            g,
            v,
            old,
            ret,
            m,
            seqi,
            coef,
            dv,
            B,
            L,
            v.stride(0),
            old.stride(0),
            ret.stride(0),
            m.stride(0),
            dv.stride(0),
            0.0 if clip is None else float(clip),
            CLIP=clip is not None,
            PER_SEQ_MEAN=per_seq_mean,
            SEQS=seqs,
            BLOCK=block,
            **cfg,
        )
    return dv


class ValueLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, old, ret, mask, norms, clip, batch_flags, table):
        loss, metrics, seqi, coef = _value_forward(
            v, old, ret, mask, norms, clip, batch_flags, table
        )
        ctx.save_for_backward(v, old, ret, mask, seqi, coef)
        ctx.clip, ctx.table, ctx.per_seq_mean = clip, table, batch_flags["PER_SEQ_MEAN"]
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, g_loss, _g_metrics):
        v, old, ret, mask, seqi, coef = ctx.saved_tensors
        dv = _value_backward(g_loss, v, old, ret, mask, seqi, coef, ctx.clip, ctx.per_seq_mean,
                             ctx.table)  # fmt: skip
        return (dv,) + (None,) * 7


def _value_plan(values, agg, num_tokens, num_seqs, norm_length):
    """The forward's small device inputs (``norms``) and the batch kernel's flags."""
    if norm_length is None:
        norm_length = values.shape[1]
    norms = _norms(values.device, num_tokens, num_seqs, norm_length, False)
    return norms, agg_flags(agg, num_tokens, num_seqs)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    table: tuning.TuningTable,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (semantics: :func:`rlk.value_loss`).

    Shapes: ``values`` (differentiable), ``old_values``, ``returns``, ``mask`` ``[B, L]``.
    Returns a 0-d fp32 loss and ``{"clip_fraction": 0-d fp32}``.

    Example::

        loss, m = value_loss(v, old_v, ret, mask, clip=0.5, table=table)
    """
    norms, batch_flags = _value_plan(values, agg, num_tokens, num_seqs, norm_length)
    loss, buf = ValueLossFunction.apply(
        values, old_values.detach(), returns.detach(), mask, norms, clip, batch_flags, table
    )
    return loss, {"clip_fraction": buf[METRICS.index("clip_fraction")]}


def _split_forward(values, old_values, returns, mask, *, clip, agg, num_tokens, num_seqs,
                   norm_length, table):  # fmt: skip
    """value_loss's forward for the torch.compile path (rlk._library): the outputs (the loss,
    the clip fraction as a ``[1]`` tensor) and the extras its backward reads (``seqi``,
    ``coef``)."""
    norms, flags = _value_plan(values, agg, num_tokens, num_seqs, norm_length)
    loss, buf, seqi, coef = _value_forward(values, old_values, returns, mask, norms, clip, flags,
                                           table)  # fmt: skip
    return (loss, buf[METRICS.index("clip_fraction")].reshape(1)), (seqi, coef)


def _split_backward(grads, outs, extras, needs, values, old_values, returns, mask, *, clip, agg,
                    num_tokens, num_seqs, norm_length, table):  # fmt: skip
    """value_loss's backward for the torch.compile path: ValueLossFunction's one launch."""
    seqi, coef = extras
    g = grads[0]
    if g is None:
        g = torch.zeros((), dtype=torch.float32, device=values.device)
    per_seq_mean = agg_flags(agg, num_tokens, num_seqs)["PER_SEQ_MEAN"]
    dv = _value_backward(g, values, old_values, returns, mask, seqi, coef, clip, per_seq_mean,
                         table)  # fmt: skip
    return (dv,)


#: Forward and backward as two calls, for the torch.compile path (rlk._library).
AUTOGRAD = {"value_loss": (_split_forward, _split_backward)}


def _choose_seqs(B: int, L: int) -> int:
    return 0 if B < 256 else 1


TUNING = {
    "gae_advantages.scan": tuning.Rule(
        configs=({"SEQS": 16, "num_warps": 1}, {"SEQS": 64, "num_warps": 2}, {"SEQS": 1}),
        choose=_choose_seqs,
    ),
    "gae_advantages.whiten": tuning.Rule(configs=({"num_warps": 4}, {"num_warps": 8})),
    "value_loss.seq": tuning.Rule(
        configs=({"SEQS": 1, "num_warps": 4}, {"SEQS": 4, "num_warps": 8}, {"SEQS": 2}),
        choose=_choose_seqs,
    ),
    "value_loss.batch": tuning.Rule(configs=({"num_warps": 4}, {"num_warps": 8})),
    "value_loss.bwd": tuning.Rule(
        configs=(
            {"SEQS": 1, "BLOCK": 1024, "num_warps": 4},
            {"SEQS": 4, "BLOCK": 512, "num_warps": 8},
            {"SEQS": 2, "BLOCK": 64, "num_warps": 1},
        ),
        choose=_choose_seqs,
    ),
}
