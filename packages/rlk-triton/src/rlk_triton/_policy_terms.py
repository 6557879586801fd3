"""The per-token and per-sequence terms of :mod:`rlk_triton.policy_loss`'s kernels.

The clipped surrogate and its gradient, bounded importance weights, the token- and
sequence-level rejection masks and the loads of a block of tokens: fp32 on one token, or on
one sequence's sums.
"""

from __future__ import annotations

from rlk_triton._objectives import _max2, _min2, _safe_div
from rlk_triton._triton import jit, tl


@jit
def _pg_terms(ratio, adv, clip_low, clip_high, clip_c, DUAL: tl.constexpr):
    """Per-token ``(pg, d pg / d lp, clipped, dual_clipped)`` in fp32 for a ratio whose
    gradient with respect to the token's log-prob is the ratio itself."""
    unclipped = -adv * ratio
    clipped = -adv * _min2(_max2(ratio, 1.0 - clip_low), 1.0 + clip_high)
    was_clipped = clipped > unclipped
    pg = _max2(unclipped, clipped)
    # Where the clamped term wins the ratio is outside the clamp range, so its gradient is 0.
    dpg = tl.where(was_clipped, 0.0, unclipped)
    dual = was_clipped != was_clipped  # all False
    if DUAL:
        bound = -adv * clip_c
        dual = (adv < 0) & (bound < pg)
        pg = tl.where(dual, bound, pg)
        dpg = tl.where(dual, 0.0, dpg)
    return pg, dpg, was_clipped, dual


@jit
def _bounded(w, is_min, is_max, MODE: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MAX: tl.constexpr):
    """Importance weights bounded by ``[is_min, is_max]``: clamped (MODE 0) or zeroed outside."""
    if MODE == 0:
        if HAS_MIN:
            w = _max2(w, is_min)
        if HAS_MAX:
            w = _min2(w, is_max)
    else:
        inside = w == w  # a NaN weight is outside the range, as in the reference
        if HAS_MIN:
            inside = inside & (w >= is_min)
        if HAS_MAX:
            inside = inside & (w <= is_max)
        w = tl.where(inside, w, 0.0)
    return w


@jit
def _clamp_log(x):
    return _min2(_max2(x, -20.0), 20.0)


@jit
def _token_keep(dc, thr_ptr, RS: tl.constexpr):
    """Tokens the token-level rejection options keep (``dc``: old - rollout, clamped)."""
    keep = dc == dc  # all True
    if RS & 1:  # token_k1 = -dc within [log lower, log upper]
        keep = keep & (-dc >= tl.load(thr_ptr + 0)) & (-dc <= tl.load(thr_ptr + 1))
    if RS & 2:
        keep = keep & (dc * dc * 0.5 <= tl.load(thr_ptr + 3))
    if RS & 4:
        keep = keep & (tl.exp(dc) - 1.0 - dc <= tl.load(thr_ptr + 5))
    return keep


@jit
def _seq_keep(s1, s2, s3, m2, m3, n, thr_ptr, RS: tl.constexpr):
    """Sequences the sequence-level rejection options keep, from the sums ``s1..s3`` of
    k1..k3 over the sequence's tokens, the maxima ``m2``/``m3`` and the token count ``n``."""
    keep = n >= 0  # all True
    nf = n.to(tl.float32)
    if RS & 8:
        keep = keep & (s1 >= tl.load(thr_ptr + 6)) & (s1 <= tl.load(thr_ptr + 7))
    if RS & 16:
        keep = keep & (s2 <= tl.load(thr_ptr + 9))
    if RS & 32:
        keep = keep & (s3 <= tl.load(thr_ptr + 11))
    if RS & 64:
        mean1 = _safe_div(s1, nf)
        keep = keep & (mean1 >= tl.load(thr_ptr + 12)) & (mean1 <= tl.load(thr_ptr + 13))
    if RS & 128:
        keep = keep & (_safe_div(s2, nf) <= tl.load(thr_ptr + 15))
    if RS & 256:
        keep = keep & (_safe_div(s3, nf) <= tl.load(thr_ptr + 17))
    if RS & 512:
        keep = keep & (m2 <= tl.load(thr_ptr + 19))
    if RS & 1024:
        keep = keep & (m3 <= tl.load(thr_ptr + 21))
    return keep


@jit
def _load_tokens(
    lp_ptr,
    old_ptr,
    adv_ptr,
    roll_ptr,
    mask_ptr,
    seqs,
    offs,
    ok,
    s_lp,
    s_old,
    s_adv_b,
    s_adv_l,
    s_roll,
    s_mask,
    ROLL: tl.constexpr,
):
    """A block of tokens: ``(mask, lp, old, adv, old - rollout)`` (0 where masked out).

    A mask value other than 0 or 1 (0.5, NaN: the host reads the mask only where value checks
    run) counts as a token whose log-prob is NaN, so the loss and that token's gradient are NaN
    rather than those of a mask of 1 (as in the reference)."""
    b = seqs.to(tl.int64)[:, None]
    l = offs[None, :]
    given = tl.load(mask_ptr + b * s_mask + l, mask=ok, other=0).to(tl.float32)
    m = ok & (given != 0)
    lp = tl.load(lp_ptr + b * s_lp + l, mask=m, other=0.0).to(tl.float32)
    lp = tl.where(m & (given != 1), float("nan"), lp)
    old = tl.load(old_ptr + b * s_old + l, mask=m, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + b * s_adv_b + l * s_adv_l, mask=m, other=0.0).to(tl.float32)
    if ROLL:
        delta = old - tl.load(roll_ptr + b * s_roll + l, mask=m, other=0.0).to(tl.float32)
    else:
        delta = old - old
    return m, lp, old, adv, delta


@jit
def _geo_log_ratio(x, adv, clip_low, clip_high):
    """GMPO's per-token log-ratio ``x`` clamped towards ``sign(adv)``, and its derivative."""
    c = _min2(_max2(x, -clip_low), clip_high)
    up = adv > 0
    down = adv < 0
    k = tl.where(up, _min2(x, c), tl.where(down, _max2(x, c), 0.0))
    dk = tl.where((up & (x <= c)) | (down & (x >= c)), 1.0, 0.0)
    return k, dk


@jit
def _mode_terms(
    lp,
    old,
    ratio,
    adv,
    aux,
    clip_low,
    clip_high,
    clip_c,
    p0,
    p1,
    p2,
    p3,
    MODE: tl.constexpr,
    DUAL: tl.constexpr,
):
    """Per-token ``(pg, d pg / d lp, clipped, capped)`` of objective ``MODE`` (the index of
    ``rlk.ops.LOSS_MODES``) in fp32. ``ratio``: the token's (or, for ``geo_mean``, the
    sequence's) ratio; ``aux``: ``geo_mean``'s sequence advantage or ``vespo``'s clamped
    sequence log-ratio; ``p0..p3``: the mode's parameters in ``MODE_PARAMS`` order."""
    if MODE == 0:
        return _pg_terms(ratio, adv, clip_low, clip_high, clip_c, DUAL)
    never = ratio < -1.0  # all False: ratios are >= 0 or NaN
    if MODE == 1:  # cispo: -sg(clip(r)) * A * lp
        w = _min2(_max2(ratio, 1.0 - clip_low), 1.0 + clip_high)
        return -w * adv * lp, -w * adv, w != ratio, never
    if MODE == 2 or MODE == 3:  # dppo_tv, dppo_kl: -A * sg(min(r, c)) * lp on the trusted tokens
        p = tl.exp(lp)
        po = tl.exp(old)
        if MODE == 2:
            d = p - po
            valid = tl.where(adv > 0, d <= clip_high, d >= -clip_low)
        else:
            bkl = po * (old - lp) + (1.0 - po) * tl.log((1.0 - po + 1e-8) / (1.0 - p + 1e-8))
            valid = tl.where(adv > 0, (bkl <= clip_high) | (p <= po), (bkl <= clip_low) | (p >= po))
        t = ratio
        capped = never
        if DUAL:
            t = _min2(ratio, clip_c)
            capped = (ratio > clip_c) & valid
        v = valid.to(tl.float32)
        return -adv * t * lp * v, -adv * t * v, ~valid, capped
    if MODE == 4:  # sapo: -A * sigmoid(tau (r - 1)) * 4 / tau
        tau = tl.where(adv > 0, p0, p1)
        s = tl.sigmoid(tau * (ratio - 1.0))
        return -s * (4.0 / tau) * adv, -adv * 4.0 * s * (1.0 - s) * ratio, never, never
    if MODE == 5:  # dro: -(A * lp - beta / 2 * (lp - old)^2)
        x = lp - old
        return -(lp * adv - 0.5 * p0 * x * x), -(adv - p0 * x), never, never
    if MODE == 6:  # gpg: -A * lp
        return -lp * adv, -adv, never, never
    if MODE == 7:  # geo_mean: -mean(A) * exp(mean of the clamped log-ratios)
        _, dk = _geo_log_ratio(lp - old, adv, clip_low, clip_high)
        x = lp - old
        pg = -aux * ratio
        return pg, pg * dk, (x < -clip_low) | (x > clip_high), never
    # vespo: -sg(phi(w)) * A * lp, phi(w) = exp(lam + k log w - lam w) of the sequence's w
    nonneg = adv >= 0
    k = tl.where(nonneg, p0, p2)
    lam = _max2(tl.where(nonneg, p1, p3), 1e-4)
    phi = tl.exp(lam + k * aux - lam * tl.exp(aux))
    phi = tl.where(phi <= 3.4028234e38, phi, 0.0)  # NaN and inf to 0, as TRL's nan_to_num
    return -phi * adv * lp, -phi * adv, never, never
