"""rlk's RL objectives against verl 0.9.1 and TRL 1.16, formula by formula.

Each ``verl_*``/``trl_*`` function of ``objective_peers.py`` writes one peer formula out in
plain float64 PyTorch (from the peers' documented semantics; no peer code is imported or
copied). rlk runs on the reference and the triton backend through the public API, on fp32
copies of the same random data: clipping active, masked holes, a row of one token and an empty
row. docs/objectives.md maps each peer setting to the rlk call tested here.
"""

from __future__ import annotations

import math

import pytest
import torch
from objective_peers import (
    trl_advantages,
    trl_grpo_loss,
    trl_is_ratio,
    trl_kl,
    trl_normalize_then_sum,
    trl_soft_losses,
    verl_bypass_reinforce,
    verl_cispo,
    verl_dppo,
    verl_dro,
    verl_gdpo,
    verl_geo_mean,
    verl_gpg,
    verl_gpg_loss,
    verl_grpo_adv,
    verl_grpo_vectorized,
    verl_gspo,
    verl_is_weights,
    verl_kl,
    verl_opo,
    verl_passk,
    verl_rloo_adv,
    verl_rloo_vectorized,
    verl_rpp_adv,
    verl_rpp_baseline_adv,
    verl_rs_mask,
    verl_sapo,
    verl_vanilla,
)

import rlk

BACKENDS = ["reference", "triton"]
B, L = 6, 20


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
