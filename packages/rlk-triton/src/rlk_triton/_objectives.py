"""What the RL objectives' kernels share (:mod:`rlk_triton.policy_loss`, :mod:`rlk_triton.kl`,
:mod:`rlk_triton.advantages`, :mod:`rlk_triton.ppo`): the batch-sum block, NaN-propagating fp32
helpers, and the batch kernel that aggregates per-sequence sums into a loss (``agg`` modes,
metrics, the gradient's scale) with its launcher :func:`aggregate`.

Every floating-point sum of those kernels has one order, fixed by module constants: a
sequence's tokens are accumulated lane-wise in blocks of ``policy_loss.BLOCK_L`` (lane ``i``
adds tokens ``i, i + BLOCK_L, ...`` in ascending order), then the lanes are added by the fixed
binary tree of :func:`rlk_triton.logprobs.tree_sum`; the sequences are combined the same way
in blocks of :data:`BLOCK_B` by a single program, and so are a GRPO group's members (in their
order in the batch) in blocks of ``advantages.BLOCK_G``. Counts are integer sums (exact). So
the results do not depend on tuning, and no step syncs with the host.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import jit, tl
from rlk_triton.logprobs import tree_sum

#: Sequences per block of the batch sums.
BLOCK_B = 256

AGG_CODES = {
    "token-mean": 0,
    "token-sum": 1,
    "seq-mean-token-sum": 2,
    "seq-mean-token-mean": 3,
    "seq-mean-token-sum-norm": 4,
    "row-mean-token-mean": 5,
    "row-mean-token-sum-norm": 6,
}
# REJECT_OPTIONS (rlk's list, imported above): bit ``i`` of the kernels' ``RS`` flags;
# thresholds ``thr[2i], thr[2i+1]``.
#: Names of the policy-loss metrics, in the order of the metrics buffer.
METRICS = (
    "clip_fraction",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "dual_clip_fraction",
    "is_weight_mean",
    "reject_fraction",
)


# Per-sequence stats the batch kernel reads, ``[B, NF]`` fp32 and ``[B, NI]`` int32: floats
# (pg sum, (old - new) sum, ratio sum, ratio max, IS weight sum or sequence weight, mean
# log-ratio, sequence weight), ints (kept tokens, clipped, dual-clipped, tokens of mask,
# sequence kept). An objective without some of them leaves zeros there.
NF = 7
NI = 5


def _log2(n: int) -> int:
    return n.bit_length() - 1


# NaN and infinities follow IEEE semantics as in the float64 reference (torch's max, min and
# clamp propagate NaN): every max/min/clamp on values here propagates NaN, where Triton's
# defaults (tl.maximum, tl.minimum, tl.max) would return the other operand and hide a NaN
# log-prob behind a finite loss. On numbers they give the same results as the defaults.


@jit
def _max2(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _min2(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _row_max(x):
    """Max along axis 1, NaN if any element is NaN (tl.max would skip it)."""
    return tl.reduce(x, 1, _max2)


@jit
def _safe_div(num, den):
    return tl.where(den > 0, tl.math.div_rn(num, tl.maximum(den, 1e-30)), 0.0)


@jit
def _batch_kernel(
    seqf_ptr,
    seqi_ptr,
    norms_ptr,
    loss_ptr,
    met_ptr,
    coef_ptr,
    B,
    AGG: tl.constexpr,
    PER_SEQ_MEAN: tl.constexpr,
    NORM_LEN: tl.constexpr,
    TOK_GIVEN: tl.constexpr,
    SEQ_GIVEN: tl.constexpr,
    IS: tl.constexpr,
    IS_NORM: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LOG2_BLOCK_B: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK_B)
    acc_pg = tl.zeros([1, BLOCK_B], tl.float32)
    acc_pg_mean = tl.zeros([1, BLOCK_B], tl.float32)
    acc_kl = tl.zeros([1, BLOCK_B], tl.float32)
    acc_r = tl.zeros([1, BLOCK_B], tl.float32)
    acc_w = tl.zeros([1, BLOCK_B], tl.float32)
    r_max = tl.zeros([1], tl.float32)
    n_tok = tl.zeros([1], tl.int32)
    n_seq = tl.zeros([1], tl.int32)
    n_clip = tl.zeros([1], tl.int32)
    n_dual = tl.zeros([1], tl.int32)
    n_mask = tl.zeros([1], tl.int32)
    n_mask_seq = tl.zeros([1], tl.int32)
    for b0 in range(0, B, BLOCK_B):
        b = b0 + lanes
        ok = b < B
        f = seqf_ptr + b * 7
        i = seqi_ptr + b * 5
        pg = tl.load(f + 0, mask=ok, other=0.0)[None, :]
        n = tl.load(i + 0, mask=ok, other=0)[None, :]
        nm = tl.load(i + 3, mask=ok, other=0)[None, :]
        acc_pg += pg
        acc_pg_mean += _safe_div(pg, n.to(tl.float32))
        acc_kl += tl.load(f + 1, mask=ok, other=0.0)[None, :]
        acc_r += tl.load(f + 2, mask=ok, other=0.0)[None, :]
        r_max = _max2(r_max, _row_max(tl.load(f + 3, mask=ok, other=0.0)[None, :]))
        w = tl.load(f + 4, mask=ok, other=0.0)[None, :]
        if IS == 2:  # the mean over sequences with tokens of the sequence weights
            w = tl.where(nm > 0, w, 0.0)
        acc_w += w
        n_tok += tl.sum(n, axis=1)
        n_seq += tl.sum((n > 0).to(tl.int32), axis=1)
        n_mask += tl.sum(nm, axis=1)
        n_mask_seq += tl.sum((nm > 0).to(tl.int32), axis=1)
        n_clip += tl.sum(tl.load(i + 1, mask=ok, other=0)[None, :], axis=1)
        n_dual += tl.sum(tl.load(i + 2, mask=ok, other=0)[None, :], axis=1)
    one = tl.arange(0, 1)
    pg_sum = tree_sum(acc_pg, LOG2_BLOCK_B)
    tok = n_tok.to(tl.float32)
    if TOK_GIVEN:
        tok = tl.load(norms_ptr + one)
    if AGG >= 5:
        seq = tl.zeros([1], tl.float32) + B
    else:
        seq = n_seq.to(tl.float32)
    if SEQ_GIVEN:
        seq = tl.load(norms_ptr + 1 + one)
    if PER_SEQ_MEAN:
        num = tree_sum(acc_pg_mean, LOG2_BLOCK_B)
    else:
        num = pg_sum
    if AGG == 0:
        den = tok
    elif AGG == 1:
        den = tl.zeros([1], tl.float32) + 1.0
    else:
        den = seq
        if NORM_LEN:
            den = den * tl.load(norms_ptr + 2 + one)
    w_mean = tl.zeros([1], tl.float32)
    if IS == 1:
        w_mean = _safe_div(tree_sum(acc_w, LOG2_BLOCK_B), n_mask.to(tl.float32))
    elif IS == 2:
        w_mean = _safe_div(tree_sum(acc_w, LOG2_BLOCK_B), n_mask_seq.to(tl.float32))
    if IS_NORM == 1:
        z = tl.where(w_mean > 1e-8, w_mean, 1.0)
    elif IS_NORM == 2:
        z = tl.load(norms_ptr + 3 + one)
    else:
        z = tl.zeros([1], tl.float32) + 1.0
    loss = tl.math.div_rn(_safe_div(num, den), z)
    tl.store(loss_ptr + one, loss)
    tl.store(coef_ptr + one, tl.math.div_rn(_safe_div(tl.zeros([1], tl.float32) + 1.0, den), z))
    n_tokf = n_tok.to(tl.float32)
    tl.store(met_ptr + one, _safe_div(n_clip.to(tl.float32), n_tokf))
    tl.store(met_ptr + 1 + one, _safe_div(tree_sum(acc_kl, LOG2_BLOCK_B), n_tokf))
    tl.store(met_ptr + 2 + one, _safe_div(tree_sum(acc_r, LOG2_BLOCK_B), n_tokf))
    tl.store(met_ptr + 3 + one, r_max)
    tl.store(met_ptr + 4 + one, _safe_div(n_dual.to(tl.float32), n_tokf))
    tl.store(met_ptr + 5 + one, w_mean)
    tl.store(met_ptr + 6 + one, _safe_div((n_mask - n_tok).to(tl.float32), n_mask.to(tl.float32)))


def agg_flags(agg: str, num_tokens, num_seqs) -> dict:
    """The batch kernel's aggregation flags for ``agg`` and the given normalisers."""
    return dict(
        AGG=AGG_CODES[agg],
        PER_SEQ_MEAN=agg.endswith("-token-mean"),
        NORM_LEN=agg.endswith("-norm"),
        TOK_GIVEN=num_tokens is not None,
        SEQ_GIVEN=num_seqs is not None,
    )


def aggregate(seqf, seqi, norms, batch_flags: dict, table, rule: str, L: int):
    """Launch the batch kernel on ``seqf [B, NF]``, ``seqi [B, NI]``: returns the 0-d fp32
    loss, the ``[len(METRICS)]`` fp32 metrics and the ``[1]`` fp32 gradient scale, on the
    device, with no host synchronisation. ``rule``: the tuning rule of the launch."""
    B = seqf.shape[0]
    device = seqf.device
    loss = torch.empty((), dtype=torch.float32, device=device)
    metrics = torch.empty(len(METRICS), dtype=torch.float32, device=device)
    coef = torch.empty(1, dtype=torch.float32, device=device)
    cfg = tuning.config(table, rule, B=B, L=L)
    flags = {"IS": 0, "IS_NORM": 0, **batch_flags}
    _batch_kernel[(1,)](
        seqf,
        seqi,
        norms,
        loss,
        metrics,
        coef,
        B,
        **flags,
        BLOCK_B=BLOCK_B,
        LOG2_BLOCK_B=_log2(BLOCK_B),
        **cfg,
    )
    return loss, metrics, coef
