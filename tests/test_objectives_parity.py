"""rlk's RL objectives against verl 0.9.1 and TRL 1.16, formula by formula.

Each ``verl_*``/``trl_*`` function below writes one peer formula out in plain float64 PyTorch
(from the peers' documented semantics; no peer code is imported or copied). rlk runs on the
reference and the triton backend through the public API, on fp32 copies of the same random
data: clipping active, masked holes, a row of one token and an empty row. docs/objectives.md
maps each peer setting to the rlk call tested here.
"""

from __future__ import annotations

import math

import pytest
import torch

import rlk

BACKENDS = ["reference", "triton"]
B, L = 6, 20
SAFETY = 20.0  # verl's bound on log importance ratios


def _data(seed: int, prefix_masks: bool = False):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, L, generator=g, dtype=torch.float64) * 0.5 - 2
    lp = old + 0.35 * torch.randn(B, L, generator=g, dtype=torch.float64)  # clips often
    lp[:, ::4] += 1.3  # and some ratios above verl's dual-clip bound 3
    rollout = old + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    if prefix_masks:
        lengths = torch.tensor([L, 0, 1, 7, 13, 3])
        mask = torch.arange(L)[None, :] < lengths[:, None]
    else:
        mask = torch.rand(B, L, generator=g) < 0.75  # holes
        mask[1] = False  # an empty row
        mask[2] = False
        mask[2, 5] = True  # a row of one token
    return _f32(lp), _f32(old), _f32(rollout), _f32(ref), _f32(adv), mask


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Round to fp32 once: rlk gets fp32, the peers the same values in float64."""
    return t.float().double()


def _rlk(backend, fn, lp, *args, **kw):
    """Run ``fn(lp, *args)`` on ``backend`` with fp32 inputs: (output, d sum(output) / d lp)."""
    x = lp.float().requires_grad_()
    conv = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
          for k, v in kw.items()}  # fmt: skip
    with rlk.use_backend(backend):
        out = fn(x, *conv, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        (grad,) = torch.autograd.grad(loss.sum(), x)
    return out, grad.double()


def _peer(fn, lp, *args, **kw):
    x = lp.clone().requires_grad_()
    out = fn(x, *args, **kw)
    loss = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return out, grad


def _close(got, want, backend, what=""):
    tol = dict(rtol=1e-7, atol=1e-9) if backend == "reference" else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got.double(), want.double(), msg=what, **tol)


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


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------

VERL_AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", VERL_AGGS)
def test_verl_vanilla_with_dual_clip(backend, mode):
    lp, old, _, _, adv, mask = _data(1)
    want, want_grad = _peer(verl_vanilla, lp, old, adv, mask, 0.2, 0.28, 3.0, mode)
    (loss, metrics), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask,
                                 clip_low=0.2, clip_high=0.28, clip_c=3.0, agg=mode)  # fmt: skip
    assert float(metrics["clip_fraction"]) > 0 and float(metrics["dual_clip_fraction"]) > 0
    _close(loss, want[0], backend, mode)
    _close(grad[mask], want_grad[mask], backend, "grad")
    assert not grad[~mask].any()
    for name, value in want[1].items():
        _close(metrics[name], value, backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_global_batch_info(backend):
    lp, old, _, _, adv, mask = _data(2)
    for mode, peer_kw, rlk_kw in [
        ("token-mean", {"batch_num_tokens": 150.0}, {"num_tokens": 150}),
        ("seq-mean-token-mean", {"global_batch_size": 11.0}, {"num_seqs": torch.tensor(11)}),
        ("seq-mean-token-sum-norm", {"global_batch_size": 9.0, "scale": 64}, {"num_seqs": 9,
                                                                             "norm_length": 64}),
    ]:  # fmt: skip
        want, want_grad = _peer(verl_vanilla, lp, old, adv, mask, 0.2, 0.2, 3.0, mode, **peer_kw)
        (loss, _), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask, clip_c=3.0, agg=mode,
                               **rlk_kw)  # fmt: skip
        _close(loss, want[0], backend, mode)
        _close(grad, want_grad, backend, mode)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_verl_gspo(backend, mode):
    lp, old, _, _, adv, mask = _data(3)
    adv[0] = -1.0
    lp[0] = old[0] + 12.0  # log s = 12 > 10: verl clamps, rlk's clip_c = e^10 does the same
    lp = _f32(lp)
    want, want_grad = _peer(verl_gspo, lp, old, adv, mask, 0.2, 0.28, mode)
    (loss, m), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask, clip_high=0.28,
                           ratio_level="sequence", agg=mode,
                           clip_c=math.exp(10.0))  # fmt: skip
    assert 0 < float(m["clip_fraction"]) < 1
    _close(loss, want, backend)
    _close(grad, want_grad, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "level,normalize,options,lower",
    [
        ("token", False, None, None),
        ("sequence", False, None, None),
        ("token", True, None, None),
        ("sequence", True, {"seq_mean_k3": 0.02}, None),
        (None, False, {"token_k1": (0.6, 1.5)}, None),
        (None, False, {"seq_sum_k1": (0.2, 5.0), "seq_max_k2": 0.15, "token_k3": 0.08}, None),
        ("token", False, {"seq_mean_k1": (0.9, 1.2), "seq_sum_k2": 0.6, "token_k2": 0.1}, None),
        ("token", True, {"seq_sum_k3": 0.5, "seq_mean_k2": 0.02, "seq_max_k3": 0.15}, None),
        ("token", False, None, 0.8),  # rollout_is_threshold="0.8_1.5"
        ("sequence", True, None, 0.3),
    ],
)
def test_verl_rollout_correction(backend, level, normalize, options, lower):
    lp, old, rollout, _, adv, mask = _data(4)
    log_ratio = old - rollout
    threshold = 1.5
    w = verl_is_weights(log_ratio, mask, level, threshold, normalize, lower) if level else None
    kept = verl_rs_mask(log_ratio, mask, options) if options else mask
    want, want_grad = _peer(verl_vanilla, lp, old, adv, kept, 0.2, 0.2, 3.0, "token-mean", w)
    kw = dict(rollout_logprobs=rollout, is_level=level, reject=options)
    if level:
        kw.update(is_max=threshold, is_normalize=normalize)
    if lower is not None:
        kw.update(is_mode="mask", is_min=lower)
        assert 0 < int(((w == 0) & mask).sum()) < int(mask.sum())  # some weights zeroed
    (loss, m), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask, clip_c=3.0, **kw)
    if options:
        frac = float(m["reject_fraction"])
        assert 0 < frac < 1
        _close(m["reject_fraction"], 1 - kept.sum() / mask.sum(), backend)
    _close(loss, want[0], backend)
    _close(grad, want_grad, backend)


VERL_KL = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "low_var_kl+", "k3+",
           "abs+", "k2+"]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", VERL_KL)
def test_verl_kl(backend, kind):
    lp, _, _, ref, _, _ = _data(5)
    ref[0, :4] = lp[0, :4] + torch.tensor([25.0, -25.0, 3.0, -3.0], dtype=torch.float64)  # clamps
    ref = _f32(ref)
    want, want_grad = _peer(verl_kl, lp, ref, kind)
    got, grad = _rlk(backend, rlk.kl_penalty, lp, ref, kind)
    _close(got, want, backend, kind)
    _close(grad, want_grad, backend, kind)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_advantages(backend):
    g = torch.Generator().manual_seed(6)
    index = torch.tensor([4, 1, 4, 9, 1, 4, 7, 7, 1, 4, 2])  # unequal, non-contiguous, singletons
    scores = (torch.rand(11, generator=g) < 0.5).double() + 0.1 * torch.randn(11, generator=g)
    scores[[6, 7]] = 1.0  # a group with std 0
    scores = scores.float().double()
    lengths = torch.tensor([5, 0, 7, 1, 3, 6, 2, 4, 7, 1, 5])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    token_rewards = torch.zeros(11, 7, dtype=torch.float64)
    token_rewards[torch.arange(11), (lengths - 1).clamp(min=0)] = scores  # outcome reward
    token_rewards[1] = 0.0  # an empty response has no reward token: verl scores it 0
    scores[1] = 0.0
    hole_mask = mask.clone()
    hole_mask[[0, 2, 5], [1, 3, 2]] = False  # observation tokens: verl carries the return over

    def run(**kw):
        with rlk.use_backend(backend):
            return rlk.grpo_advantages(scores.float(), group_ids=index, **kw).double()

    tol = dict(rtol=1e-6, atol=1e-6) if backend == "reference" else dict(rtol=2e-5, atol=2e-5)
    for norm in (True, False):
        want = verl_grpo_adv(scores, index, 1e-6, norm)
        torch.testing.assert_close(run(norm_std=norm), want, **tol)
    torch.testing.assert_close(run(estimator="rloo"), verl_rloo_adv(scores, index), **tol)
    want = verl_rpp_baseline_adv(scores, index, mask)
    got = run(estimator="reinforce_plus_plus_baseline", mask=mask)
    torch.testing.assert_close((got[:, None] * mask)[mask], want[mask], **tol)
    want, _ = verl_rpp_adv(token_rewards, hole_mask)
    with rlk.use_backend(backend):
        got = rlk.grpo_advantages(scores.float(), estimator="reinforce++", mask=hole_mask)
    got = got.double()
    torch.testing.assert_close((got[:, None] * hole_mask)[hole_mask], want[hole_mask], **tol)


TRL_IS = [
    (None, None, None),
    ("sequence_mask", None, 3.0),  # TRL's default mode and bounds
    ("sequence_mask", 0.5, 3.0),
    ("token_truncate", 0.8, 1.3),
    ("token_mask", 0.8, 1.3),
    ("sequence_truncate", 0.5, 2.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("is_mode,clip_min,clip_max", TRL_IS)
def test_trl_grpo_loss(backend, loss_type, level, is_mode, clip_min, clip_max):
    # Sequence ratios with token weights: TRL differentiates through the sequence mean, which
    # spreads the weights over the tokens; rlk gives each token its own weight's share (verl).
    same_grad = not (level == "sequence" and is_mode is not None and is_mode.startswith("token"))
    lp, old, rollout, _, adv, mask = _data(7)
    m = mask.double()
    ratio = trl_is_ratio(old, rollout, m, is_mode, clip_min, clip_max) if is_mode else None
    delta = 1.5 if loss_type == "bnpo" else None  # two-sided clipping
    # The tokens of a generation batch over 2 processes and 4 steps, accumulated over 2 steps.
    num_items = 8 * float(mask.sum()) + 30.0
    want, want_grad = _peer(trl_grpo_loss, lp, old, adv, mask, loss_type, level, 0.2, 0.28,
                            delta=delta, is_ratio=ratio, max_completion_length=32,
                            num_items=num_items, processes=2, accumulation=2,
                            steps_per_generation=4)  # fmt: skip
    agg, kw = {
        "grpo": ("row-mean-token-mean", {}),
        "bnpo": ("token-mean", {}),
        "dr_grpo": ("row-mean-token-sum-norm", {"norm_length": 32}),
        "dapo": ("token-mean", {"num_tokens": num_items / 2 * 2 / 4}),
    }[loss_type]
    if is_mode:
        lvl, mode = is_mode.split("_")
        kw.update(rollout_logprobs=rollout, is_level=lvl, is_mode=mode, is_min=clip_min,
                  is_max=clip_max)  # fmt: skip
    (loss, metrics), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask, clip_high=0.28,
                                 clip_c=delta, agg=agg, ratio_level=level, **kw)  # fmt: skip
    _close(loss, want[0], backend, "loss")
    if same_grad:
        _close(grad, want_grad, backend, "grad")
    else:  # the same total
        _close(grad.sum(-1), want_grad.sum(-1), backend, "grad")
    if level == "token":
        _close(metrics["clip_fraction"], want[1]["clip_fraction"], backend, "clip_fraction")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_mode", [None, "sequence_mask", "sequence_truncate"])
def test_trl_luspo(backend, is_mode):
    lp, old, rollout, _, adv, mask = _data(10)
    ratio = trl_is_ratio(old, rollout, mask.double(), is_mode, 0.5, 2.0) if is_mode else None
    want, want_grad = _peer(trl_grpo_loss, lp, old, adv, mask, "luspo", "sequence", 0.2, 0.28,
                            is_ratio=ratio)  # fmt: skip
    kw = {}
    if is_mode:
        kw = dict(rollout_logprobs=rollout, is_level="sequence", is_mode=is_mode.split("_")[1],
                  is_min=0.5, is_max=2.0)  # fmt: skip
    (loss, _), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask, clip_high=0.28,
                           ratio_level="sequence", agg="seq-mean-token-sum", num_seqs=B,
                           **kw)  # fmt: skip
    _close(loss, want[0], backend, "loss")
    _close(grad, want_grad, backend, "grad")


def verl_gpg(lp, adv, mask, mode):
    # verl 0.9.1 compute_policy_loss_gpg: -log_prob * A, aggregated.
    return verl_agg_loss(-lp * adv[:, None], mask, mode)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verl_gpg_gradient(backend, mode):
    lp, _, _, _, adv, mask = _data(11)
    _, want_grad = _peer(verl_gpg, lp, adv, mask, mode)
    # old = lp: the ratio is 1 (never clipped) and d(-A r) = -A d(log pi).
    _, grad = _rlk(backend, rlk.policy_loss, lp, lp, adv, mask, agg=mode)
    _close(grad, want_grad, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias_correction", [False, True])
def test_trl_kl(backend, bias_correction):
    lp, old, _, ref, _, _ = _data(8)
    ref[0, 0] = lp[0, 0] + 4.0  # k3 = e^4 - 5 > 10: TRL does not clamp
    ref = _f32(ref)
    want, want_grad = _peer(trl_kl, lp, ref, old, bias_correction)
    got, grad = _rlk(backend, rlk.kl_penalty, lp, ref, "k3", clamp=None,
                     old_logprobs=old if bias_correction else None)  # fmt: skip
    _close(got, want, backend)
    _close(grad, want_grad, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_trl_advantages(backend, scale):
    g = torch.Generator().manual_seed(9)
    rewards = torch.randn(24, generator=g).double()
    rewards[:4] = 0.5  # a group with std 0
    want = trl_advantages(rewards, 4, scale)
    with rlk.use_backend(backend):
        got = rlk.grpo_advantages(rewards.float(), 4, norm_std=scale, eps=1e-4).double()
    tol = dict(rtol=1e-6, atol=1e-6) if backend == "reference" else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got, want, **tol)


def trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    # TRL 1.16 multi_objective_aggregation="normalize_then_sum".
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k, std_k = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    total = (((grouped - mean_k) / (std_k + 1e-4)).view_as(rewards_per_func) * weights).sum(1)
    return (total - total.mean()) / (total.std() + 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trl_normalize_then_sum(backend):
    g = torch.Generator().manual_seed(12)
    per_func = torch.randn(16, 2, generator=g).double()
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    want = trl_normalize_then_sum(per_func, weights, 4)
    with rlk.use_backend(backend):
        parts = [rlk.grpo_advantages(per_func[:, k].float(), 4, eps=1e-4) for k in range(2)]
        total = parts[0] * 1.0 + parts[1] * 0.5
        got = rlk.grpo_advantages(total, group_size=16, eps=1e-4).double()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------------------------
# The other objectives (loss_mode): verl 0.9.1's registered policy losses, TRL 1.16's cispo,
# sapo and vespo loss types. Each peer formula is written out below; the check is a relative
# error of at most 1e-6 (of the largest value) on both backends, on the loss and the gradient.
# --------------------------------------------------------------------------------------------

MODE_TOL = 1e-6


def _within(got, want, what):
    """max |got - want| <= MODE_TOL * max |want|; returns the relative error."""
    got, want = got.detach().double(), want.detach().double()
    scale = max(float(want.abs().max()), 1e-30)
    err = float((got - want).abs().max()) / scale
    print(f"{what}: max relative error {err:.2e}")
    assert err <= MODE_TOL, f"{what}: {err:.2e} > {MODE_TOL}"
    return err


def _check_mode(backend, peer, peer_args, what, lp, old, adv, mask, metrics=(), **kw):
    """rlk.policy_loss(**kw) against ``peer(lp, *peer_args)``: loss, gradient, ``metrics``."""
    want, want_grad = _peer(peer, lp, *peer_args)
    (loss, got_metrics), grad = _rlk(backend, rlk.policy_loss, lp, old, adv, mask, **kw)
    _within(loss, want[0], f"{what} {backend} loss")
    _within(grad, want_grad, f"{what} {backend} grad")
    assert not grad[~mask].any()
    for name in metrics:
        _close(got_metrics[name], want[1][name], backend, name)
    return got_metrics


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", VERL_AGGS)
def test_verl_cispo(backend, mode):
    lp, old, _, _, adv, mask = _data(21)
    got = _check_mode(backend, verl_cispo, (old, adv, mask, 0.2, 0.28, mode), f"cispo {mode}",
                      lp, old, adv, mask, metrics=["clip_fraction"], loss_mode="cispo",
                      clip_low=0.2, clip_high=0.28, agg=mode)  # fmt: skip
    assert float(got["clip_fraction"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verl_dppo(backend, kind, mode):
    lp, old, _, _, adv, mask = _data(22)
    low, high = (0.03, 0.05) if kind == "tv" else (0.01, 0.02)
    got = _check_mode(backend, verl_dppo, (old, adv, mask, low, high, 3.0, mode, kind),
                      f"dppo_{kind} {mode}", lp, old, adv, mask,
                      metrics=["clip_fraction", "dual_clip_fraction"], loss_mode=f"dppo_{kind}",
                      clip_low=low, clip_high=high, clip_c=3.0, agg=mode)  # fmt: skip
    assert 0 < float(got["clip_fraction"]) < 1 and float(got["dual_clip_fraction"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0)])
def test_verl_sapo(backend, taus):
    lp, old, _, _, adv, mask = _data(23)
    _check_mode(backend, verl_sapo, (old, adv, mask, *taus), f"sapo {taus}", lp, old, adv, mask,
                loss_mode="sapo", agg="seq-mean-token-mean",
                mode_params={"tau_pos": taus[0], "tau_neg": taus[1]})  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_verl_dro(backend, mode):
    lp, old, _, _, adv, mask = _data(24)
    _check_mode(backend, verl_dro, (old, adv, mask, 0.7, mode), f"dro {mode}", lp, old, adv,
                mask, loss_mode="dro", agg=mode, mode_params={"beta": 0.7})  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verl_gpg(backend, mode):
    lp, old, _, _, adv, mask = _data(25)
    _check_mode(backend, verl_gpg_loss, (adv, mask, mode), f"gpg {mode}", lp, old, adv, mask,
                loss_mode="gpg", agg=mode)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix_masks", [False, True])
def test_verl_geo_mean(backend, prefix_masks):
    lp, old, _, _, adv, mask = _data(26, prefix_masks)
    adv[0] = 0.0  # sign(A) = 0: no gradient
    got = _check_mode(backend, verl_geo_mean, (old, adv, mask, 0.2, 0.28),
                      f"geo_mean prefix={prefix_masks}", lp, old, adv, mask,
                      loss_mode="geo_mean", clip_low=0.2, clip_high=0.28,
                      agg="row-mean-token-mean")  # fmt: skip
    assert float(got["clip_fraction"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_sapo(backend, level):
    lp, old, _, _, adv, mask = _data(27)
    _check_mode(backend, trl_soft_losses, (old, adv, mask, "sapo", level, None, (1.0, 1.05)),
                f"trl sapo {level}", lp, old, adv, mask, loss_mode="sapo", ratio_level=level,
                agg="row-mean-token-mean")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_trl_cispo(backend):
    lp, old, _, _, adv, mask = _data(28)
    # TRL caps the ratio at epsilon_high (an absolute bound, no lower one): clip_low=1.
    _check_mode(backend, trl_soft_losses, (old, adv, mask, "cispo", "token", 1.5, None, None, 97.0),
                "trl cispo", lp, old, adv, mask, loss_mode="cispo", clip_low=1.0, clip_high=0.5,
                num_tokens=97.0)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 1.5)])
def test_trl_vespo(backend, params):
    lp, old, _, _, adv, mask = _data(29)
    old = _f32(lp - (lp - old) / 6)  # sequence log-ratios near 0, where phi is not 0
    keys = ("k_pos", "lambda_pos", "k_neg", "lambda_neg")
    _check_mode(backend, trl_soft_losses,
                (old, adv, mask, "vespo", "token", None, None, params, 97.0), f"trl vespo {params}",
                lp, old, adv, mask, loss_mode="vespo", num_tokens=97.0,
                mode_params=dict(zip(keys, params)))  # fmt: skip


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_more_advantage_estimators(backend):
    g = torch.Generator().manual_seed(30)
    index = torch.tensor([4, 1, 4, 9, 1, 4, 7, 7, 1, 4, 2, 3, 3])  # unequal, singletons
    scores = (torch.rand(13, generator=g) < 0.5).double() + 0.1 * torch.randn(13, generator=g)
    scores[[6, 7]] = 1.0  # a group with std 0: Pass@k's margin is 0
    scores = scores.float().double()
    lengths = torch.tensor([5, 3, 7, 1, 3, 6, 2, 4, 7, 1, 5, 2, 6])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    mask[0, 1] = False  # a hole: the count is of mask's tokens
    lengths[0] -= 1

    def run(**kw):
        with rlk.use_backend(backend):
            return rlk.grpo_advantages(scores.float(), group_ids=index, **kw).double()

    checks = {
        "rloo_vectorized": (run(estimator="rloo_vectorized"), verl_rloo_vectorized(scores, index)),
        "opo": (run(estimator="opo", mask=mask), verl_opo(scores, index, lengths)),
        "grpo_vectorized": (
            run(estimator="grpo_vectorized"),
            verl_grpo_vectorized(scores, index, 1e-6, True),
        ),
    }
    single = torch.tensor([int((index == i).sum()) for i in index]) == 1
    for norm in (True, False):  # verl raises for a group of one: compared on the others
        got = run(estimator="grpo_passk", norm_std=norm)
        keep = index[~single]
        checks[f"grpo_passk norm={norm}"] = (got[~single], verl_passk(scores[~single], keep,
                                                                        1e-6, norm))  # fmt: skip
        assert not got[single].any()
    for what, (got, want) in checks.items():
        _within(got, want, f"{what} {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_verl_reinforce_plus_plus_gamma_and_holes(backend, gamma):
    # rlk's call for it: GAE with values 0 and lam = 1 (docs/objectives.md).
    g = torch.Generator().manual_seed(31)
    mask = torch.rand(B, L, generator=g) < 0.7  # holes
    mask[1] = False
    rewards = _f32(torch.randn(B, L, generator=g, dtype=torch.float64))
    want_adv, want_ret = verl_rpp_adv(rewards, mask, gamma)
    with rlk.use_backend(backend):
        adv, ret = rlk.gae_advantages(rewards.float(), torch.zeros(B, L), mask, gamma=gamma,
                                      lam=1.0)  # fmt: skip
    _within(adv.double()[mask], want_adv[mask], f"reinforce++ gamma={gamma} {backend} advantages")
    _within(ret.double()[mask], want_ret[mask], f"reinforce++ gamma={gamma} {backend} returns")


def verl_gdpo(scores_per_key, weights, index, mask):
    # verl 0.9.1 compute_gdpo_outcome_advantage: GRPO per reward key, the weighted
    # sum, then masked_whiten over the batch's response tokens.
    total = sum(w * verl_grpo_adv(s, index, 1e-6, True) for w, s in zip(weights, scores_per_key))
    m = mask.double()
    return verl_whiten(total[:, None] * m, mask) * m


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_gdpo_as_documented(backend):
    # docs/objectives.md's call for gdpo: grpo_advantages per key, the weighted sum in torch,
    # then estimator="reinforce++" (its whitening over the tokens of mask).
    g = torch.Generator().manual_seed(32)
    index = torch.tensor([4, 1, 4, 9, 1, 4, 7, 7, 1, 4, 2])
    keys = [_f32(torch.randn(11, generator=g, dtype=torch.float64)) for _ in range(2)]
    keys.append(_f32((torch.rand(11, generator=g) < 0.5).double()))
    weights = [1.0, 0.5, 2.0]
    lengths = torch.tensor([5, 2, 7, 1, 3, 6, 2, 4, 7, 1, 5])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    want = verl_gdpo(keys, weights, index, mask)
    with rlk.use_backend(backend):
        total = sum(
            w * rlk.grpo_advantages(k.float(), group_ids=index) for w, k in zip(weights, keys)
        )
        got = rlk.grpo_advantages(total, estimator="reinforce++", mask=mask).double()
    _within((got[:, None] * mask)[mask], want[mask], f"gdpo {backend}")


def verl_bypass_reinforce(lp, rollout, adv, mask, threshold, options):
    # verl 0.9.1 compute_policy_loss_bypass_mode, loss_type "reinforce": IS weights and the
    # rejection of the current policy against the rollout (detached), then -A * w * log_prob.
    log_ratio = lp.detach() - rollout
    w = verl_is_weights(log_ratio, mask, "token", threshold, False)
    kept = verl_rs_mask(log_ratio, mask, options)
    return verl_agg_loss(-adv[:, None] * lp * w, kept, "token-mean")


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_bypass_reinforce_as_documented(backend):
    # rlk.ops.UNOFFERED's call for it: old = lp.detach() (the IS statistics' policy), gpg.
    lp, _, rollout, _, adv, mask = _data(33)
    options = {"token_k2": 0.1}
    want, want_grad = _peer(verl_bypass_reinforce, lp, rollout, adv, mask, 2.0, options)
    (loss, m), grad = _rlk(backend, rlk.policy_loss, lp, lp, adv, mask, loss_mode="gpg",
                           rollout_logprobs=rollout, is_level="token", is_max=2.0,
                           reject=options)  # fmt: skip
    assert 0 < float(m["reject_fraction"]) < 1
    _within(loss, want, f"bypass reinforce {backend} loss")
    _within(grad, want_grad, f"bypass reinforce {backend} grad")
