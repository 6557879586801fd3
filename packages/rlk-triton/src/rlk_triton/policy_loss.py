"""The clipped policy loss on padded ``[B, L]`` tensors: ``policy_loss``.

Semantics: the docstring of ``rlk.policy_loss`` (the arguments arrive validated and
normalised). Per-token terms are computed in fp32, every sum in the fixed order of
:mod:`rlk_triton._objectives` (tokens in blocks of :data:`BLOCK_L`, sequences in blocks of
``BLOCK_B``), so the results do not depend on tuning, and no step syncs with the host: the
metrics are 0-d views of a device buffer.

policy_loss runs three kernels: per sequence (a first pass over the tokens when the sequence
needs a statistic first: GSPO's mean log-ratio, a sequence-level importance weight, a rejection
statistic), then one program for the batch (aggregation, metrics, the gradient's scale), then
per token for the backward (no atomics).
"""

from __future__ import annotations

import math

import torch

from rlk.ops import LOSS_MODES, REJECT_OPTIONS
from rlk_triton import tuning
from rlk_triton._objectives import (
    METRICS,
    NF,
    NI,
    _log2,
    _max2,
    _min2,
    _row_max,
    _safe_div,
    agg_flags,
    aggregate,
)
from rlk_triton._policy_terms import (
    _bounded,
    _clamp_log,
    _geo_log_ratio,
    _load_tokens,
    _mode_terms,
    _seq_keep,
    _token_keep,
)
from rlk_triton._triton import cdiv, jit, tl
from rlk_triton.logprobs import tree_sum

#: Tokens per block of a sequence's sums (lanes of the fixed-order accumulation).
BLOCK_L = 256
#: Log importance ratios are clamped to this bound before ``exp`` (verl's safety bound).
LOG_RATIO_BOUND = 20.0


# REJECT_OPTIONS (rlk's list, imported above): bit ``i`` of the kernels' ``RS`` flags;
# thresholds ``thr[2i], thr[2i+1]``.


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _token_ratio(lp, old, s, SEQ_RATIO: tl.constexpr, MODE: tl.constexpr):
    """The ratio a token's term takes: the sequence's ``s`` (GSPO, geo_mean), else ``exp(lp -
    old)``, its log clamped to [-20, 20] for the objectives whose peers clamp it."""
    if SEQ_RATIO or MODE == 7:
        return s
    if MODE >= 1 and MODE <= 4:
        return tl.exp(_clamp_log(lp - old))
    return tl.exp(lp - old)


@jit
def _policy_seq_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    roll_ptr,
    mask_ptr,
    thr_ptr,
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
    is_min,
    is_max,
    p0,
    p1,
    p2,
    p3,
    MODE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LOG2_BLOCK_L: tl.constexpr,
    SEQS: tl.constexpr,
    DUAL: tl.constexpr,
    ROLL: tl.constexpr,
    SEQ_RATIO: tl.constexpr,
    IS: tl.constexpr,
    IS_MODE: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_MAX: tl.constexpr,
    RS: tl.constexpr,
    PRE: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    seq_ok = seqs < B
    cols = tl.arange(0, BLOCK_L)
    zero = tl.zeros([SEQS, BLOCK_L], tl.float32)
    seq_keep = seqs >= 0  # all True
    ell_mean = tl.zeros([SEQS], tl.float32)
    w_seq = tl.zeros([SEQS], tl.float32) + 1.0
    aux = tl.zeros([SEQS], tl.float32)
    n_mask = tl.zeros([SEQS], tl.int32)
    # First pass: the statistics a sequence needs before its tokens' terms.
    if PRE:
        acc_ell = zero
        acc_adv = zero
        acc_d = zero
        acc_1 = zero
        acc_2 = zero
        acc_3 = zero
        max_2 = tl.zeros([SEQS], tl.float32)
        max_3 = tl.zeros([SEQS], tl.float32)
        n_kept = tl.zeros([SEQS], tl.int32)
        for l0 in range(0, L, BLOCK_L):
            offs = l0 + cols
            ok = seq_ok[:, None] & (offs < L)[None, :]
            m, lp, old, adv, delta = _load_tokens(
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
                ROLL,
            )
            dc = _clamp_log(delta)
            kept = m & _token_keep(dc, thr_ptr, RS)
            k2 = dc * dc * 0.5
            k3 = tl.exp(dc) - 1.0 - dc
            if MODE == 7:  # geo_mean: the log-ratios clamped towards sign(A), and A
                ell, _ = _geo_log_ratio(lp - old, adv, clip_low, clip_high)
                acc_adv += tl.where(kept, adv, 0.0)
            elif MODE == 8:  # vespo: the clamped log-ratios
                ell = _clamp_log(lp - old)
            else:
                ell = lp - old
            acc_ell += tl.where(kept, ell, 0.0)
            acc_d += delta
            acc_1 -= dc
            acc_2 += tl.where(m, k2, 0.0)
            acc_3 += tl.where(m, k3, 0.0)
            max_2 = _max2(max_2, _row_max(tl.where(m, k2, 0.0)))
            max_3 = _max2(max_3, _row_max(tl.where(m, k3, 0.0)))
            n_mask += tl.sum(m.to(tl.int32), axis=1)
            n_kept += tl.sum(kept.to(tl.int32), axis=1)
        if RS >= 8:
            seq_keep = _seq_keep(
                tree_sum(acc_1, LOG2_BLOCK_L),
                tree_sum(acc_2, LOG2_BLOCK_L),
                tree_sum(acc_3, LOG2_BLOCK_L),
                max_2,
                max_3,
                n_mask,
                thr_ptr,
                RS,
            )
        if SEQ_RATIO or MODE == 7:
            ell_mean = _safe_div(tree_sum(acc_ell, LOG2_BLOCK_L), n_kept.to(tl.float32))
        if MODE == 7:
            aux = _safe_div(tree_sum(acc_adv, LOG2_BLOCK_L), n_kept.to(tl.float32))
        if MODE == 8:  # log w of the sequence, clamped to [log(1e-8), 20] (TRL)
            aux = _min2(_max2(tree_sum(acc_ell, LOG2_BLOCK_L), -18.420680743952367), 20.0)
        if IS == 2:
            w_seq = _bounded(
                tl.exp(_clamp_log(tree_sum(acc_d, LOG2_BLOCK_L))),
                is_min,
                is_max,
                IS_MODE,
                HAS_MIN,
                HAS_MAX,
            )
        n_mask = tl.zeros([SEQS], tl.int32)  # counted again below
    s_ratio = tl.exp(ell_mean)
    acc_pg = zero
    acc_kl = zero
    acc_r = zero
    acc_w = zero
    r_max = tl.zeros([SEQS], tl.float32)  # ratios are > 0, and an empty sequence reports 0
    n = tl.zeros([SEQS], tl.int32)
    n_clip = tl.zeros([SEQS], tl.int32)
    n_dual = tl.zeros([SEQS], tl.int32)
    for l0 in range(0, L, BLOCK_L):
        offs = l0 + cols
        ok = seq_ok[:, None] & (offs < L)[None, :]
        m, lp, old, adv, delta = _load_tokens(
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
            ROLL,
        )
        kept = m & seq_keep[:, None]
        if RS % 8 != 0:
            kept = kept & _token_keep(_clamp_log(delta), thr_ptr, RS)
        ratio = _token_ratio(lp, old, zero + s_ratio[:, None], SEQ_RATIO, MODE)
        pg, _, was_clipped, dual = _mode_terms(
            lp,
            old,
            ratio,
            adv,
            zero + aux[:, None],
            clip_low,
            clip_high,
            clip_c,
            p0,
            p1,
            p2,
            p3,
            MODE,
            DUAL,
        )
        if IS == 1:
            w = _bounded(tl.exp(_clamp_log(delta)), is_min, is_max, IS_MODE, HAS_MIN, HAS_MAX)
            pg = pg * w
            acc_w += tl.where(m, w, 0.0)
        elif IS == 2:
            pg = pg * w_seq[:, None]
        acc_pg += tl.where(kept, pg, 0.0)
        acc_kl += tl.where(kept, old - lp, 0.0)
        acc_r += tl.where(kept, ratio, 0.0)
        r_max = _max2(r_max, _row_max(tl.where(kept, ratio, 0.0)))
        n += tl.sum(kept.to(tl.int32), axis=1)
        n_mask += tl.sum(m.to(tl.int32), axis=1)
        n_clip += tl.sum((kept & was_clipped).to(tl.int32), axis=1)
        n_dual += tl.sum((kept & dual).to(tl.int32), axis=1)
    if IS == 1:
        w_stat = tree_sum(acc_w, LOG2_BLOCK_L)
    else:
        w_stat = w_seq
    f = seqf_ptr + seqs * 7
    tl.store(f + 0, tree_sum(acc_pg, LOG2_BLOCK_L), mask=seq_ok)
    tl.store(f + 1, tree_sum(acc_kl, LOG2_BLOCK_L), mask=seq_ok)
    tl.store(f + 2, tree_sum(acc_r, LOG2_BLOCK_L), mask=seq_ok)
    tl.store(f + 3, r_max, mask=seq_ok)
    tl.store(f + 4, w_stat, mask=seq_ok)
    if MODE == 8:
        ell_mean = aux
    if MODE == 7:
        w_seq = aux  # geo_mean takes no IS weights: the slot holds its sequence advantage
    tl.store(f + 5, ell_mean, mask=seq_ok)
    tl.store(f + 6, w_seq, mask=seq_ok)
    i = seqi_ptr + seqs * 5
    tl.store(i + 0, n, mask=seq_ok)
    tl.store(i + 1, n_clip, mask=seq_ok)
    tl.store(i + 2, n_dual, mask=seq_ok)
    tl.store(i + 3, n_mask, mask=seq_ok)
    tl.store(i + 4, seq_keep.to(tl.int32), mask=seq_ok)


@jit
def _policy_bwd_kernel(
    g_ptr,
    lp_ptr,
    old_ptr,
    adv_ptr,
    roll_ptr,
    mask_ptr,
    thr_ptr,
    seqf_ptr,
    seqi_ptr,
    coef_ptr,
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
    is_min,
    is_max,
    p0,
    p1,
    p2,
    p3,
    MODE: tl.constexpr,
    PER_SEQ_MEAN: tl.constexpr,
    SEQS: tl.constexpr,
    BLOCK: tl.constexpr,
    DUAL: tl.constexpr,
    ROLL: tl.constexpr,
    SEQ_RATIO: tl.constexpr,
    IS: tl.constexpr,
    IS_MODE: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_MAX: tl.constexpr,
    RS: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seq_ok = seqs < B
    ok = seq_ok[:, None] & (offs < L)[None, :]
    m, lp, old, adv, delta = _load_tokens(
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
        ROLL,
    )
    f = seqf_ptr + seqs * 7
    i = seqi_ptr + seqs * 5
    kept = m & (tl.load(i + 4, mask=seq_ok, other=0) != 0)[:, None]
    if RS % 8 != 0:
        kept = kept & _token_keep(_clamp_log(delta), thr_ptr, RS)
    zero = tl.zeros([SEQS, BLOCK], tl.float32)
    stat = zero + tl.load(f + 5, mask=seq_ok, other=0.0)[:, None]
    ratio = _token_ratio(lp, old, tl.exp(stat), SEQ_RATIO, MODE)
    aux = stat
    if MODE == 7:
        aux = zero + tl.load(f + 6, mask=seq_ok, other=0.0)[:, None]
    _, dpg, _, _ = _mode_terms(
        lp, old, ratio, adv, aux, clip_low, clip_high, clip_c, p0, p1, p2, p3, MODE, DUAL
    )
    if IS == 1:
        dpg = dpg * _bounded(tl.exp(_clamp_log(delta)), is_min, is_max, IS_MODE, HAS_MIN, HAS_MAX)
    elif IS == 2:
        dpg = dpg * tl.load(f + 6, mask=seq_ok, other=0.0)[:, None]
    w = tl.zeros([SEQS], tl.float32) + tl.load(coef_ptr)
    if PER_SEQ_MEAN:
        w = _safe_div(w, tl.load(i + 0, mask=seq_ok, other=0).to(tl.float32))
    g = tl.load(g_ptr)
    dlp = tl.where(kept, (g * w)[:, None] * dpg, 0.0)
    tl.store(
        dlp_ptr + seqs.to(tl.int64)[:, None] * s_dlp + offs[None, :],
        dlp.to(dlp_ptr.dtype.element_ty),
        mask=ok,
    )


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
}


# --------------------------------------------------------------------------------------------
# Launchers, autograd, public function
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


def _reject_table(reject) -> tuple[int, list[float]]:
    """``(RS bit flags, thresholds [22])``: k1 bounds as logs, the others as given."""
    thr = [0.0] * (2 * len(REJECT_OPTIONS))
    flags = 0
    for option, spec in (reject or {}).items():
        i = REJECT_OPTIONS.index(option)
        est = option.rsplit("_", 1)[1]
        lo, hi = spec if isinstance(spec, tuple | list) else (None, spec)
        if est == "k1":
            lo = 1.0 / hi if lo is None else lo
            lo, hi = math.log(lo), math.log(hi)
        flags |= 1 << i
        thr[2 * i], thr[2 * i + 1] = (lo or 0.0), hi
    return flags, thr


def _host_floats(values: list[float], device) -> torch.Tensor:
    """Python floats as an fp32 tensor on ``device`` without a host synchronisation: a copy
    from pageable memory (or a Python scalar written into a CUDA tensor) makes the host wait
    for the GPU, at every call; a pinned, non-blocking copy does not."""
    t = torch.tensor(values, dtype=torch.float32)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _norms(device, num_tokens, num_seqs, norm_length, is_normalize) -> torch.Tensor:
    """``[num_tokens, num_seqs, norm_length, IS divisor]`` fp32 on the device, no host sync
    (a 0-d tensor argument is copied on the device)."""
    given = (num_tokens, num_seqs, norm_length, is_normalize)
    plain = [
        float(v) if v is not None and not isinstance(v, (bool, torch.Tensor)) else 0.0
        for v in given
    ]
    norms = _host_floats(plain, device)
    for i, v in enumerate(given):
        if isinstance(v, torch.Tensor):  # after the copy above, on the same stream
            norms[i : i + 1].copy_(v.reshape(1))
    return norms


def _forward(lp, old, adv, mask, rollout, norms, thr, plan, table):
    """The forward launches: ``(loss, metrics [len(METRICS)], saved)``, ``saved`` the tensors
    :func:`_backward` reads (the operands, ``thr``, the per-sequence statistics, the gradient's
    scale)."""
    B, L = lp.shape
    _, flags, batch_flags = plan
    lp, old, adv, mask, roll, strides = _policy_inputs(lp, old, adv, mask, rollout)
    pre = flags["SEQ_RATIO"] or flags["IS"] == 2 or flags["RS"] >= 8 or flags["MODE"] >= 7
    seqf = torch.empty(B, NF, dtype=torch.float32, device=lp.device)
    seqi = torch.empty(B, NI, dtype=torch.int32, device=lp.device)
    if B:
        cfg = dict(tuning.config(table, "policy_loss.seq", B=B, L=L))
        seqs = cfg.pop("SEQS")
        _policy_seq_kernel[(cdiv(B, seqs),)](
            lp,
            old,
            adv,
            roll,
            mask,
            thr,
            seqf,
            seqi,
            B,
            L,
            *strides,
            *plan[0],
            BLOCK_L=BLOCK_L,
            LOG2_BLOCK_L=_log2(BLOCK_L),
            SEQS=seqs,
            PRE=pre,
            **flags,
            **cfg,
        )
    loss, metrics, coef = aggregate(seqf, seqi, norms, batch_flags, table, "policy_loss.batch", L)
    return loss, metrics, (lp, old, adv, mask, roll, thr, seqf, seqi, coef)


def _backward(g_loss, lp, old, adv, mask, roll, thr, seqf, seqi, coef, plan, table, lp_dtype):
    """d loss / d logprobs (the backward launch) from what :func:`_forward` saved."""
    B, L = lp.shape
    scalars, flags, batch_flags = plan
    *_, strides = _policy_inputs(lp, old, adv, mask, roll)
    dlp = torch.empty(B, L, dtype=lp_dtype, device=lp.device)
    if B and L:
        cfg = dict(tuning.config(table, "policy_loss.bwd", B=B, L=L))
        seqs, block = cfg.pop("SEQS"), cfg.pop("BLOCK")
        g = g_loss.detach().float().reshape(1).contiguous()
        _policy_bwd_kernel[(cdiv(B, seqs), cdiv(L, block))](
            g,
            lp,
            old,
            adv,
            roll,
            mask,
            thr,
            seqf,
            seqi,
            coef,
            dlp,
            B,
            L,
            *strides,
            dlp.stride(0),
            *scalars,
            PER_SEQ_MEAN=batch_flags["PER_SEQ_MEAN"],
            SEQS=seqs,
            BLOCK=block,
            **flags,
            **cfg,
        )
    return dlp


class PolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, old, adv, mask, rollout, norms, thr, plan, table):
        """``plan``: ``(scalars, flags, batch_flags)`` of the kernels (see :func:`_plan`)."""
        loss, metrics, saved = _forward(lp, old, adv, mask, rollout, norms, thr, plan, table)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.table, ctx.lp_dtype = plan, table, lp.dtype
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, g_loss, _g_metrics):
        dlp = _backward(g_loss, *ctx.saved_tensors, ctx.plan, ctx.table, ctx.lp_dtype)
        return (dlp,) + (None,) * 8


def _plan(rollout_logprobs, clip_low, clip_high, clip_c, agg, ratio_level, is_level, is_mode,
          is_min, is_max, is_normalize, reject, num_tokens, num_seqs, norm_length=None,
          loss_mode="vanilla", mode_params=()):  # fmt: skip
    """The host side of a call (no device work): the kernels' ``(scalars, flags,
    batch_flags)``, the rejection thresholds (:func:`_reject_table`) and the names of the
    metrics returned. ``norm_length`` is :func:`_norms`'."""
    weigh = rollout_logprobs is not None and is_level is not None
    is_code = 0 if not weigh else (1 if is_level == "token" else 2)
    rs, thr = _reject_table(reject if rollout_logprobs is not None else None)
    bound = (0.0 if is_min is None else float(is_min), 0.0 if is_max is None else float(is_max))
    params = [float(v) for v in mode_params] + [0.0] * (4 - len(mode_params))
    scalars = (float(clip_low), float(clip_high), float(clip_c or 0.0), *bound, *params)
    flags = dict(
        DUAL=clip_c is not None,
        ROLL=rollout_logprobs is not None,
        SEQ_RATIO=ratio_level == "sequence",
        IS=is_code,
        IS_MODE=0 if is_mode == "truncate" else 1,
        HAS_MIN=is_min is not None,
        HAS_MAX=is_max is not None,
        RS=rs,
        MODE=LOSS_MODES.index(loss_mode),
    )
    batch_flags = dict(
        agg_flags(agg, num_tokens, num_seqs),
        IS=is_code,
        IS_NORM=0 if not weigh or is_normalize is False else (1 if is_normalize is True else 2),
    )
    names = ["clip_fraction", "approx_kl", "ratio_mean", "ratio_max"]
    if clip_c is not None:
        names.append("dual_clip_fraction")
    if weigh:
        names.append("is_weight_mean")
    if rs:
        names.append("reject_fraction")
    return (scalars, flags, batch_flags), thr, names


def _device_inputs(logprobs, thr, num_tokens, num_seqs, norm_length, is_normalize):
    """The forward's small device inputs: ``(norms, thresholds)`` fp32, no host sync."""
    if norm_length is None:
        norm_length = logprobs.shape[1]
    norms = _norms(logprobs.device, num_tokens, num_seqs, norm_length, is_normalize)
    return norms, _host_floats(thr, logprobs.device)


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
    ratio_level: str = "token",
    rollout_logprobs: torch.Tensor | None = None,
    is_level: str | None = "token",
    is_mode: str = "truncate",
    is_min: float | None = None,
    is_max: float | None = None,
    is_normalize: bool | float | torch.Tensor = False,
    reject: dict | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    loss_mode: str = "vanilla",
    mode_params: tuple[float, ...] = (),
    table: tuning.TuningTable,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/GSPO clipped policy loss and the other objectives of ``rlk.ops.LOSS_MODES``
    (semantics: :func:`rlk.policy_loss`; ``mode_params`` in ``rlk.ops.MODE_PARAMS`` order).

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` (bool or 0/1), ``rollout_logprobs``
    ``[B, L]``; ``advantages`` ``[B]`` or ``[B, L]``. Returns a 0-d fp32 loss, differentiable
    with respect to ``logprobs`` only, and 0-d detached fp32 metrics.

    Example::

        loss, m = policy_loss(lp, old, adv, mask, agg="token-mean", table=table)
    """
    plan, thr, names = _plan(rollout_logprobs, clip_low, clip_high, clip_c, agg, ratio_level,
                             is_level, is_mode, is_min, is_max, is_normalize, reject,
                             num_tokens, num_seqs, loss_mode=loss_mode,
                             mode_params=mode_params)  # fmt: skip
    norms, thr = _device_inputs(logprobs, thr, num_tokens, num_seqs, norm_length, is_normalize)
    loss, buf = PolicyLossFunction.apply(
        logprobs,
        old_logprobs.detach(),
        advantages.detach(),
        mask,
        None if rollout_logprobs is None else rollout_logprobs.detach(),
        norms,
        thr,
        plan,
        table,
    )
    return loss, {name: buf[METRICS.index(name)] for name in names}


def _split_forward(logprobs, old_logprobs, advantages, mask, *, table, **kw):
    """policy_loss's forward for the torch.compile path (rlk._library): the outputs (the loss,
    the metrics it returns, stacked) and the extras its backward reads (the catalog entry's
    ``operator.extras``: the per-sequence statistics, the gradient's scale, the thresholds)."""
    plan, thr, names = _plan(**kw)
    norms, thr = _device_inputs(logprobs, thr, kw["num_tokens"], kw["num_seqs"],
                                kw["norm_length"], kw["is_normalize"])  # fmt: skip
    loss, buf, saved = _forward(
        logprobs, old_logprobs, advantages, mask, kw["rollout_logprobs"], norms, thr, plan, table
    )
    *_, seqf, seqi, coef = saved
    return (loss, torch.stack([buf[METRICS.index(n)] for n in names])), (seqf, seqi, coef, thr)


def _split_backward(grads, outs, extras, needs, logprobs, old_logprobs, advantages, mask, *,
                    table, **kw):  # fmt: skip
    """policy_loss's backward for the torch.compile path: its one launch, on the forward's
    inputs and extras, as PolicyLossFunction's (the metrics have no gradient)."""
    plan, _, _ = _plan(**kw)
    seqf, seqi, coef, thr = extras
    lp, old, adv, mask_, roll, _ = _policy_inputs(
        logprobs, old_logprobs, advantages, mask, kw["rollout_logprobs"]
    )
    g = grads[0]
    if g is None:
        g = torch.zeros((), dtype=torch.float32, device=lp.device)
    dlp = _backward(g, lp, old, adv, mask_, roll, thr, seqf, seqi, coef, plan, table, lp.dtype)
    return (dlp,)


#: Forward and backward as two calls, for the torch.compile path (rlk._library): the
#: backward launches its kernel alone, on what the forward returned, as the Function's does.
AUTOGRAD = {"policy_loss": (_split_forward, _split_backward)}
