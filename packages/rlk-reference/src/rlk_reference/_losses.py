"""RL objectives on padded ``[B, L]`` tensors: policy_loss, kl_penalty, grpo_advantages.

The float64 oracle of ``rlk.policy_loss``, ``rlk.kl_penalty`` and ``rlk.grpo_advantages``: the
arguments arrive validated and normalised by ``rlk.ops`` (rlk's names, bounds resolved), the
semantics are in those docstrings, and autograd gives the backward.
"""

from __future__ import annotations

import math

import torch

from rlk_reference._logprobs import result_dtype

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["policy_loss", "kl_penalty", "grpo_advantages"]

#: Log importance ratios are clamped to this bound before ``exp`` (verl's safety bound).
LOG_RATIO_BOUND = 20.0
#: The variance floor of REINFORCE++'s whitening (verl's ``masked_whiten``).
WHITEN_EPS = 1e-8


def _div(num: torch.Tensor, den: torch.Tensor | float) -> torch.Tensor:
    """``num / den``, and 0 where ``den`` is 0."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), 0.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _div(torch.where(mask, x, 0.0).sum(), mask.sum())


def _count(v, default: torch.Tensor) -> torch.Tensor:
    """A count or scale given as a number or 0-d tensor (float64), else ``default``."""
    if v is None:
        return default.double()
    return torch.as_tensor(v, device=default.device).double()


def _reject_keep(delta: torch.Tensor, mask: torch.Tensor, reject: dict) -> torch.Tensor:
    """verl's rejection sampling: which tokens of ``mask`` every option keeps.

    ``delta = old - rollout``; per token ``k1 = -delta``, ``k2 = delta^2 / 2``,
    ``k3 = exp(delta) - 1 - delta`` (on ``delta`` clamped to +-20). ``*_k1`` options compare
    ``k1`` (or its sum / mean over the sequence) with ``[log lower, log upper]``; the others
    compare the statistic with the upper bound."""
    d = torch.where(mask, delta, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    stats = {"k1": -d, "k2": d.square() / 2, "k3": torch.exp(d) - 1 - d}
    n = mask.sum(-1)
    keep = mask.clone()
    for option, spec in reject.items():
        level, est = option.rsplit("_", 1)
        if isinstance(spec, tuple | list):
            lo, hi = spec
        else:  # one number: the upper bound; for k1 the bounds (1 / u, u)
            lo, hi = (1.0 / spec if est == "k1" else None), spec
        x = torch.where(mask, stats[est], 0.0)
        if level == "token":
            stat = x
        elif level == "seq_sum":
            stat = x.sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = _div(x.sum(-1), n)[:, None]
        else:  # seq_max: the statistics are >= 0 and an empty sequence reports 0
            stat = x.amax(-1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
        ok = stat <= (math.log(hi) if est == "k1" else hi)
        if lo is not None:
            ok = ok & (stat >= math.log(lo))
        keep = keep & ok
    return keep


def _is_weights(delta, mask, is_level, is_mode, is_min, is_max) -> torch.Tensor:
    """Importance weights ``[B, L]`` of the training policy against the rollout engine."""
    log_w = torch.where(mask, delta, 0.0)
    if is_level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand(mask.shape)
    w = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if is_mode == "truncate":
        # torch.clamp refuses two None bounds; no bound means the weights apply unclipped.
        return w if is_min is None and is_max is None else w.clamp(min=is_min, max=is_max)
    inside = torch.ones_like(mask)
    if is_min is not None:
        inside = inside & (w >= is_min)
    if is_max is not None:
        inside = inside & (w <= is_max)
    return torch.where(inside, w, 0.0)


def _aggregate(pg, mask, agg, num_tokens, num_seqs, norm_length) -> torch.Tensor:
    """Reduce masked per-token losses ``pg [B, L]`` (zero where masked out) to a scalar."""
    tokens = mask.sum(-1)  # [B]
    per_seq = pg.sum(-1)
    if agg == "token-sum":
        return per_seq.sum()
    if agg == "token-mean":
        return _div(per_seq.sum(), _count(num_tokens, tokens.sum()))
    if agg.endswith("-token-mean"):
        per_seq = _div(per_seq, tokens)
    if agg.startswith("row-mean"):
        count = _count(num_seqs, torch.tensor(mask.shape[0], device=pg.device))
    else:  # sequences without response tokens do not count in the mean over sequences
        count = _count(num_seqs, (tokens > 0).sum())
    if agg.endswith("-norm"):
        count = count * (pg.shape[1] if norm_length is None else norm_length)
    return _div(per_seq.sum(), count)


def _pick(cond: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """``a`` where ``cond`` else ``b``, in float64 (a Python float in torch.where is fp32)."""
    return torch.where(cond, torch.tensor(a, dtype=torch.float64, device=cond.device), b)


def _mode_terms(mode, params, lp, old, adv, mask, seq_ratio, clip_low, clip_high, clip_c):
    """``(pg, clipped, capped, ratio)`` of the objectives other than ``vanilla`` (semantics:
    ``rlk.policy_loss``), in float64: ``capped`` is None where the mode caps nothing."""
    x = lp - old
    never = torch.zeros_like(mask)
    if mode == "geo_mean":
        c = x.clamp(-clip_low, clip_high)
        k = torch.where(adv > 0, torch.minimum(x, c), torch.where(adv < 0, torch.maximum(x, c), 0))
        n = mask.sum(-1)
        s = torch.exp(_div(torch.where(mask, k, 0.0).sum(-1), n))
        a = _div(torch.where(mask, adv, 0.0).sum(-1), n)
        # Every token carries its sequence's term, differentiated through its own log-ratio.
        pg = -(a * s).detach()[:, None] * (1.0 + k - k.detach())
        return pg, (x < -clip_low) | (x > clip_high), None, s[:, None].expand_as(x)
    if mode == "vespo":
        log_w = torch.where(mask, x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0.0).sum(-1)
        log_w = log_w.clamp(math.log(1e-8), LOG_RATIO_BOUND).detach()[:, None]
        nonneg = adv >= 0
        k = _pick(nonneg, params[0], params[2])
        lam = _pick(nonneg, params[1], params[3]).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = torch.where(torch.isfinite(phi), phi, 0.0)
        return -phi * adv * lp, never, None, torch.exp(x)
    if mode in ("cispo", "dppo_tv", "dppo_kl", "sapo") and seq_ratio is None:
        ratio = torch.exp(x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    else:
        ratio = torch.exp(x) if seq_ratio is None else seq_ratio
    if mode == "cispo":
        w = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        return -w.detach() * adv * lp, w != ratio, None, ratio
    if mode in ("dppo_tv", "dppo_kl"):
        p, po = torch.exp(lp), torch.exp(old)
        if mode == "dppo_tv":
            valid = torch.where(adv > 0, p - po <= clip_high, p - po >= -clip_low)
        else:
            bkl = po * (old - lp) + (1 - po) * torch.log((1 - po + 1e-8) / (1 - p + 1e-8))
            valid = torch.where(
                adv > 0, (bkl <= clip_high) | (p <= po), (bkl <= clip_low) | (p >= po)
            )
        t = ratio if clip_c is None else ratio.clamp(max=clip_c)
        capped = None if clip_c is None else (ratio > clip_c) & valid
        return -adv * t.detach() * lp * valid.double(), ~valid, capped, ratio
    if mode == "sapo":
        tau = _pick(adv > 0, params[0], params[1])
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, never, None, ratio
    if mode == "dro":
        return -(lp * adv - 0.5 * params[0] * x.square()), never, None, ratio
    return -lp * adv, never, None, ratio  # gpg


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
    table=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/GSPO clipped policy loss (semantics: ``rlk.policy_loss``): ``(loss, metrics)``.

    ``logprobs``/``old_logprobs``/``mask``/``rollout_logprobs`` ``[B, L]``, ``advantages``
    ``[B]`` or ``[B, L]``. Only ``logprobs`` gets a gradient; ``norm_length`` defaults to ``L``.

    Example::

        loss, m = policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean")
    """
    out_dtype = result_dtype(logprobs)
    given = mask.bool()
    # Padding may hold anything (even inf); zero it first so that neither the loss nor the
    # gradient can pick up a NaN from a masked-out position.
    lp = torch.where(given, logprobs.double(), 0.0)
    if mask.dtype != torch.bool:
        # A mask value other than 0 or 1 (0.5, NaN) counts as a token whose log-prob is NaN:
        # the loss and that token's gradient are NaN, as in the kernels, where the host does
        # not read the mask (a GPU without RLK_VALIDATE). ``lp + nan``: the gradient flows.
        lp = torch.where((mask == 0) | (mask == 1), lp, lp + math.nan)
    old = torch.where(given, old_logprobs.detach().double(), 0.0)
    adv = advantages.detach().double()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = torch.where(given, adv.expand(given.shape), 0.0)
    metrics = {}

    mask = given
    if rollout_logprobs is not None:
        delta = old - torch.where(given, rollout_logprobs.detach().double(), 0.0)
        if reject:
            mask = _reject_keep(delta, given, reject)
            metrics["reject_fraction"] = _div((given & ~mask).sum().double(), given.sum())

    seq_ratio = None
    if ratio_level == "sequence":
        # GSPO: s = exp(mean log-ratio over the sequence), gradient spread over its tokens.
        seq_log = _div(torch.where(mask, lp - old, 0.0).sum(-1), mask.sum(-1))
        seq_ratio = torch.exp(lp - lp.detach() + seq_log.detach()[:, None])
    if loss_mode == "vanilla":
        ratio = torch.exp(lp - old) if seq_ratio is None else seq_ratio
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        pg = torch.maximum(unclipped, clipped)
        metrics["clip_fraction"] = _masked_mean((clipped > unclipped).double(), mask)
        if clip_c is not None:
            bound = -adv * clip_c
            dual = (adv < 0) & (bound < pg)
            pg = torch.where(dual, bound, pg)
            metrics["dual_clip_fraction"] = _masked_mean(dual.double(), mask)
    else:
        pg, was_clipped, capped, ratio = _mode_terms(
            loss_mode, mode_params, lp, old, adv, mask, seq_ratio, clip_low, clip_high, clip_c
        )
        metrics["clip_fraction"] = _masked_mean(was_clipped.double(), mask)
        if capped is not None:
            metrics["dual_clip_fraction"] = _masked_mean(capped.double(), mask)

    scale = None
    if rollout_logprobs is not None and is_level is not None:
        w = _is_weights(delta, given, is_level, is_mode, is_min, is_max)
        if is_level == "sequence":
            has = given.any(-1)
            w_mean = _div(torch.where(has, w[:, 0] if w.shape[1] else 0.0, 0.0).sum(), has.sum())
        else:
            w_mean = _masked_mean(w, given)
        metrics["is_weight_mean"] = w_mean
        if is_normalize is True:
            scale = torch.where(w_mean > 1e-8, w_mean, 1.0)
        elif is_normalize is not False:
            scale = torch.as_tensor(is_normalize, device=w.device).double()
        pg = pg * w
    pg = torch.where(mask, pg, 0.0)
    loss = _aggregate(pg, mask, agg, num_tokens, num_seqs, norm_length)
    if scale is not None:
        loss = loss / scale

    ratio_d = ratio.detach()
    metrics["approx_kl"] = _masked_mean(old - lp.detach(), mask)
    metrics["ratio_mean"] = _masked_mean(ratio_d, mask)
    metrics["ratio_max"] = (
        torch.where(mask, ratio_d, 0.0).amax() if mask.any() else ratio_d.new_zeros(())
    )
    metrics = {name: value.detach().to(out_dtype) for name, value in sorted(metrics.items())}
    return loss.to(out_dtype), metrics


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k3",
    *,
    clamp: float | None = 10.0,
    old_logprobs: torch.Tensor | None = None,
    table=None,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` (semantics: ``rlk.kl_penalty``) with
    ``d = logprobs - ref_logprobs``: ``k1 = d``, ``abs = |d|``, ``k2 = d^2 / 2``,
    ``k3 = exp(-d) + d - 1`` clamped to ``[-clamp, clamp]``; ``k1+``/``k3+``/``abs+`` take the
    value of ``k1``/``k3``/``abs`` and the gradient of ``k2``. With ``old_logprobs`` the estimate
    is multiplied by ``exp(logprobs - old_logprobs)`` (differentiated too).

    Example::

        kl = kl_penalty(lp, ref_lp, "k3+")
    """
    lp = logprobs.double()  # one cast: a low-precision gradient is rounded once
    d = lp - ref_logprobs.double()
    base = kind.rstrip("+")
    if base == "k1":
        kl = d
    elif base == "abs":
        kl = d.abs()
    elif base == "k2":
        kl = d.square() / 2
    elif base == "k3":
        kl = torch.exp(-d) + d - 1
        if clamp is not None:
            kl = kl.clamp(-clamp, clamp)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if kind.endswith("+"):  # straight through: the value of kl, the gradient of k2
        k2 = d.square() / 2
        kl = k2 - k2.detach() + kl.detach()
    if old_logprobs is not None:
        kl = kl * torch.exp(lp - old_logprobs.detach().double())
    return kl.to(result_dtype(logprobs))


def _groups(n: int, group_size: int | None, group_ids: torch.Tensor | None, device):
    """Group index ``[N]`` (0..G-1) and the number of groups."""
    if group_ids is None:
        return torch.arange(n, device=device) // group_size, n // group_size
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, uniq.numel()


def _whiten(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(v - mu) / sqrt(var + 1e-8)`` with the ``weight``-weighted mean and unbiased variance
    (Bessel over the total weight; variance 0 when the total weight is below 2)."""
    total = weight.sum()
    mu = _div((weight * v).sum(), total)
    var = _div((weight * (v - mu).square()).sum(), total - 1) if total >= 2 else 0.0 * mu
    return (v - mu) / torch.sqrt(var + WHITEN_EPS)


def _row_weights(mask: torch.Tensor) -> torch.Tensor:
    """Each row's token count, NaN for a row holding a value other than 0 or 1."""
    weight = mask.bool().sum(-1).double()
    if mask.dtype != torch.bool:
        weight = torch.where(((mask == 0) | (mask == 1)).all(-1), weight, math.nan)
    return weight


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    norm_std: str = "group",
    eps: float = 1e-6,
    group_ids: torch.Tensor | None = None,
    estimator: str = "grpo",
    mask: torch.Tensor | None = None,
    table=None,
) -> torch.Tensor:
    """Outcome-reward advantages ``[N]`` (semantics: ``rlk.grpo_advantages``).

    Groups: contiguous of ``group_size`` or by ``group_ids``. ``estimator`` ``grpo``
    (``norm_std`` ``"group"``/``"batch"``/``"none"``; also ``True``/``False``), ``rloo``,
    ``reinforce++-baseline``, ``reinforce++`` (these two whiten over the tokens of ``mask``).

    Example::

        adv = grpo_advantages(rewards, 4, norm_std="group", eps=1e-6)
    """
    if isinstance(norm_std, bool):
        norm_std = "group" if norm_std else "none"
    r = rewards.double()
    n = r.numel()
    if estimator == "reinforce++":
        v = r
    else:
        gid, n_groups = _groups(n, group_size, group_ids, r.device)
        size = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(
            0, gid, torch.ones_like(r)
        )
        mean = torch.zeros_like(size).index_add_(0, gid, r) / size
        single = size[gid] == 1
        centred = r - torch.where(single, 0.0, mean[gid])  # a group of one has mean 0
        if estimator == "opo":
            w = _row_weights(mask)
            wsum = torch.zeros_like(size).index_add_(0, gid, w)
            base = _div(torch.zeros_like(size).index_add_(0, gid, w * r), wsum)[gid]
            v = r - torch.where(single, 0.0, base)
        elif estimator == "grpo_passk":
            v = torch.zeros_like(r)
            for g in range(n_groups):  # the best member (first of ties) by its margin
                idx = (gid == g).nonzero().flatten()
                if idx.numel() < 2:
                    continue
                top = r[idx].max()
                best = idx[(r[idx] == top).nonzero()[0, 0]]
                second = r[idx[idx != best]].max()
                std = r[idx].std(correction=1)
                v[best] = (top - second) / (std + eps if norm_std == "group" else 1.0)
        elif estimator == "grpo":
            v = centred
            if norm_std == "group":
                ss = torch.zeros_like(size).index_add_(0, gid, centred.square())
                std = torch.sqrt(ss / (size - 1).clamp(min=1))[gid]
                v = centred / (torch.where(single, 1.0, std) + eps)
            elif norm_std == "batch":
                std = r.std(correction=1) if n >= 2 else r.new_zeros(())
                v = centred / (std + eps)
        elif estimator in ("rloo", "rloo_vectorized"):
            alone = r if estimator == "rloo" else torch.zeros_like(r)
            v = torch.where(single, alone, centred * size[gid] / (size[gid] - 1).clamp(min=1))
        else:  # reinforce++-baseline
            v = centred
    if estimator.startswith("reinforce++"):
        v = _whiten(v, _row_weights(mask))
    return v.to(result_dtype(rewards))
