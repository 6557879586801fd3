"""Outcome-reward advantages (GRPO, RLOO, REINFORCE++ and its baseline, OPO, Pass@k):
``grpo_advantages``.

Semantics: the docstring of ``rlk.grpo_advantages`` (the arguments arrive validated and
normalised). A group's members are summed in their batch order in blocks of :data:`BLOCK_G`,
the batch in blocks of ``BLOCK_B`` by one program, each by the fixed tree of
:mod:`rlk_triton._objectives`, so the results do not depend on tuning.
"""

from __future__ import annotations

import math

import torch

from rlk_triton import tuning
from rlk_triton._objectives import BLOCK_B, _log2, _safe_div
from rlk_triton._triton import cdiv, jit, tl
from rlk_triton.logprobs import tree_sum
from rlk_triton.norm import _pow2

#: Rewards per block of a GRPO group's sums.
BLOCK_G = 64

ADV_CODES = {
    "grpo": 0,
    "rloo": 1,
    "reinforce++-baseline": 2,
    "reinforce++": 3,
    "rloo_vectorized": 4,
    "opo": 5,
    "grpo_passk": 6,
}
NORM_CODES = {"group": 0, "none": 1, "batch": 2}


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _group_moments(r_ptr, base, cnt, span, inv, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                   LOG2_BLOCK_G: tl.constexpr, STD: tl.constexpr):  # fmt: skip
    """``(mean, std, max |r|)`` of each group's rewards multiplied by ``inv`` (1, or a power of
    two: exact), the sums in the fixed order; ``std`` is 0 unless ``STD``."""
    cols = tl.arange(0, BLOCK_G)
    acc = tl.zeros([GROUPS, BLOCK_G], tl.float32)
    amax = tl.zeros([GROUPS, BLOCK_G], tl.float32)
    for i0 in range(0, span, BLOCK_G):
        ok = (i0 + cols)[None, :] < cnt[:, None]
        r = tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        r = r * inv[:, None]
        acc += r
        amax = tl.maximum(amax, tl.abs(r))
    size = cnt.to(tl.float32)
    mean = tl.where(cnt == 1, 0.0, _safe_div(tree_sum(acc, LOG2_BLOCK_G), size))  # alone: 0
    std = tl.zeros([GROUPS], tl.float32)
    if STD:
        acc = tl.zeros([GROUPS, BLOCK_G], tl.float32)
        for i0 in range(0, span, BLOCK_G):
            ok = (i0 + cols)[None, :] < cnt[:, None]
            r = tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            d = tl.where(ok, r * inv[:, None] - mean[:, None], 0.0)
            acc += d * d
        std = tl.math.sqrt_rn(_safe_div(tree_sum(acc, LOG2_BLOCK_G), size - 1.0))
    return mean, std, tl.max(amax, 1)


@jit
def _group_max(r_ptr, base, cnt, span, skip, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """``(max, first index of it)`` of each group's rewards, leaving out member ``skip``."""
    # Element-wise accumulators reduced once after each loop (max and min are exact, so the
    # order is free): a reduction inside the loop feeding its carried value is what Triton
    # 3.6's thread-locality pass rewrites, and it asserts when that value has two uses.
    cols = tl.arange(0, BLOCK_G)
    best2 = tl.zeros([GROUPS, BLOCK_G], tl.float32) - float("inf")
    for i0 in range(0, span, BLOCK_G):
        idx = (i0 + cols)[None, :]
        ok = (idx < cnt[:, None]) & (idx != skip[:, None])
        r = tl.load(r_ptr + base + idx, mask=ok, other=-float("inf")).to(tl.float32)
        best2 = tl.maximum(best2, r)
    best = tl.max(best2, 1)
    first2 = tl.zeros([GROUPS, BLOCK_G], tl.int32) + span
    for i0 in range(0, span, BLOCK_G):
        idx = (i0 + cols)[None, :]
        ok = (idx < cnt[:, None]) & (idx != skip[:, None])
        r = tl.load(r_ptr + base + idx, mask=ok, other=-float("inf")).to(tl.float32)
        first2 = tl.minimum(first2, tl.where(ok & (r == best[:, None]), idx, span))
    return best, tl.min(first2, 1)


@jit
def _group_kernel(
    r_ptr,
    w_ptr,
    start_ptr,
    count_ptr,
    out_ptr,
    n_seg,
    span,
    eps,
    GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    LOG2_BLOCK_G: tl.constexpr,
    EST: tl.constexpr,
    STD: tl.constexpr,
):
    """Per group (a segment of ``r`` of at most ``span`` members): GRPO / RLOO / baseline / OPO
    / Pass@k advantages of its members; ``STD``: divided by the group's std (GRPO, Pass@k).
    ``w``: the members' response lengths (OPO's weights)."""
    segs = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    s_ok = segs < n_seg
    base = tl.load(start_ptr + segs, mask=s_ok, other=0).to(tl.int64)[:, None]
    cnt = tl.load(count_ptr + segs, mask=s_ok, other=0)
    cols = tl.arange(0, BLOCK_G)
    size = cnt.to(tl.float32)
    single = cnt == 1
    inv = tl.zeros([GROUPS], tl.float32) + 1.0
    mean, std, amax = _group_moments(
        r_ptr, base, cnt, span, inv, GROUPS, BLOCK_G, LOG2_BLOCK_G, STD
    )
    # A sum or a square of finite rewards can overflow in fp32 where the float64 reference does
    # not (|r| near 1e19 and above): such groups are computed again on the rewards scaled by a
    # power of two (exact), and only they, so the bits of every other group are unchanged.
    over = ((tl.abs(mean) == float("inf")) | (std == float("inf"))) & (amax < float("inf"))
    if tl.max(over.to(tl.int32), 0) > 0:
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        inv = tl.where(over, _pow2(tl.maximum(tl.where(over, -e, 0), -126)), 1.0)
        mean, std, _ = _group_moments(
            r_ptr, base, cnt, span, inv, GROUPS, BLOCK_G, LOG2_BLOCK_G, STD
        )
    if STD:
        den = tl.where(single, 1.0, std) + eps * inv
    if EST == 5:  # OPO: the length-weighted mean of the group (a group of one: 0)
        acc = tl.zeros([GROUPS, BLOCK_G], tl.float32)
        acc_w = tl.zeros([GROUPS, BLOCK_G], tl.float32)
        for i0 in range(0, span, BLOCK_G):
            ok = (i0 + cols)[None, :] < cnt[:, None]
            r = tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + base + i0 + cols[None, :], mask=ok, other=0).to(tl.float32)
            acc += w * r
            acc_w += w
        wsum = tree_sum(acc_w, LOG2_BLOCK_G)
        mean = _safe_div(tree_sum(acc, LOG2_BLOCK_G), wsum)
        mean = tl.where(single, 0.0, tl.where(wsum == wsum, mean, wsum))  # a NaN weight: NaN
    if EST == 6:  # Pass@k: only the best member, by the margin over the second best
        top, i_top = _group_max(r_ptr, base, cnt, span, cnt * 0 - 1, GROUPS, BLOCK_G)
        second, _ = _group_max(r_ptr, base, cnt, span, i_top, GROUPS, BLOCK_G)
        gap = tl.where(single, 0.0, top - second)
    for i0 in range(0, span, BLOCK_G):
        ok = (i0 + cols)[None, :] < cnt[:, None]
        r = tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if EST == 6:
            hit = (i0 + cols)[None, :] == i_top[:, None]
            adv = tl.where(hit, gap[:, None], 0.0)
            if STD:
                # std / inv: the std of the rewards' scale, exact (inv is a power of two)
                pk_den = tl.where(single, 1.0, tl.math.div_rn(std, inv)) + eps
                adv = tl.math.div_rn(adv, pk_den[:, None])
        else:
            r = r * inv[:, None]
            adv = r - mean[:, None]
            if STD:
                adv = tl.math.div_rn(adv, den[:, None])
            else:
                if EST == 1 or EST == 4:
                    n1 = tl.maximum(size - 1.0, 1.0)[:, None]
                    keep = r  # a group of one keeps r (rloo) or gets 0 (rloo_vectorized)
                    if EST == 4:
                        keep = r * 0.0
                    adv = tl.where(single[:, None], keep, tl.math.div_rn(adv * size[:, None], n1))
                adv = tl.math.div_rn(adv, inv[:, None])  # back to the rewards' scale (exact)
        tl.store(out_ptr + base + i0 + cols[None, :], adv, mask=ok)


@jit
def _batch_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    out_ptr,
    N,
    eps,
    WHITEN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LOG2_BLOCK_B: tl.constexpr,
):
    """One program over the batch. ``WHITEN``: ``(x - mu) / sqrt(var + 1e-8)`` with the
    ``w``-weighted mean and unbiased variance of ``x`` (REINFORCE++). Else ``y / (std + eps)``
    with the unbiased std of ``x`` (GRPO with the batch std)."""
    lanes = tl.arange(0, BLOCK_B)
    acc = tl.zeros([1, BLOCK_B], tl.float32)
    acc_w = tl.zeros([1, BLOCK_B], tl.float32)
    for i0 in range(0, N, BLOCK_B):
        ok = (i0 + lanes) < N
        x = tl.load(x_ptr + i0 + lanes, mask=ok, other=0.0).to(tl.float32)[None, :]
        if WHITEN:
            w = tl.load(w_ptr + i0 + lanes, mask=ok, other=0).to(tl.float32)[None, :]
        else:
            w = tl.where(ok, 1.0, 0.0)[None, :]
        acc += w * x
        acc_w += w
    total = tree_sum(acc_w, LOG2_BLOCK_B)
    mu = _safe_div(tree_sum(acc, LOG2_BLOCK_B), total)
    if WHITEN:
        mu = tl.where(total == total, mu, total)  # a NaN weight: NaN (_safe_div would give 0)
    acc = tl.zeros([1, BLOCK_B], tl.float32)
    for i0 in range(0, N, BLOCK_B):
        ok = (i0 + lanes) < N
        x = tl.load(x_ptr + i0 + lanes, mask=ok, other=0.0).to(tl.float32)[None, :]
        if WHITEN:
            w = tl.load(w_ptr + i0 + lanes, mask=ok, other=0).to(tl.float32)[None, :]
        else:
            w = tl.where(ok, 1.0, 0.0)[None, :]
        d = x - mu[:, None]
        acc += w * (d * d)
    var = tl.where(total >= 2.0, _safe_div(tree_sum(acc, LOG2_BLOCK_B), total - 1.0), 0.0)
    if WHITEN:
        den = tl.math.sqrt_rn(var + 1e-8)
    else:
        den = tl.math.sqrt_rn(var) + eps
    for i0 in range(0, N, BLOCK_B):
        ok = (i0 + lanes) < N
        if WHITEN:
            y = tl.load(x_ptr + i0 + lanes, mask=ok, other=0.0).to(tl.float32) - mu
        else:
            y = tl.load(y_ptr + i0 + lanes, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i0 + lanes, tl.math.div_rn(y, den), mask=ok)


# --------------------------------------------------------------------------------------------
# Tuning: launch parameters only
# --------------------------------------------------------------------------------------------


TUNING = {
    "grpo_advantages.fwd": tuning.Rule(
        configs=(
            {"GROUPS": 16, "num_warps": 4},
            {"GROUPS": 1, "num_warps": 1},
            {"GROUPS": 64, "num_warps": 8},
        ),
    ),
    "grpo_advantages.batch": tuning.Rule(configs=({"num_warps": 4}, {"num_warps": 8})),
}


# --------------------------------------------------------------------------------------------
# Launchers, public function
# --------------------------------------------------------------------------------------------


def _segments(group_size, group_ids, n, device):
    """``(order, starts, counts, n_seg)``: the groups as segments of ``rewards[order]``.

    With ``group_ids`` a stable sort keeps each group's members in their batch order; starts
    and counts come from integer scatters (exact), and there are ``n`` segment slots (empty ones
    have count 0), so nothing waits for the host."""
    if group_ids is None:
        n_seg = n // group_size
        starts = torch.arange(n_seg, dtype=torch.int64, device=device) * group_size
        counts = torch.full((n_seg,), group_size, dtype=torch.int32, device=device)
        return None, starts, counts, n_seg
    order = torch.sort(group_ids, stable=True).indices
    sid = group_ids[order]
    first = torch.ones(n, dtype=torch.int64, device=device)
    first[1:] = (sid[1:] != sid[:-1]).to(torch.int64)
    seg = torch.cumsum(first, 0) - 1
    pos = torch.arange(n, dtype=torch.int64, device=device)
    starts = torch.full((n,), n, dtype=torch.int64, device=device)
    starts = starts.scatter_reduce(0, seg, pos, reduce="amin")
    counts = torch.zeros(n, dtype=torch.int32, device=device)
    counts = counts.scatter_add(0, seg, torch.ones(n, dtype=torch.int32, device=device))
    return order, starts, counts, n


def _row_weights(mask: torch.Tensor) -> torch.Tensor:
    """Each row's token count: int32 for a bool mask; else fp32, NaN for a row holding a value
    other than 0 or 1 (the host reads mask only where value checks run), so that the advantages
    it weighs are NaN (all of them when whitened, its group's for OPO), as in the reference."""
    weights = mask.bool().sum(-1, dtype=torch.int32)
    if mask.dtype == torch.bool:
        return weights
    return torch.where(((mask == 0) | (mask == 1)).all(-1), weights.float(), math.nan)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    norm_std: str = "group",
    eps: float = 1e-6,
    group_ids: torch.Tensor | None = None,
    estimator: str = "grpo",
    mask: torch.Tensor | None = None,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Outcome-reward advantages of ``rewards [N]`` -> fp32 ``[N]`` (not differentiable;
    semantics: :func:`rlk.grpo_advantages`). ``norm_std``: ``"group"``, ``"batch"``,
    ``"none"`` (or ``True``/``False``).

    Example::

        adv = grpo_advantages(rewards, 8, table=table)
    """
    if isinstance(norm_std, bool):
        norm_std = "group" if norm_std else "none"
    est, norm = ADV_CODES[estimator], NORM_CODES[norm_std]
    if est not in (0, 6):
        norm = 1
    rewards = rewards.detach().contiguous()
    device = rewards.device
    n = rewards.numel()
    out = torch.empty(n, dtype=torch.float32, device=device)
    if n == 0:
        return out
    if est == 3:
        v = rewards
    else:
        order, starts, counts, n_seg = _segments(group_size, group_ids, n, device)
        r = rewards if order is None else rewards[order]
        w = r  # unread unless OPO
        if est == 5:
            w = _row_weights(mask)
            w = w if order is None else w[order]
        v = torch.empty(n, dtype=torch.float32, device=device)
        cfg = dict(tuning.config(table, "grpo_advantages.fwd", N=n, G=group_size or 0))
        groups = cfg.pop("GROUPS")
        _group_kernel[(cdiv(n_seg, groups),)](
            r,
            w,
            starts,
            counts,
            v,
            n_seg,
            n if group_size is None else group_size,
            float(eps),
            GROUPS=groups,
            BLOCK_G=BLOCK_G,
            LOG2_BLOCK_G=_log2(BLOCK_G),
            EST=est,
            STD=est in (0, 6) and norm == 0,
            **cfg,
        )
        if order is not None:
            v = torch.empty_like(v).index_copy_(0, order, v)
    if est not in (2, 3) and norm != 2:
        return v
    whiten = est in (2, 3)
    weights = _row_weights(mask) if whiten else v
    cfg = tuning.config(table, "grpo_advantages.batch", N=n)
    _batch_norm_kernel[(1,)](
        v if whiten else rewards,
        weights,
        v,
        out,
        n,
        float(eps),
        WHITEN=whiten,
        BLOCK_B=BLOCK_B,
        LOG2_BLOCK_B=_log2(BLOCK_B),
        **cfg,
    )
    return out
