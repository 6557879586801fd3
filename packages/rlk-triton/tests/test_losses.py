"""policy_loss / kl_penalty / grpo_advantages kernels vs the float64 reference, plus invariances.

L = 300 spans two token blocks (BLOCK_L = 256); tests patch BLOCK_B to 2 so that the batch sums
run over several sequence blocks too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import rlk_reference as ref
from rlk_triton import backend, tuning
from rlk_triton import losses as lsmod

TABLE = backend.default_table()
AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.fixture(autouse=True)
def small_batch_block(monkeypatch):
    monkeypatch.setattr(lsmod, "BLOCK_B", 2)


def _policy_inputs(b=5, length=300, dtype=torch.float32, adv_1d=False, tis=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, length, generator=g) - 2
    new = old + 0.5 * torch.randn(b, length, generator=g)
    adv = torch.randn(b if adv_1d else (b, length), generator=g)
    mask = torch.rand(b, length, generator=g) < 0.7
    mask[1] = False  # an empty sequence: not counted in sequence means
    new[~mask] = float("inf")  # padding may hold anything
    roll = (old + 0.2 * torch.randn(b, length, generator=g)).to(dtype) if tis else None
    return new.to(dtype), old.to(dtype), adv, mask, roll


def _loss(fn, lp, *args, **kw):
    x = lp.clone().requires_grad_()
    loss, metrics = fn(x, *args, **kw)
    loss.backward()
    return loss.detach(), metrics, x.grad


CASES = [
    (agg, dual, tis, adv_1d)
    for agg, (dual, tis, adv_1d) in itertools.product(
        AGGS, [(False, False, False), (True, False, True), (True, True, False)]
    )
]


@pytest.mark.parametrize("agg,dual,tis,adv_1d", CASES)
def test_policy_loss_vs_reference(agg, dual, tis, adv_1d):
    lp, old, adv, mask, roll = _policy_inputs(adv_1d=adv_1d, tis=tis)
    kw = dict(
        clip_low=0.2,
        clip_high=0.28,
        clip_c=1.5 if dual else None,
        agg=agg,
        rollout_logprobs=roll,
        tis_cap=1.5 if tis else None,
    )
    loss, metrics, grad = _loss(lsmod.policy_loss, lp, old, adv, mask, table=TABLE, **kw)
    rloss, rmetrics, rgrad = _loss(ref.policy_loss, lp, old, adv, mask, **kw)
    assert loss.shape == () and loss.dtype == torch.float32
    assert set(metrics) == set(rmetrics)
    torch.testing.assert_close(loss, rloss, atol=1e-6, rtol=1e-5)
    for name, value in metrics.items():
        assert value.shape == () and value.dtype == torch.float32 and not value.requires_grad
        torch.testing.assert_close(value, rmetrics[name], atol=1e-6, rtol=1e-5, msg=name)
    if dual:
        assert float(metrics["dual_clip_fraction"]) > 0  # the case exercises the dual clip
    assert float(metrics["clip_fraction"]) > 0
    assert torch.isfinite(grad).all() and not grad[~mask].any()
    torch.testing.assert_close(grad, rgrad, atol=1e-8, rtol=1e-5)


def test_policy_loss_bf16_gradient_dtype():
    lp, old, adv, mask, _ = _policy_inputs(dtype=torch.bfloat16)
    loss, _, grad = _loss(lsmod.policy_loss, lp, old, adv, mask, table=TABLE)
    rloss, _, rgrad = _loss(ref.policy_loss, lp, old, adv, mask)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, rloss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, rgrad)


@pytest.mark.parametrize("agg", AGGS)
def test_empty_mask_gives_zero_loss_and_metrics(agg):
    lp, old, adv, mask, _ = _policy_inputs(b=3, length=20)
    mask[:] = False
    loss, metrics, grad = _loss(
        lsmod.policy_loss, lp, old, adv, mask, clip_c=3.0, agg=agg, table=TABLE
    )
    assert float(loss) == 0 and all(float(v) == 0 for v in metrics.values())
    assert not grad.any()


def test_zero_batch_and_length():
    for b, length in ((0, 7), (3, 0)):
        lp = torch.zeros(b, length)
        loss, _, grad = _loss(lsmod.policy_loss, lp, lp, torch.zeros(b), lp.bool(), table=TABLE)
        assert float(loss) == 0 and grad.shape == (b, length)


def test_float_mask_equals_bool_mask():
    lp, old, adv, mask, _ = _policy_inputs()
    a = _loss(lsmod.policy_loss, lp, old, adv, mask, agg="seq-mean-token-mean", table=TABLE)
    b = _loss(lsmod.policy_loss, lp, old, adv, mask.float(), agg="seq-mean-token-mean", table=TABLE)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


def _all_bits(fn):
    loss, metrics, grad = fn()
    return [loss, grad, *metrics.values()]


def test_policy_loss_tuning_invariance_and_determinism():
    lp, old, adv, mask, roll = _policy_inputs(b=7, tis=True)
    configs = tuning.op_configs(TABLE, "policy_loss")
    assert len(configs) >= 2

    def run():
        return _all_bits(
            lambda: _loss(
                lsmod.policy_loss,
                lp,
                old,
                adv,
                mask,
                clip_c=1.5,
                agg="seq-mean-token-mean",
                rollout_logprobs=roll,
                tis_cap=1.5,
                table=TABLE,
            )
        )

    results = []
    for cfg in configs:
        with tuning.force("policy_loss", cfg):
            results.append(run())
    results.append(run())
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


def test_policy_loss_sequence_gradients_do_not_depend_on_other_sequences():
    # With seq-mean-token-sum-norm each sequence's gradient is its own business (1 / L).
    lp, old, adv, mask, _ = _policy_inputs(b=6)
    kw = dict(agg="seq-mean-token-sum-norm", table=TABLE)
    _, _, grad = _loss(lsmod.policy_loss, lp, old, adv, mask, **kw)
    idx = torch.tensor([4, 0, 2])
    _, _, sub = _loss(lsmod.policy_loss, lp[idx], old[idx], adv[idx], mask[idx], **kw)
    assert torch.equal(sub, grad[idx])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_penalty_vs_reference(kind, dtype):
    g = torch.Generator().manual_seed(1)
    ref_lp = torch.randn(3, 300, generator=g)
    lp = (ref_lp + 4 * torch.randn(3, 300, generator=g)).to(dtype)  # k3 hits its clamp
    ref_lp = ref_lp.to(dtype)
    lp[0, 0] = ref_lp[0, 0]  # d = 0 exactly: |d| has gradient 0 there, as in torch
    cot = torch.randn(3, 300, generator=g)
    x = lp.clone().requires_grad_()
    kl = lsmod.kl_penalty(x, ref_lp, kind, table=TABLE)
    (kl * cot).sum().backward()
    xr = lp.clone().requires_grad_()
    rkl = ref.kl_penalty(xr, ref_lp, kind)
    (rkl * cot).sum().backward()
    assert kl.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(kl, rkl, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


def test_kl_penalty_tuning_invariance():
    g = torch.Generator().manual_seed(2)
    lp, ref_lp = torch.randn(5, 700, generator=g), torch.randn(5, 700, generator=g)
    results = []
    for cfg in tuning.op_configs(TABLE, "kl_penalty"):
        with tuning.force("kl_penalty", cfg):
            x = lp.clone().requires_grad_()
            kl = lsmod.kl_penalty(x, ref_lp, "k3", table=TABLE)
            kl.sum().backward()
            results.append((kl.detach(), x.grad))
    assert len(results) >= 2
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))


@pytest.mark.parametrize("norm_std", [True, False])
@pytest.mark.parametrize(
    "size,dtype", [(2, torch.float32), (8, torch.bfloat16), (70, torch.float32)]
)
def test_grpo_advantages_vs_reference(norm_std, size, dtype):
    g = torch.Generator().manual_seed(size)
    rewards = torch.randn(5 * size, generator=g).to(dtype)
    rewards[:size] = 1.0  # a constant group: std 0, advantages 0
    adv = lsmod.grpo_advantages(rewards, size, norm_std=norm_std, eps=1e-6, table=TABLE)
    radv = ref.grpo_advantages(rewards, size, norm_std=norm_std, eps=1e-6)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, radv, atol=2e-6, rtol=2e-6)


def test_grpo_group_invariance_and_tuning():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(9 * 70, generator=g)
    results = []
    for cfg in tuning.op_configs(TABLE, "grpo_advantages"):
        with tuning.force("grpo_advantages", cfg):
            results.append(lsmod.grpo_advantages(rewards, 70, table=TABLE))
    assert len(results) >= 2 and all(torch.equal(results[0], r) for r in results[1:])
    sub = lsmod.grpo_advantages(rewards[140:350], 70, table=TABLE)  # groups 2..4 alone
    assert torch.equal(sub, results[0][140:350])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_policy_loss_has_no_host_sync_and_matches_reference():
    lp, old, adv, mask, roll = _policy_inputs(b=64, length=2048, tis=True)
    lp, old, adv, mask, roll = (t.cuda() for t in (lp, old, adv, mask, roll))
    kw = dict(clip_c=1.5, agg="seq-mean-token-mean", rollout_logprobs=roll, tis_cap=1.5)
    x = lp.clone().requires_grad_()
    lsmod.policy_loss(x, old, adv, mask, table=TABLE, **kw)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = lsmod.policy_loss(x, old, adv, mask, table=TABLE, **kw)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rloss, rmetrics = ref.policy_loss(lp, old, adv, mask, **kw)
    torch.testing.assert_close(loss.cpu(), rloss.cpu(), atol=1e-6, rtol=1e-5)
    for name in rmetrics:
        torch.testing.assert_close(metrics[name].cpu(), rmetrics[name].cpu(), atol=1e-6, rtol=1e-5)
