"""RL objectives on padded ``[B, L]`` tensors: ``policy_loss``, ``kl_penalty``, ``grpo_advantages``.

Per-token terms are computed in fp32. Every floating-point sum has one order, fixed by constants
of this module: a sequence's tokens are accumulated lane-wise in blocks of :data:`BLOCK_L`
(lane ``i`` adds tokens ``i, i + BLOCK_L, ...`` in ascending order), then the lanes are added by
the fixed binary tree of :func:`rlk_triton.logprobs.tree_sum`; the sequences are combined the
same way in blocks of :data:`BLOCK_B` by a single program. Counts are integer sums (exact).
So the loss does not depend on tuning, and no step of the forward syncs with the host: the
metrics are 0-d views of a device buffer.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import jit, tl, triton
from rlk_triton.logprobs import tree_sum

#: Tokens per block of a sequence's sums (lanes of the fixed-order accumulation).
BLOCK_L = 256
#: Sequences per block of the batch sums.
BLOCK_B = 256
#: Rewards per block of a GRPO group's sums.
BLOCK_G = 64

AGG_CODES = {
    "token-mean": 0,
    "seq-mean-token-sum": 1,
    "seq-mean-token-mean": 2,
    "seq-mean-token-sum-norm": 3,
}
KL_CODES = {"k1": 0, "k2": 1, "k3": 2, "abs": 3}
#: Names of the policy-loss metrics, in the order of the metrics buffer.
METRICS = ("clip_fraction", "approx_kl", "ratio_mean", "ratio_max", "dual_clip_fraction")

_NF = 4  # float stats per sequence: pg sum, (old - new) sum, ratio sum, ratio max
_NI = 3  # int stats per sequence: tokens, clipped tokens, dual-clipped tokens


def _log2(n: int) -> int:
    return n.bit_length() - 1


# --------------------------------------------------------------------------------------------
# policy_loss
# --------------------------------------------------------------------------------------------


@jit
def _pg_terms(
    lp,
    old,
    adv,
    rollout,
    clip_low,
    clip_high,
    clip_c,
    tis_cap,
    DUAL: tl.constexpr,
    TIS: tl.constexpr,
):
    """Per-token ``(ratio, pg, d pg / d lp, clipped, dual_clipped)`` in fp32."""
    ratio = tl.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    was_clipped = clipped > unclipped
    pg = tl.maximum(unclipped, clipped)
    # Where the clamped term wins the ratio is outside the clamp range, so its gradient is 0.
    dpg = tl.where(was_clipped, 0.0, unclipped)
    dual = was_clipped != was_clipped  # all False
    if DUAL:
        bound = -adv * clip_c
        dual = (adv < 0) & (bound < pg)
        pg = tl.where(dual, bound, pg)
        dpg = tl.where(dual, 0.0, dpg)
    if TIS:
        w = tl.minimum(tl.exp(old - rollout), tis_cap)
        pg = pg * w
        dpg = dpg * w
    return ratio, pg, dpg, was_clipped, dual


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
    TIS: tl.constexpr,
):
    b = seqs.to(tl.int64)[:, None]
    l = offs[None, :]
    m = ok & (tl.load(mask_ptr + b * s_mask + l, mask=ok, other=0).to(tl.float32) != 0)
    lp = tl.load(lp_ptr + b * s_lp + l, mask=m, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + b * s_old + l, mask=m, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + b * s_adv_b + l * s_adv_l, mask=m, other=0.0).to(tl.float32)
    if TIS:
        roll = tl.load(roll_ptr + b * s_roll + l, mask=m, other=0.0).to(tl.float32)
    else:
        roll = old
    return m, lp, old, adv, roll


@jit
def _policy_seq_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    roll_ptr,
    mask_ptr,
    seqf_ptr,
    seqi_ptr,
    B,
    L,
    s_lp,
    s_old,
    s_adv_b,
    s_adv_l,
    s_roll,
    s_mask,
    clip_low,
    clip_high,
    clip_c,
    tis_cap,
    BLOCK_L: tl.constexpr,
    LOG2_BLOCK_L: tl.constexpr,
    SEQS: tl.constexpr,
    DUAL: tl.constexpr,
    TIS: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    seq_ok = seqs < B
    cols = tl.arange(0, BLOCK_L)
    acc_pg = tl.zeros([SEQS, BLOCK_L], tl.float32)
    acc_kl = tl.zeros([SEQS, BLOCK_L], tl.float32)
    acc_r = tl.zeros([SEQS, BLOCK_L], tl.float32)
    r_max = tl.zeros([SEQS], tl.float32)  # ratios are > 0, and an empty sequence reports 0
    n = tl.zeros([SEQS], tl.int32)
    n_clip = tl.zeros([SEQS], tl.int32)
    n_dual = tl.zeros([SEQS], tl.int32)
    for l0 in range(0, L, BLOCK_L):
        offs = l0 + cols
        ok = seq_ok[:, None] & (offs < L)[None, :]
        m, lp, old, adv, roll = _load_tokens(
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
            TIS,
        )
        ratio, pg, _, was_clipped, dual = _pg_terms(
            lp, old, adv, roll, clip_low, clip_high, clip_c, tis_cap, DUAL, TIS
        )
        acc_pg += tl.where(m, pg, 0.0)
        acc_kl += tl.where(m, old - lp, 0.0)
        acc_r += tl.where(m, ratio, 0.0)
        r_max = tl.maximum(r_max, tl.max(tl.where(m, ratio, 0.0), axis=1))
        n += tl.sum(m.to(tl.int32), axis=1)
        n_clip += tl.sum((m & was_clipped).to(tl.int32), axis=1)
        n_dual += tl.sum((m & dual).to(tl.int32), axis=1)
    f = seqf_ptr + seqs * 4
    tl.store(f + 0, tree_sum(acc_pg, LOG2_BLOCK_L), mask=seq_ok)
    tl.store(f + 1, tree_sum(acc_kl, LOG2_BLOCK_L), mask=seq_ok)
    tl.store(f + 2, tree_sum(acc_r, LOG2_BLOCK_L), mask=seq_ok)
    tl.store(f + 3, r_max, mask=seq_ok)
    i = seqi_ptr + seqs * 3
    tl.store(i + 0, n, mask=seq_ok)
    tl.store(i + 1, n_clip, mask=seq_ok)
    tl.store(i + 2, n_dual, mask=seq_ok)


@jit
def _safe_div(num, den):
    return tl.where(den > 0, tl.math.div_rn(num, tl.maximum(den, 1.0)), 0.0)


@jit
def _policy_batch_kernel(
    seqf_ptr,
    seqi_ptr,
    loss_ptr,
    met_ptr,
    tot_ptr,
    B,
    L,
    AGG: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LOG2_BLOCK_B: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK_B)
    acc_pg = tl.zeros([1, BLOCK_B], tl.float32)
    acc_pg_mean = tl.zeros([1, BLOCK_B], tl.float32)
    acc_kl = tl.zeros([1, BLOCK_B], tl.float32)
    acc_r = tl.zeros([1, BLOCK_B], tl.float32)
    r_max = tl.zeros([1], tl.float32)
    n_tok = tl.zeros([1], tl.int32)
    n_seq = tl.zeros([1], tl.int32)
    n_clip = tl.zeros([1], tl.int32)
    n_dual = tl.zeros([1], tl.int32)
    for b0 in range(0, B, BLOCK_B):
        b = b0 + lanes
        ok = b < B
        pg = tl.load(seqf_ptr + b * 4 + 0, mask=ok, other=0.0)[None, :]
        n = tl.load(seqi_ptr + b * 3 + 0, mask=ok, other=0)[None, :]
        acc_pg += pg
        acc_pg_mean += _safe_div(pg, n.to(tl.float32))
        acc_kl += tl.load(seqf_ptr + b * 4 + 1, mask=ok, other=0.0)[None, :]
        acc_r += tl.load(seqf_ptr + b * 4 + 2, mask=ok, other=0.0)[None, :]
        r_max = tl.maximum(
            r_max, tl.max(tl.load(seqf_ptr + b * 4 + 3, mask=ok, other=0.0)[None, :], axis=1)
        )
        n_tok += tl.sum(n, axis=1)
        n_seq += tl.sum((n > 0).to(tl.int32), axis=1)
        n_clip += tl.sum(tl.load(seqi_ptr + b * 3 + 1, mask=ok, other=0)[None, :], axis=1)
        n_dual += tl.sum(tl.load(seqi_ptr + b * 3 + 2, mask=ok, other=0)[None, :], axis=1)
    pg_sum = tree_sum(acc_pg, LOG2_BLOCK_B)
    tok = n_tok.to(tl.float32)
    seq = n_seq.to(tl.float32)
    if AGG == 0:
        loss = _safe_div(pg_sum, tok)
    elif AGG == 1:
        loss = _safe_div(pg_sum, seq)
    elif AGG == 2:
        loss = _safe_div(tree_sum(acc_pg_mean, LOG2_BLOCK_B), seq)
    else:
        loss = _safe_div(pg_sum, tl.zeros_like(pg_sum) + L)
    one = tl.arange(0, 1)
    tl.store(loss_ptr + one, loss)
    tl.store(met_ptr + one, _safe_div(n_clip.to(tl.float32), tok))
    tl.store(met_ptr + 1 + one, _safe_div(tree_sum(acc_kl, LOG2_BLOCK_B), tok))
    tl.store(met_ptr + 2 + one, _safe_div(tree_sum(acc_r, LOG2_BLOCK_B), tok))
    tl.store(met_ptr + 3 + one, r_max)
    tl.store(met_ptr + 4 + one, _safe_div(n_dual.to(tl.float32), tok))
    tl.store(tot_ptr + one, n_tok)
    tl.store(tot_ptr + 1 + one, n_seq)


@jit
def _policy_bwd_kernel(
    g_ptr,
    lp_ptr,
    old_ptr,
    adv_ptr,
    roll_ptr,
    mask_ptr,
    seqi_ptr,
    tot_ptr,
    dlp_ptr,
    B,
    L,
    s_lp,
    s_old,
    s_adv_b,
    s_adv_l,
    s_roll,
    s_mask,
    s_dlp,
    clip_low,
    clip_high,
    clip_c,
    tis_cap,
    AGG: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK: tl.constexpr,
    DUAL: tl.constexpr,
    TIS: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seq_ok = seqs < B
    ok = seq_ok[:, None] & (offs < L)[None, :]
    m, lp, old, adv, roll = _load_tokens(
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
        TIS,
    )
    _, _, dpg, _, _ = _pg_terms(lp, old, adv, roll, clip_low, clip_high, clip_c, tis_cap, DUAL, TIS)
    one = tl.zeros([SEQS], tl.float32) + 1.0
    if AGG == 0:
        w = _safe_div(one, one * tl.load(tot_ptr).to(tl.float32))
    elif AGG == 1:
        w = _safe_div(one, one * tl.load(tot_ptr + 1).to(tl.float32))
    elif AGG == 2:
        n = tl.load(seqi_ptr + seqs * 3, mask=seq_ok, other=0).to(tl.float32)
        w = _safe_div(_safe_div(one, n), one * tl.load(tot_ptr + 1).to(tl.float32))
    else:
        w = _safe_div(one, one * L)
    g = tl.load(g_ptr)
    dlp = tl.where(m, (g * w)[:, None] * dpg, 0.0)
    tl.store(
        dlp_ptr + seqs.to(tl.int64)[:, None] * s_dlp + offs[None, :],
        dlp.to(dlp_ptr.dtype.element_ty),
        mask=ok,
    )


# --------------------------------------------------------------------------------------------
# kl_penalty
# --------------------------------------------------------------------------------------------


@jit
def _kl_terms(d, KIND: tl.constexpr):
    """``(kl, d kl / d d)`` per token for ``d = logprobs - ref_logprobs``."""
    if KIND == 0:
        kl = d
        dkl = tl.zeros_like(d) + 1.0
    elif KIND == 1:
        kl = d * d * 0.5
        dkl = d
    elif KIND == 2:
        raw = tl.exp(-d) + d - 1.0
        kl = tl.minimum(tl.maximum(raw, -10.0), 10.0)
        dkl = tl.where((raw >= -10.0) & (raw <= 10.0), 1.0 - tl.exp(-d), 0.0)
    else:
        kl = tl.abs(d)
        dkl = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    return kl, dkl


@jit
def _kl_fwd_kernel(lp_ptr, ref_ptr, out_ptr, N, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    d = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32) - tl.load(
        ref_ptr + offs, mask=ok, other=0.0
    ).to(tl.float32)
    kl, _ = _kl_terms(d, KIND)
    tl.store(out_ptr + offs, kl, mask=ok)


@jit
def _kl_bwd_kernel(lp_ptr, ref_ptr, g_ptr, dlp_ptr, N, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    d = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32) - tl.load(
        ref_ptr + offs, mask=ok, other=0.0
    ).to(tl.float32)
    _, dkl = _kl_terms(d, KIND)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(dlp_ptr + offs, (g * dkl).to(dlp_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# grpo_advantages
# --------------------------------------------------------------------------------------------


@jit
def _grpo_kernel(
    r_ptr,
    out_ptr,
    n_groups,
    G,
    eps,
    GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    LOG2_BLOCK_G: tl.constexpr,
    NORM_STD: tl.constexpr,
):
    groups = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    g_ok = groups < n_groups
    base = groups.to(tl.int64)[:, None] * G
    cols = tl.arange(0, BLOCK_G)
    acc = tl.zeros([GROUPS, BLOCK_G], tl.float32)
    for i0 in range(0, G, BLOCK_G):
        ok = g_ok[:, None] & ((i0 + cols) < G)[None, :]
        acc += tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    size = tl.zeros([GROUPS], tl.float32) + G
    mean = tl.math.div_rn(tree_sum(acc, LOG2_BLOCK_G), size)
    if NORM_STD:
        acc = tl.zeros([GROUPS, BLOCK_G], tl.float32)
        for i0 in range(0, G, BLOCK_G):
            ok = g_ok[:, None] & ((i0 + cols) < G)[None, :]
            r = tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            d = tl.where(ok, r - mean[:, None], 0.0)
            acc += d * d
        std = tl.math.sqrt_rn(tl.math.div_rn(tree_sum(acc, LOG2_BLOCK_G), size - 1.0))
        den = std + eps
    for i0 in range(0, G, BLOCK_G):
        ok = g_ok[:, None] & ((i0 + cols) < G)[None, :]
        r = tl.load(r_ptr + base + i0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        adv = r - mean[:, None]
        if NORM_STD:
            adv = tl.math.div_rn(adv, den[:, None])
        tl.store(out_ptr + base + i0 + cols[None, :], adv, mask=ok)


# --------------------------------------------------------------------------------------------
# Tuning: launch parameters only
# --------------------------------------------------------------------------------------------


def _choose_seqs(B: int, L: int) -> int:
    return 0 if B < 256 else 1


TUNING = {
    "policy_loss.seq": tuning.Rule(
        configs=(
            {"SEQS": 1, "num_warps": 4},
            {"SEQS": 4, "num_warps": 8},
            {"SEQS": 2, "num_warps": 1},
        ),
        choose=_choose_seqs,
    ),
    "policy_loss.batch": tuning.Rule(configs=({"num_warps": 4}, {"num_warps": 8})),
    "policy_loss.bwd": tuning.Rule(
        configs=(
            {"SEQS": 1, "BLOCK": 1024, "num_warps": 4},
            {"SEQS": 4, "BLOCK": 512, "num_warps": 8},
            {"SEQS": 2, "BLOCK": 64, "num_warps": 1},
        ),
        choose=_choose_seqs,
    ),
    "kl_penalty.fwd": tuning.Rule(
        configs=(
            {"BLOCK": 1024, "num_warps": 4},
            {"BLOCK": 4096, "num_warps": 8},
            {"BLOCK": 128, "num_warps": 1},
        ),
    ),
    "kl_penalty.bwd": tuning.Rule(
        configs=(
            {"BLOCK": 1024, "num_warps": 4},
            {"BLOCK": 4096, "num_warps": 8},
            {"BLOCK": 128, "num_warps": 1},
        ),
    ),
    "grpo_advantages.fwd": tuning.Rule(
        configs=(
            {"GROUPS": 16, "num_warps": 4},
            {"GROUPS": 1, "num_warps": 1},
            {"GROUPS": 64, "num_warps": 8},
        ),
    ),
}


# --------------------------------------------------------------------------------------------
# Launchers, autograd, public functions
# --------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _policy_inputs(lp, old, adv, mask, rollout):
    lp, old, adv = _rows(lp), _rows(old), _rows(adv)
    mask = _rows(mask)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    s_adv = (adv.stride(0), 0) if adv.dim() == 1 else (adv.stride(0), adv.stride(1))
    rollout = _rows(rollout) if rollout is not None else old
    strides = (lp.stride(0), old.stride(0), *s_adv, rollout.stride(0), mask.stride(0))
    return lp, old, adv, mask, rollout, strides


class PolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, old, adv, mask, rollout, params, table):
        B, L = lp.shape
        clip_low, clip_high, clip_c, agg, tis_cap = params
        dual, tis = clip_c is not None, rollout is not None
        lp, old, adv, mask, roll, strides = _policy_inputs(lp, old, adv, mask, rollout)
        scalars = (clip_low, clip_high, clip_c or 0.0, tis_cap or 0.0)
        seqf = torch.empty(B, _NF, dtype=torch.float32, device=lp.device)
        seqi = torch.empty(B, _NI, dtype=torch.int32, device=lp.device)
        if B:
            cfg = dict(tuning.config(table, "policy_loss.seq", B=B, L=L))
            seqs = cfg.pop("SEQS")
            _policy_seq_kernel[(triton.cdiv(B, seqs),)](
                lp,
                old,
                adv,
                roll,
                mask,
                seqf,
                seqi,
                B,
                L,
                *strides,
                *scalars,
                BLOCK_L=BLOCK_L,
                LOG2_BLOCK_L=_log2(BLOCK_L),
                SEQS=seqs,
                DUAL=dual,
                TIS=tis,
                **cfg,
            )
        loss = torch.empty((), dtype=torch.float32, device=lp.device)
        metrics = torch.empty(len(METRICS), dtype=torch.float32, device=lp.device)
        tot = torch.empty(2, dtype=torch.int32, device=lp.device)
        cfg = tuning.config(table, "policy_loss.batch", B=B, L=L)
        _policy_batch_kernel[(1,)](
            seqf,
            seqi,
            loss,
            metrics,
            tot,
            B,
            L,
            AGG=AGG_CODES[agg],
            BLOCK_B=BLOCK_B,
            LOG2_BLOCK_B=_log2(BLOCK_B),
            **cfg,
        )
        ctx.save_for_backward(lp, old, adv, mask, roll, seqi, tot)
        ctx.strides, ctx.scalars, ctx.agg, ctx.dual, ctx.tis = strides, scalars, agg, dual, tis
        ctx.table, ctx.lp_dtype = table, lp.dtype
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, g_loss, _g_metrics):
        lp, old, adv, mask, roll, seqi, tot = ctx.saved_tensors
        B, L = lp.shape
        dlp = torch.empty(B, L, dtype=ctx.lp_dtype, device=lp.device)
        if B and L:
            cfg = dict(tuning.config(ctx.table, "policy_loss.bwd", B=B, L=L))
            seqs, block = cfg.pop("SEQS"), cfg.pop("BLOCK")
            g = g_loss.detach().float().reshape(1).contiguous()
            _policy_bwd_kernel[(triton.cdiv(B, seqs), triton.cdiv(L, block))](
                g,
                lp,
                old,
                adv,
                roll,
                mask,
                seqi,
                tot,
                dlp,
                B,
                L,
                *ctx.strides,
                dlp.stride(0),
                *ctx.scalars,
                AGG=AGG_CODES[ctx.agg],
                SEQS=seqs,
                BLOCK=block,
                DUAL=ctx.dual,
                TIS=ctx.tis,
                **cfg,
            )
        return dlp, None, None, None, None, None, None


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    table: tuning.TuningTable,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy loss (semantics: :func:`rlk.policy_loss`).

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` (bool or 0/1) ``[B, L]``; ``advantages``
    ``[B]`` or ``[B, L]``; ``rollout_logprobs`` ``[B, L]`` with ``tis_cap``. Returns a 0-d fp32
    loss, differentiable with respect to ``logprobs`` only, and 0-d detached fp32 metrics.

    Example::

        loss, m = policy_loss(lp, old, adv, mask, agg="token-mean", table=table)
    """
    params = (float(clip_low), float(clip_high), clip_c, agg, tis_cap)
    loss, buf = PolicyLossFunction.apply(
        logprobs,
        old_logprobs.detach(),
        advantages.detach(),
        mask,
        None if rollout_logprobs is None else rollout_logprobs.detach(),
        params,
        table,
    )
    names = METRICS if clip_c is not None else METRICS[:-1]
    return loss, {name: buf[i] for i, name in enumerate(names)}


class KLPenaltyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, ref, kind, table):
        lp, ref = lp.contiguous(), ref.contiguous()
        out = torch.empty(lp.shape, dtype=torch.float32, device=lp.device)
        n = lp.numel()
        if n:
            cfg = dict(tuning.config(table, "kl_penalty.fwd", N=n))
            block = cfg.pop("BLOCK")
            _kl_fwd_kernel[(triton.cdiv(n, block),)](
                lp, ref, out, n, KIND=KL_CODES[kind], BLOCK=block, **cfg
            )
        ctx.save_for_backward(lp, ref)
        ctx.kind, ctx.table = kind, table
        return out

    @staticmethod
    def backward(ctx, g):
        lp, ref = ctx.saved_tensors
        dlp = torch.empty_like(lp)
        n = lp.numel()
        if n:
            cfg = dict(tuning.config(ctx.table, "kl_penalty.bwd", N=n))
            block = cfg.pop("BLOCK")
            _kl_bwd_kernel[(triton.cdiv(n, block),)](
                lp, ref, g.contiguous(), dlp, n, KIND=KL_CODES[ctx.kind], BLOCK=block, **cfg
            )
        return dlp, None, None, None


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k3",
    *,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` -> fp32 ``[B, L]`` (semantics: :func:`rlk.kl_penalty`),
    differentiable with respect to ``logprobs``.

    Example::

        kl = kl_penalty(lp, ref_lp, "k3", table=table)
    """
    return KLPenaltyFunction.apply(logprobs, ref_logprobs.detach(), kind, table)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """GRPO advantages of ``rewards [N]`` in contiguous groups -> fp32 ``[N]`` (not differentiable).

    Example::

        adv = grpo_advantages(rewards, 8, table=table)
    """
    rewards = rewards.detach().contiguous()
    out = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    n_groups = rewards.numel() // group_size
    if n_groups:
        cfg = dict(tuning.config(table, "grpo_advantages.fwd", N=rewards.numel(), G=group_size))
        groups = cfg.pop("GROUPS")
        _grpo_kernel[(triton.cdiv(n_groups, groups),)](
            rewards,
            out,
            n_groups,
            group_size,
            float(eps),
            GROUPS=groups,
            BLOCK_G=BLOCK_G,
            LOG2_BLOCK_G=_log2(BLOCK_G),
            NORM_STD=bool(norm_std),
            **cfg,
        )
    return out
