"""verl 0.9.1's and TRL 1.16's RL objectives, each formula written out in plain float64 PyTorch
from the peers' documented semantics (no peer code is imported or copied), for
``test_objectives_parity.py``: ``verl_*`` and ``trl_*`` take float64 tensors of shape [B, L]
(log-probabilities, a bool mask) or [B] (advantages, scores) and return what the peer computes.
"""

from __future__ import annotations

import math

import torch

SAFETY = 20.0  # verl's bound on log importance ratios


# --------------------------------------------------------------------------------------------
# verl 0.9.1: verl/trainer/ppo/core_algos.py, rollout_corr_helper.py, utils/torch_functional.py
# --------------------------------------------------------------------------------------------


def verl_masked_mean(x, mask, axis=None):
    # verl 0.9.1 masked_mean: sum / (count + 1e-8)
    return (x * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def verl_agg_loss(mat, mask, mode, batch_num_tokens=None, global_batch_size=None, scale=None):
    # verl 0.9.1 agg_loss with dp_size = 1.
    mask = mask.double()
    if mode == "token-mean":
        den = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (mat * mask).sum() / den
    seq_tokens = mask.sum(-1)
    nonempty = (seq_tokens > 0).double()
    n_seq = nonempty.sum() if global_batch_size is None else global_batch_size
    seq = (mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return (seq * nonempty).sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (seq / (seq_tokens + 1e-8) * nonempty).sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        # 0.9.1: sum / loss_scale_factor (default L), also divided by the non-empty sequences.
        scale = mask.shape[-1] if scale is None else scale
        return seq.sum() / scale / n_seq
    raise ValueError(mode)


def verl_vanilla(lp, old, adv, mask, clip_low, clip_high, clip_c, mode, is_weights=None, **agg):
    # verl 0.9.1 compute_policy_loss_vanilla (advantages [B] broadcast over tokens).
    a = adv[:, None].expand_as(lp)
    neg_kl = (lp - old).clamp(-SAFETY, SAFETY)
    ratio = torch.exp(neg_kl)
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -a * clip_c
    pg = torch.where(a < 0, torch.minimum(pg3, clip1), clip1)
    if is_weights is not None:
        pg = pg * is_weights
    m = mask.double()
    metrics = {
        "clip_fraction": verl_masked_mean((pg2 > pg1).double(), m),
        "approx_kl": verl_masked_mean(-neg_kl, m),
        "dual_clip_fraction": verl_masked_mean(((clip1 > pg3) & (a < 0)).double(), m),
    }
    return verl_agg_loss(pg, mask, mode, **agg), metrics


def verl_gspo(lp, old, adv, mask, clip_low, clip_high, mode):
    # verl 0.9.1 compute_policy_loss_gspo: log s clamped at 10, agg_loss with loss_agg_mode.
    a = adv[:, None].expand_as(lp)
    m = mask.double()
    seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = (lp - lp.detach() + seq.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    pg = torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high))
    return verl_agg_loss(pg, mask, mode)


def verl_is_weights(log_ratio, mask, level, threshold, batch_normalize, lower=None):
    # verl 0.9.1 compute_rollout_correction_weights (single process); a lower bound
    # (rollout_is_threshold="lower_upper") zeroes the weights outside [lower, upper] (IcePop).
    m = mask.double()
    if level == "token":
        w = torch.exp(log_ratio.clamp(-SAFETY, SAFETY))
    else:
        w = torch.exp((log_ratio * m).sum(-1, keepdim=True).clamp(-SAFETY, SAFETY)).expand_as(m)
    w = w * m
    if lower is None:
        w = w.clamp(max=threshold)
    else:
        w = torch.where((w >= lower) & (w <= threshold), w, 0.0)
    if batch_normalize:
        if level == "token":
            mean = verl_masked_mean(w, m)
        else:
            seq_w = verl_masked_mean(w, m, axis=-1)
            nonempty = (m.sum(-1) > 0).double()
            mean = (seq_w * nonempty).sum() / nonempty.sum().clamp(min=1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_rs_mask(log_ratio, mask, options):
    # verl 0.9.1 compute_rollout_rejection_mask; k1 thresholds as "lower_upper" ratio bounds.
    m = mask.double()
    d = log_ratio.clamp(-SAFETY, SAFETY)
    est = {"k1": -d, "k2": 0.5 * d**2, "k3": torch.exp(d) - 1 - d}
    keep = torch.ones_like(m)
    for option, thr in options.items():
        level, k = option.rsplit("_", 1)
        x = est[k]
        if level == "token":
            stat = x
        elif level == "seq_sum":
            stat = (x * m).sum(-1, keepdim=True).expand_as(m)
        elif level == "seq_mean":
            stat = verl_masked_mean(x, m, axis=-1)[:, None].expand_as(m)
        else:
            big = x.masked_fill(~mask, float("-inf")).amax(-1)
            stat = torch.where(big == float("-inf"), 0.0, big)[:, None].expand_as(m)
        if k == "k1":
            lo, hi = thr
            ok = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            ok = stat <= thr
        keep = keep * ok.double()
    return mask & (keep > 0)


def verl_kl(lp, ref, kind):
    # verl 0.9.1 kl_penalty / kl_penalty_forward, "+" = value of kind, gradient of k2.
    base = kind[:-1] if kind.endswith("+") else kind
    d = lp - ref
    if base in ("kl", "k1"):
        fwd = d
    elif base == "abs":
        fwd = d.abs()
    elif base in ("mse", "k2"):
        fwd = 0.5 * d.square()
    else:  # low_var_kl / k3
        kl = (ref - lp).clamp(-20, 20)
        fwd = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return fwd
    back = 0.5 * d.square()
    return back - back.detach() + fwd.detach()


def _verl_groups(index):
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(index.tolist()):
        groups.setdefault(u, []).append(i)
    return groups


def verl_grpo_adv(scores, index, eps, norm):
    # verl 0.9.1 compute_grpo_outcome_advantage: a group of one has mean 0, std 1.
    out = scores.clone()
    for members in _verl_groups(index).values():
        s = scores[members]
        mean, std = (s.mean(), s.std()) if len(members) > 1 else (0.0, 1.0)
        out[members] = (s - mean) / (std + eps) if norm else s - mean
    return out


def verl_rloo_adv(scores, index):
    # verl 0.9.1 compute_rloo_outcome_advantage.
    out = scores.clone()
    for members in _verl_groups(index).values():
        n = len(members)
        if n > 1:
            s = scores[members]
            out[members] = s * n / (n - 1) - s.mean() * n / (n - 1)
    return out


def verl_whiten(values, mask):
    # verl 0.9.1 masked_whiten (shift_mean=True) with the unbiased masked_var.
    m = mask.double()
    mean = verl_masked_mean(values, m)
    var = verl_masked_mean((values - mean) ** 2, m) * (m.sum() / (m.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_rpp_baseline_adv(scores, index, mask):
    # verl 0.9.1 compute_reinforce_plus_plus_baseline_outcome_advantage.
    centred = scores.clone()
    for members in _verl_groups(index).values():
        if len(members) > 1:
            centred[members] = scores[members] - scores[members].mean()
    tiled = centred[:, None].expand(mask.shape) * mask
    return verl_whiten(tiled, mask) * mask


def verl_rpp_adv(token_rewards, mask, gamma=1.0):
    # verl 0.9.1 compute_reinforce_plus_plus_outcome_advantage: the running return is carried
    # unchanged through tokens outside mask (observations between turns), then whitened.
    m = mask.double()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + gamma * running
        returns[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1 - m[:, t])
    return verl_whiten(returns, mask) * m, returns


# --------------------------------------------------------------------------------------------
# TRL 1.16: GRPOTrainer (_compute_loss, _generate_and_score_completions)
# --------------------------------------------------------------------------------------------


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    # TRL 1.16 vllm_importance_sampling_mode: token_/sequence_ x truncate/mask.
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def trl_coef_1(log_ratio, m, level):
    # TRL 1.16 importance_sampling_level: the token ratio, or exp(mean log-ratio), [B, 1].
    if level == "token":
        return torch.exp(log_ratio)
    return torch.exp(((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None])


def trl_grpo_loss(lp, old, adv, mask, loss_type, level, eps_low, eps_high, delta=None,
                  is_ratio=None, max_completion_length=None, num_items=None,
                  processes=1, accumulation=1, steps_per_generation=1):  # fmt: skip
    # TRL 1.16 GRPOTrainer._compute_loss, beta = 0.
    m = mask.double()
    a = adv[:, None]
    log_ratio = lp - old
    coef_1 = trl_coef_1(log_ratio, m, level)
    coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        coef_1 = coef_1.clamp(max=delta)
    per_token = -torch.minimum(coef_1 * a, coef_2 * a)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    if loss_type == "luspo":  # per_token is [B, 1] (sequence level): times the length
        loss = (per_token * m.sum(1, keepdim=True)).mean()
    per_token = per_token.expand_as(m)
    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (per_token.size(0) * max_completion_length)
    elif loss_type == "dapo":  # train mode: num_items spans the generation batch
        normalizer = max(num_items, 1.0) / processes * accumulation / steps_per_generation
        loss = (per_token * m).sum() / normalizer
    elif loss_type != "luspo":
        raise ValueError(loss_type)
    low = (coef_1 < 1 - eps_low) & (a < 0)
    high = (coef_1 > 1 + eps_high) & (a > 0)
    region = (low | high).double().expand_as(m)
    return loss, {"clip_fraction": (region * m).sum() / m.sum().clamp(min=1.0)}


def trl_kl(lp, ref, old, bias_correction):
    # TRL 1.16: k3 without clamp, times coef_1 (token level) with use_bias_correction_kl.
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    return kl * torch.exp(lp - old) if bias_correction else kl


def trl_advantages(rewards, num_generations, scale_rewards):
    # TRL 1.16 _generate_and_score_completions, one reward function, sum_then_normalize.
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = grouped.std(1).repeat_interleave(num_generations)
    adv = rewards - mean
    return adv if scale_rewards == "none" else adv / (std + 1e-4)


def verl_gpg(lp, adv, mask, mode):
    # verl 0.9.1 compute_policy_loss_gpg: -log_prob * A, aggregated.
    return verl_agg_loss(-lp * adv[:, None], mask, mode)


def trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    # TRL 1.16 multi_objective_aggregation="normalize_then_sum".
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k, std_k = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    total = (((grouped - mean_k) / (std_k + 1e-4)).view_as(rewards_per_func) * weights).sum(1)
    return (total - total.mean()) / (total.std() + 1e-4)


def verl_cispo(lp, old, adv, mask, clip_low, clip_high, mode):
    # verl 0.9.1 compute_policy_loss_cispo: -sg(clamp(r)) * A * log_prob, r from a clamped log.
    a = adv[:, None]
    ratio = torch.exp((lp - old).clamp(-SAFETY, SAFETY))
    w = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -w.detach() * a * lp
    metrics = {"clip_fraction": verl_masked_mean((ratio != w).double(), mask.double())}
    return verl_agg_loss(pg, mask, mode), metrics


def verl_dppo(lp, old, adv, mask, div_low, div_high, clip_ratio_c, mode, kind):
    # verl 0.9.1 compute_policy_loss_dppo_tv / _dppo_kl: -A * sg(min(r, c)) * log_prob * valid.
    a = adv[:, None].expand_as(lp)
    ratio = torch.exp((lp - old).clamp(-SAFETY, SAFETY))
    t = ratio.clamp(max=clip_ratio_c).detach()
    p, p_old = torch.exp(lp), torch.exp(old)
    if kind == "tv":
        pos, neg = (p - p_old) <= div_high, (p - p_old) >= -div_low
    else:
        bkl = p_old * (old - lp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        pos, neg = (bkl <= div_high) | (p <= p_old), (bkl <= div_low) | (p >= p_old)
    valid = torch.where(a > 0, pos, neg).detach().double()
    pg = -a * t * lp * valid
    m = mask.double()
    metrics = {
        "clip_fraction": verl_masked_mean(1.0 - valid, m),
        "dual_clip_fraction": verl_masked_mean((ratio > clip_ratio_c).double() * valid, m),
    }
    return verl_agg_loss(pg, mask, mode), metrics


def verl_sapo(lp, old, adv, mask, tau_pos, tau_neg):
    # verl 0.9.1 compute_policy_loss_sapo: a soft gate of r; always seq-mean-token-mean.
    a = adv[:, None].expand_as(lp)
    ratio = torch.exp((lp - old).clamp(-SAFETY, SAFETY))
    tau = torch.where(a > 0, torch.tensor(tau_pos).double(), torch.tensor(tau_neg).double())
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return verl_agg_loss(-gate * a, mask, "seq-mean-token-mean"), {}


def verl_dro(lp, old, adv, mask, beta, mode):
    # verl 0.9.1 compute_policy_loss_dro: -(log_prob * A - beta / 2 * (log_prob - old)^2).
    x = lp - old
    return verl_agg_loss(-(lp * adv[:, None] - 0.5 * beta * x.square()), mask, mode), {}


def verl_gpg_loss(lp, adv, mask, mode):
    return verl_gpg(lp, adv, mask, mode), {}


def verl_geo_mean(lp, old, adv, mask, clip_low, clip_high):
    # verl 0.9.1 compute_policy_loss_geo_mean (GMPO): the mean over rows of -mean(A) * s.
    m = mask.double()
    a = adv[:, None].expand_as(lp)
    x = lp - old
    sgn = torch.sign(a)
    x_clamp = x.clamp(-clip_low, clip_high)
    x_min = sgn * torch.min(sgn * x, sgn * x_clamp)
    n = m.sum(-1)
    s = torch.exp((x_min * m).sum(-1) / (n + 1e-8))
    a_seq = (a * m).sum(-1) / (n + 1e-8)
    clipped = (x != x_clamp).double()
    metrics = {"clip_fraction": verl_masked_mean(clipped * (a != 0).double(), m)}
    return torch.mean(-a_seq * s), metrics


def trl_soft_losses(lp, old, adv, mask, loss_type, level, eps_high=None, temps=(1.0, 1.05),
                    vespo=(2.0, 3.0, 3.0, 2.0), num_items=None):  # fmt: skip
    # TRL 1.16 GRPOTrainer._compute_loss for loss_type cispo / sapo / vespo, beta = 0.
    m = mask.double()
    a = adv[:, None]
    log_ratio = lp - old
    coef_1 = trl_coef_1(log_ratio, m, level)
    if loss_type == "cispo":
        per_token = -coef_1.clamp(max=eps_high).detach() * a * lp
    elif loss_type == "sapo":
        t = torch.where(a > 0, torch.tensor(temps[0]).double(), torch.tensor(temps[1]).double())
        per_token = -(torch.sigmoid(t * (coef_1 - 1)) * 4 / t) * a
    else:  # vespo: get_gamma_weights, no IS ratio
        k_pos, lam_pos, k_neg, lam_neg = vespo
        seq = (log_ratio.clamp(-20.0, 20.0) * m).sum(-1, keepdim=True)
        log_w_seq = seq.clamp(math.log(1e-8), 20.0)
        nonneg = a >= 0
        k = torch.where(nonneg, torch.tensor(k_pos).double(), torch.tensor(k_neg).double())
        lam = torch.where(nonneg, torch.tensor(lam_pos).double(), torch.tensor(lam_neg).double())
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w_seq - lam * torch.exp(log_w_seq))
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()
        per_token = -phi * a * lp
    per_token = per_token.expand_as(m)
    if loss_type == "sapo":  # aggregated as "grpo"
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(), {}
    return (per_token * m).sum() / num_items, {}  # as "dapo", one process


def verl_rloo_vectorized(scores, index):
    # verl 0.9.1 compute_rloo_vectorized_outcome_advantage: a group of one gets 0.
    _, inv = torch.unique(index, return_inverse=True)
    c = torch.bincount(inv)[inv].double()
    total = torch.bincount(inv, weights=scores)[inv]
    return (c * scores - total) / (c - 1).clamp(min=1) * (c > 1)


def verl_opo(scores, index, lengths):
    # verl 0.9.1 compute_opo_outcome_advantage: the length-weighted group mean as baseline.
    out = scores.clone()
    for _, members in _verl_groups(index).items():
        if len(members) > 1:
            s, n = scores[members], lengths[members].double()
            out[members] = s - (n * s).sum() / n.sum()
    return out


def verl_passk(scores, index, eps, norm):
    # verl 0.9.1 compute_grpo_passk_outcome_advantage: only the best gets r_max - r_second.
    out = torch.zeros_like(scores)
    for _, members in _verl_groups(index).items():
        s = scores[members]
        top, top_idx = torch.topk(s, 2)
        adv = top[0] - top[1]
        if norm:
            adv = adv / (torch.std(s) + eps)
        out[members[int(top_idx[0])]] = adv
    return out


def verl_grpo_vectorized(scores, index, eps, norm):
    # verl 0.9.1 compute_grpo_vectorized_outcome_advantage with group_mean_std (eps 0 floor).
    _, g = torch.unique(index, return_inverse=True)
    count = torch.bincount(g).double()
    mean = torch.zeros_like(count).index_add_(0, g, scores) / count.clamp(min=1)
    var = torch.zeros_like(count).index_add_(0, g, (scores - mean[g]) ** 2)
    std = torch.sqrt((var / (count - 1).clamp(min=1)).clamp(min=0.0))
    mean, std = torch.where(count <= 1, 0.0, mean), torch.where(count <= 1, 1.0, std)
    centred = scores - mean[g]
    return centred / (std[g] + eps) if norm else centred


def verl_gdpo(scores_per_key, weights, index, mask):
    # verl 0.9.1 compute_gdpo_outcome_advantage: GRPO per reward key, the weighted
    # sum, then masked_whiten over the batch's response tokens.
    total = sum(w * verl_grpo_adv(s, index, 1e-6, True) for w, s in zip(weights, scores_per_key))
    m = mask.double()
    return verl_whiten(total[:, None] * m, mask) * m


def verl_bypass_reinforce(lp, rollout, adv, mask, threshold, options):
    # verl 0.9.1 compute_policy_loss_bypass_mode, loss_type "reinforce": IS weights and the
    # rejection of the current policy against the rollout (detached), then -A * w * log_prob.
    log_ratio = lp.detach() - rollout
    w = verl_is_weights(log_ratio, mask, "token", threshold, False)
    kept = verl_rs_mask(log_ratio, mask, options)
    return verl_agg_loss(-adv[:, None] * lp * w, kept, "token-mean")
