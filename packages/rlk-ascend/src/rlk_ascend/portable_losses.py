"""The RL objectives of the portable backend: ``policy_loss``, ``kl_penalty``,
``grpo_advantages``, in PyTorch with the fixed-order sums of :mod:`rlk_ascend.portable`
(floating-point sums go through :func:`~rlk_ascend.portable.fixed_sum`: no library reduction
decides an order). Semantics: the docstrings of ``rlk.policy_loss``, ``rlk.kl_penalty`` and
``rlk.grpo_advantages``."""

from __future__ import annotations

import math

import torch

from rlk_ascend.portable import ROW_CHUNK, _overflow_scale, fixed_sum

#: Log importance ratios are clamped to this bound before ``exp`` (verl's safety bound).
LOG_RATIO_BOUND = 20.0


def _total(x: torch.Tensor) -> torch.Tensor:
    return fixed_sum(x.reshape(-1), ROW_CHUNK)


def _div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` in fp32, and 0 where ``den`` is 0."""
    den = den.float()
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), 0.0)


def _masked_mean(x, mask) -> torch.Tensor:
    return _div(_total(torch.where(mask, x, 0.0)), mask.sum())


def _value(v, default: torch.Tensor) -> torch.Tensor:
    return default.float() if v is None else torch.as_tensor(v, device=default.device).float()


def _reject_keep(delta, mask, reject) -> torch.Tensor:
    """verl's rejection options (see ``rlk.policy_loss``): the tokens of ``mask`` kept."""
    d = torch.where(mask, delta, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    stats = {"k1": -d, "k2": d * d * 0.5, "k3": torch.exp(d) - 1.0 - d}
    n = mask.sum(-1)
    keep = mask.clone()
    for option, spec in reject.items():
        level, est = option.rsplit("_", 1)
        lo, hi = spec if isinstance(spec, tuple | list) else (None, spec)
        if est == "k1":
            lo = 1.0 / hi if lo is None else lo
            lo, hi = math.log(lo), math.log(hi)
        x = torch.where(mask, stats[est], 0.0)
        if level == "token":
            stat = x
        elif level == "seq_sum":
            stat = fixed_sum(x, ROW_CHUNK)[:, None]
        elif level == "seq_mean":
            stat = _div(fixed_sum(x, ROW_CHUNK), n)[:, None]
        else:  # the statistics are >= 0 and an empty sequence reports 0
            stat = x.amax(-1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
        ok = stat <= hi
        if lo is not None:
            ok = ok & (stat >= lo)
        keep = keep & ok
    return keep


def aggregate(terms, mask, agg, num_tokens=None, num_seqs=None, norm_length=None):
    """The ``agg`` aggregation of the per-token ``terms [B, L]`` over ``mask`` (see
    ``rlk.policy_loss``): each sequence's tokens by :func:`fixed_sum`, then the sequences."""
    tokens = mask.sum(-1)
    per_seq = fixed_sum(torch.where(mask, terms, 0.0), ROW_CHUNK)
    if agg == "token-sum":
        return fixed_sum(per_seq, ROW_CHUNK)
    if agg == "token-mean":
        return _div(fixed_sum(per_seq, ROW_CHUNK), _value(num_tokens, tokens.sum()))
    if agg.endswith("-token-mean"):
        per_seq = _div(per_seq, tokens)
    rows = torch.tensor(mask.shape[0], device=terms.device)
    count = _value(num_seqs, rows if agg.startswith("row") else (tokens > 0).sum())
    if agg.endswith("-norm"):
        count = count * (terms.shape[1] if norm_length is None else norm_length)
    return _div(fixed_sum(per_seq, ROW_CHUNK), count)


def _where(cond, a: float, b: float) -> torch.Tensor:
    return torch.where(cond, torch.tensor(a, dtype=torch.float32, device=cond.device), b)


def _mode_terms(mode, params, lp, old, adv, mask, seq_ratio, clip_low, clip_high, clip_c):
    """``(pg, clipped, capped, ratio)`` of the objectives other than ``vanilla`` (see
    ``rlk.policy_loss``) in fp32; ``capped`` is None where the mode caps nothing."""
    x = lp - old
    never = torch.zeros_like(mask)
    bound = LOG_RATIO_BOUND
    if mode == "geo_mean":
        c = x.clamp(-clip_low, clip_high)
        k = torch.where(adv > 0, torch.minimum(x, c), torch.where(adv < 0, torch.maximum(x, c), 0))
        n = mask.sum(-1)
        s = torch.exp(_div(fixed_sum(torch.where(mask, k, 0.0), ROW_CHUNK), n))
        a = _div(fixed_sum(torch.where(mask, adv, 0.0), ROW_CHUNK), n)
        pg = -(a * s).detach()[:, None] * (1.0 + k - k.detach())
        return pg, (x < -clip_low) | (x > clip_high), None, s[:, None].expand_as(x)
    if mode == "vespo":
        log_w = fixed_sum(torch.where(mask, x.clamp(-bound, bound), 0.0), ROW_CHUNK)
        log_w = log_w.clamp(math.log(1e-8), bound).detach()[:, None]
        nonneg = adv >= 0
        k, lam = _where(nonneg, params[0], params[2]), _where(nonneg, params[1], params[3])
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = torch.where(torch.isfinite(phi), phi, 0.0)
        return -phi * adv * lp, never, None, torch.exp(x)
    if seq_ratio is not None:
        ratio = seq_ratio
    elif mode in ("cispo", "dppo_tv", "dppo_kl", "sapo"):
        ratio = torch.exp(x.clamp(-bound, bound))
    else:
        ratio = torch.exp(x)
    if mode == "cispo":
        w = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        return -w.detach() * adv * lp, w != ratio, None, ratio
    if mode in ("dppo_tv", "dppo_kl"):
        p, po = torch.exp(lp), torch.exp(old)
        if mode == "dppo_tv":
            valid = torch.where(adv > 0, p - po <= clip_high, p - po >= -clip_low)
        else:
            bkl = po * (old - lp) + (1 - po) * torch.log((1 - po + 1e-8) / (1 - p + 1e-8))
            pos, neg = (bkl <= clip_high) | (p <= po), (bkl <= clip_low) | (p >= po)
            valid = torch.where(adv > 0, pos, neg)
        t = ratio if clip_c is None else ratio.clamp(max=clip_c)
        capped = None if clip_c is None else (ratio > clip_c) & valid
        return -adv * t.detach() * lp * valid.float(), ~valid, capped, ratio
    if mode == "sapo":
        tau = _where(adv > 0, params[0], params[1])
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, never, None, ratio
    if mode == "dro":
        return -(lp * adv - 0.5 * params[0] * x.square()), never, None, ratio
    return -lp * adv, never, None, ratio  # gpg


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    clip_c=None,
    agg="token-mean",
    ratio_level="token",
    rollout_logprobs=None,
    is_level="token",
    is_mode="truncate",
    is_min=None,
    is_max=None,
    is_normalize=False,
    reject=None,
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    loss_mode="vanilla",
    mode_params=(),
    table=None,
):
    """PPO/GRPO/GSPO clipped policy loss and the other objectives of ``loss_mode`` on ``[B, L]``
    (see ``rlk.policy_loss``): ``(loss, metrics)``. Every sum is a :func:`fixed_sum`; the
    backward is autograd through them (a sum's gradient is a broadcast)."""
    given = mask.bool()
    lp = torch.where(given, logprobs.float(), 0.0)
    if mask.dtype != torch.bool:
        # A mask value other than 0 or 1 (0.5, NaN; reachable where the host does not check
        # it) counts as a token whose log-prob is NaN: the loss and that token's gradient are
        # NaN (as in the reference). ``lp + nan``: the gradient flows.
        lp = torch.where((mask == 0) | (mask == 1), lp, lp + math.nan)
    old = torch.where(given, old_logprobs.detach().float(), 0.0)
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = torch.where(given, adv.expand(given.shape), 0.0)
    metrics = {}
    mask = given
    if rollout_logprobs is not None:
        delta = old - torch.where(given, rollout_logprobs.detach().float(), 0.0)
        if reject:
            mask = _reject_keep(delta, given, reject)
            metrics["reject_fraction"] = _div((given & ~mask).sum().float(), given.sum())
    tokens = mask.sum(-1)
    seq_ratio = None
    if ratio_level == "sequence":
        seq_log = _div(fixed_sum(torch.where(mask, lp - old, 0.0), ROW_CHUNK), tokens)
        seq_ratio = torch.exp(lp - lp.detach() + seq_log.detach()[:, None])
    if loss_mode == "vanilla":
        ratio = torch.exp(lp - old) if seq_ratio is None else seq_ratio
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        pg = torch.maximum(unclipped, clipped)
        metrics["clip_fraction"] = _masked_mean((clipped > unclipped).float(), mask)
        if clip_c is not None:
            bound = -adv * clip_c
            dual = (adv < 0) & (bound < pg)
            pg = torch.where(dual, bound, pg)
            metrics["dual_clip_fraction"] = _masked_mean(dual.float(), mask)
    else:
        pg, was_clipped, capped, ratio = _mode_terms(
            loss_mode, mode_params, lp, old, adv, mask, seq_ratio, clip_low, clip_high, clip_c
        )
        metrics["clip_fraction"] = _masked_mean(was_clipped.float(), mask)
        if capped is not None:
            metrics["dual_clip_fraction"] = _masked_mean(capped.float(), mask)
    scale = None
    if rollout_logprobs is not None and is_level is not None:
        log_w = delta
        if is_level == "sequence":
            log_w = fixed_sum(delta, ROW_CHUNK)[:, None].expand(given.shape)
        w = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if is_mode == "truncate":
            if is_min is not None or is_max is not None:
                w = w.clamp(min=is_min, max=is_max)
        else:
            inside = ~w.isnan()  # a NaN weight is outside the range
            if is_min is not None:
                inside = inside & (w >= is_min)
            if is_max is not None:
                inside = inside & (w <= is_max)
            w = torch.where(inside, w, 0.0)
        if is_level == "sequence":
            has = given.any(-1)
            seq_w = w[:, 0] if w.shape[1] else w.new_zeros(w.shape[0])
            w_mean = _div(fixed_sum(torch.where(has, seq_w, 0.0), ROW_CHUNK), has.sum())
        else:
            w_mean = _masked_mean(w, given)
        metrics["is_weight_mean"] = w_mean
        if is_normalize is True:
            scale = torch.where(w_mean > 1e-8, w_mean, 1.0)
        elif is_normalize is not False:
            scale = _value(is_normalize, w_mean)
        pg = pg * w
    loss = aggregate(pg, mask, agg, num_tokens, num_seqs, norm_length)
    if scale is not None:
        loss = loss / scale
    ratio_d = ratio.detach()
    metrics["approx_kl"] = _masked_mean(old - lp.detach(), mask)
    metrics["ratio_mean"] = _masked_mean(ratio_d, mask)
    metrics["ratio_max"] = (
        torch.where(mask, ratio_d, 0.0).amax() if bool(mask.any()) else ratio_d.new_zeros(())
    )
    return loss, {name: value.detach() for name, value in sorted(metrics.items())}


def kl_penalty(
    logprobs, ref_logprobs, kind="k3", *, clamp=10.0, old_logprobs=None, table=None
) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` (see ``rlk.kl_penalty``), fp32: k1, abs, k2, k3
    (clamped to ``[-clamp, clamp]``), the straight-through ``+`` kinds, and with
    ``old_logprobs`` times ``exp(logprobs - old_logprobs)``."""
    lp = logprobs.float()
    d = lp - ref_logprobs.float()
    base = kind.rstrip("+")
    if base == "k1":
        kl = d
    elif base == "abs":
        kl = d.abs()
    elif base == "k2":
        kl = d * d / 2
    elif base == "k3":
        kl = torch.exp(-d) + d - 1
        if clamp is not None:
            kl = kl.clamp(-clamp, clamp)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if kind.endswith("+"):
        k2 = d * d / 2
        kl = k2 - k2.detach() + kl.detach()
    if old_logprobs is not None:
        kl = kl * torch.exp(lp - old_logprobs.detach().float())
    return kl


def _row_weights(mask: torch.Tensor) -> torch.Tensor:
    """Each row's token count, NaN for a row holding a value other than 0 or 1."""
    weight = mask.bool().sum(-1).float()
    if mask.dtype != torch.bool:
        weight = torch.where(((mask == 0) | (mask == 1)).all(-1), weight, math.nan)
    return weight


def _passk(r, group_size, group_ids, single, ss, size, norm_std, eps) -> torch.Tensor:
    """Pass@k: each group's best member (the first of ties, in batch order) gets its margin
    over the second best (over the group's std + eps with ``norm_std="group"``), the others 0.
    Maxima and minima are exact, so no order matters."""
    n = r.numel()
    if group_ids is None:
        inv = torch.arange(n, device=r.device) // group_size
    else:
        _, inv = torch.unique(group_ids, return_inverse=True)
    groups = int(inv.max()) + 1 if n else 0

    def per_group(x, how):
        init = x.new_full((groups,), math.inf if how == "amin" else -math.inf)
        return init.scatter_reduce(0, inv, x, reduce=how)[inv]

    top = per_group(r, "amax")
    pos = torch.arange(n, device=r.device, dtype=torch.float32)
    best = pos == per_group(torch.where(r == top, pos, math.inf), "amin")
    second = per_group(torch.where(best, -math.inf, r), "amax")
    gap = torch.where(single, 0.0, top - second)
    if norm_std == "group":
        gap = gap / (torch.where(single, 1.0, torch.sqrt(_div(ss, size - 1))) + eps)
    return torch.where(best, gap, 0.0)


def _group_stats(r: torch.Tensor, group_size, group_ids):
    """Per reward: its group's size, mean and sum of squared deviations, each group summed
    over its members in their batch order by :func:`fixed_sum` (a row of a zero-padded
    ``[groups, largest group]`` table), so a group's values do not depend on the batch."""
    n = r.numel()
    if group_ids is None:
        table, inv = r.reshape(-1, group_size), torch.arange(n, device=r.device) // group_size
        slot = torch.arange(n, device=r.device) % group_size
    else:
        _, inv = torch.unique(group_ids, return_inverse=True)
        order = torch.sort(inv, stable=True).indices
        counts = torch.bincount(inv)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(inv)
        slot[order] = torch.arange(n, device=r.device) - starts[inv[order]]
        table = r.new_zeros(counts.numel(), int(counts.max()))
        table[inv, slot] = r
    size = torch.bincount(inv, minlength=table.shape[0]).float()
    mean = torch.where(size == 1, 0.0, _div(fixed_sum(table, ROW_CHUNK), size))
    dev = torch.zeros_like(table)
    dev[inv, slot] = r - mean[inv]
    ss = fixed_sum(dev * dev, ROW_CHUNK)
    amax = table.abs().amax(-1) if table.shape[1] else size
    return size[inv], mean[inv], ss[inv], amax[inv]


def _weighted_stats(v, weight):
    """The ``weight``-weighted mean and unbiased variance (Bessel over the total weight; 0
    below a total of 2) of ``v``, by fixed-order sums over the batch."""
    total = fixed_sum(weight, ROW_CHUNK)
    mu = _div(fixed_sum(weight * v, ROW_CHUNK), total)
    d = v - mu
    var = torch.where(total >= 2, _div(fixed_sum(weight * (d * d), ROW_CHUNK), total - 1), 0.0)
    return mu, var


def grpo_advantages(
    rewards,
    group_size=None,
    *,
    norm_std="group",
    eps=1e-6,
    group_ids=None,
    estimator="grpo",
    mask=None,
    table=None,
) -> torch.Tensor:
    """Outcome-reward advantages ``[N]`` (see ``rlk.grpo_advantages``), fp32, fixed-order sums."""
    if isinstance(norm_std, bool):
        norm_std = "group" if norm_std else "none"
    r = rewards.float()
    if estimator == "reinforce++":
        v = r
    else:
        size, mean, ss, amax = _group_stats(r, group_size, group_ids)
        # Groups whose sums overflow fp32 are computed on rewards scaled by a power of two
        # (exact); every other group has scale 1 and the same bits as without it.
        scale = _overflow_scale(torch.where(mean.isinf(), mean, ss), amax)
        size, mean, ss, _ = _group_stats(r * scale, group_size, group_ids)
        single = size == 1
        v = r * scale - mean
        if estimator == "opo":
            w = _row_weights(mask)
            _, mean_wr, _, _ = _group_stats(w * r, group_size, group_ids)
            _, mean_w, _, _ = _group_stats(w, group_size, group_ids)
            v = r - torch.where(single, 0.0, _div(mean_wr, mean_w))
        elif estimator == "grpo_passk":
            ss = ss / (scale * scale)  # the rewards' scale (a power of two: exact)
            v = _passk(r, group_size, group_ids, single, ss, size, norm_std, eps)
        elif estimator == "grpo" and norm_std == "group":
            std = torch.sqrt(_div(ss, size - 1))
            v = v / (torch.where(single, 1.0, std) + eps * scale)
        else:
            v = v / scale  # back to the rewards' scale (exact)
            if estimator == "grpo" and norm_std == "batch":
                mu, var = _weighted_stats(r, torch.ones_like(r))
                v = v / (torch.sqrt(var) + eps)
            elif estimator in ("rloo", "rloo_vectorized"):
                alone = r if estimator == "rloo" else torch.zeros_like(r)
                v = torch.where(single, alone, v * size / (size - 1).clamp(min=1))
    if estimator.startswith("reinforce++"):
        mu, var = _weighted_stats(v, _row_weights(mask))
        v = (v - mu) / torch.sqrt(var + 1e-8)
    return v
