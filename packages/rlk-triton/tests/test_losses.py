"""policy_loss / kl_penalty / grpo_advantages kernels vs the float64 reference, plus invariances.

L = 300 spans two token blocks (BLOCK_L = 256); tests patch BLOCK_B to 2 so that the batch sums
run over several sequence blocks too.
"""

from __future__ import annotations

import pytest
import torch

import rlk_reference as ref
from rlk.ops import AGG_MODES
from rlk_triton import _objectives as objmod
from rlk_triton import advantages as advmod
from rlk_triton import backend, tuning
from rlk_triton.advantages import grpo_advantages
from rlk_triton.kl import kl_penalty
from rlk_triton.policy_loss import policy_loss

TABLE = backend.default_table()
AGGS = AGG_MODES


@pytest.fixture(autouse=True)
def small_batch_block(monkeypatch):
    monkeypatch.setattr(objmod, "BLOCK_B", 2)
    monkeypatch.setattr(advmod, "BLOCK_B", 2)


def _policy_inputs(b=5, length=300, dtype=torch.float32, adv_1d=False, tis=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, length, generator=g) - 2
    # A shift per sequence spreads the sequence ratios (GSPO) over and beyond the clip range.
    shift = torch.tensor([0.0, 0.1, -0.3, 0.5, 0.9, -0.1, 0.2, 1.2] * b)[:b, None]
    new = old + 0.5 * torch.randn(b, length, generator=g) + shift
    adv = torch.randn(b if adv_1d else (b, length), generator=g)
    mask = torch.rand(b, length, generator=g) < 0.7
    mask[1] = False  # an empty sequence: not counted in sequence means
    new[~mask] = float("inf")  # padding may hold anything
    # Rollout noise differs per sequence, so that sequence statistics separate the sequences.
    noise = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25, 0.05, 0.35] * b)[:b, None]
    roll = old + noise * torch.randn(b, length, generator=g)
    roll = roll.to(dtype) if tis else None
    return new.to(dtype), old.to(dtype), adv, mask, roll


def _loss(fn, lp, *args, **kw):
    x = lp.clone().requires_grad_()
    loss, metrics = fn(x, *args, **kw)
    loss.backward()
    return loss.detach(), metrics, x.grad


#: Option sets, each run with every aggregation (bounds chosen away from the data's ties).
VARIANTS = {
    "plain": {},
    "dual clip, token TIS, adv[B]": dict(clip_c=1.5, is_max=1.5),
    "GSPO, sequence mask IS": dict(
        clip_c=1.5, ratio_level="sequence", is_level="sequence", is_mode="mask", is_max=3.0
    ),
    "rejection only": dict(is_level=None, reject={"token_k1": (0.7, 1.4), "seq_mean_k3": 0.021}),
    "token mask IS, normalised, rejection": dict(
        is_mode="mask",
        is_min=0.8,
        is_max=1.3,
        is_normalize=True,
        reject={"seq_max_k2": 0.23, "token_k3": 0.05, "seq_sum_k1": (0.01, 60.0)},
    ),
    "sequence truncation from below, given normaliser": dict(
        is_level="sequence", is_min=0.5, is_normalize=torch.tensor(1.7)
    ),
}
CASES = [(agg, v) for agg in AGGS for v in VARIANTS]


@pytest.mark.parametrize("agg,variant", CASES)
def test_policy_loss_vs_reference(agg, variant):
    kw = dict(VARIANTS[variant], clip_low=0.2, clip_high=0.28, agg=agg)
    tis = variant != "plain"
    lp, old, adv, mask, roll = _policy_inputs(adv_1d="adv[B]" in variant, tis=tis)
    if tis:
        kw["rollout_logprobs"] = roll
    loss, metrics, grad = _loss(policy_loss, lp, old, adv, mask, table=TABLE, **kw)
    rloss, rmetrics, rgrad = _loss(ref.policy_loss, lp, old, adv, mask, **kw)
    assert loss.shape == () and loss.dtype == torch.float32
    assert set(metrics) == set(rmetrics)
    torch.testing.assert_close(loss, rloss, atol=1e-6, rtol=1e-5)
    for name, value in metrics.items():
        assert value.shape == () and value.dtype == torch.float32 and not value.requires_grad
        torch.testing.assert_close(value, rmetrics[name], atol=1e-6, rtol=1e-5, msg=name)
    if "dual" in variant or "GSPO" in variant:
        assert float(metrics["dual_clip_fraction"]) > 0  # the case exercises the dual clip
    if "reject" in kw:
        assert 0 < float(metrics["reject_fraction"]) < 1
    assert float(metrics["clip_fraction"]) > 0
    assert torch.isfinite(grad).all() and not grad[~mask].any()
    torch.testing.assert_close(grad, rgrad, atol=1e-8, rtol=1e-5)


@pytest.mark.parametrize(
    "agg,counts",
    [
        ("token-mean", dict(num_tokens=1234)),
        ("token-mean", dict(num_tokens=torch.tensor(517.5))),
        ("seq-mean-token-mean", dict(num_seqs=torch.tensor(9, dtype=torch.int32))),
        ("seq-mean-token-sum-norm", dict(num_seqs=7, norm_length=512)),
        ("row-mean-token-sum-norm", dict(norm_length=4096)),
    ],
)
def test_policy_loss_global_counts_vs_reference(agg, counts):
    lp, old, adv, mask, _ = _policy_inputs()
    loss, _, grad = _loss(policy_loss, lp, old, adv, mask, agg=agg, table=TABLE, **counts)
    rloss, _, rgrad = _loss(ref.policy_loss, lp, old, adv, mask, agg=agg, **counts)
    torch.testing.assert_close(loss, rloss, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(grad, rgrad, atol=1e-9, rtol=1e-5)


def test_policy_loss_bf16_gradient_dtype():
    lp, old, adv, mask, _ = _policy_inputs(dtype=torch.bfloat16)
    loss, _, grad = _loss(policy_loss, lp, old, adv, mask, table=TABLE)
    rloss, _, rgrad = _loss(ref.policy_loss, lp, old, adv, mask)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, rloss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, rgrad)


@pytest.mark.parametrize("agg", AGGS)
def test_empty_mask_gives_zero_loss_and_metrics(agg):
    lp, old, adv, mask, _ = _policy_inputs(b=3, length=20)
    mask[:] = False
    loss, metrics, grad = _loss(policy_loss, lp, old, adv, mask, clip_c=3.0, agg=agg, table=TABLE)
    assert float(loss) == 0 and all(float(v) == 0 for v in metrics.values())
    assert not grad.any()


def test_zero_batch_and_length():
    for b, length in ((0, 7), (3, 0)):
        lp = torch.zeros(b, length)
        loss, _, grad = _loss(policy_loss, lp, lp, torch.zeros(b), lp.bool(), table=TABLE)
        assert float(loss) == 0 and grad.shape == (b, length)


def test_float_mask_equals_bool_mask():
    lp, old, adv, mask, _ = _policy_inputs()
    a = _loss(policy_loss, lp, old, adv, mask, agg="seq-mean-token-mean", table=TABLE)
    b = _loss(policy_loss, lp, old, adv, mask.float(), agg="seq-mean-token-mean", table=TABLE)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


def _all_bits(fn):
    loss, metrics, grad = fn()
    return [loss, grad, *metrics.values()]


@pytest.mark.parametrize("variant", ["dual clip, token TIS, adv[B]", "GSPO, sequence mask IS",
                                     "token mask IS, normalised, rejection"])  # fmt: skip
def test_policy_loss_tuning_invariance_and_determinism(variant):
    lp, old, adv, mask, roll = _policy_inputs(b=7, tis=True)
    configs = tuning.op_configs(TABLE, "policy_loss")
    assert len(configs) >= 2
    kw = dict(VARIANTS[variant], agg="seq-mean-token-mean", rollout_logprobs=roll, table=TABLE)

    def run():
        return _all_bits(lambda: _loss(policy_loss, lp, old, adv, mask, **kw))

    results = []
    for cfg in configs:
        with tuning.force("policy_loss", cfg):
            results.append(run())
    results.append(run())
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


@pytest.mark.parametrize(
    "kw",
    [
        dict(agg="token-sum"),
        dict(agg="seq-mean-token-sum-norm", num_seqs=16, norm_length=1000),
        dict(agg="token-mean", num_tokens=torch.tensor(5000.0), ratio_level="sequence"),
    ],
)
def test_policy_loss_sequence_gradients_do_not_depend_on_other_sequences(kw):
    # With a fixed denominator each sequence's gradient is its own business.
    lp, old, adv, mask, roll = _policy_inputs(b=6, tis=True)
    kw = dict(kw, rollout_logprobs=roll, is_level="sequence", is_max=2.0, table=TABLE)
    _, _, grad = _loss(policy_loss, lp, old, adv, mask, **kw)
    idx = torch.tensor([4, 0, 2])
    kw["rollout_logprobs"] = roll[idx]
    _, _, sub = _loss(policy_loss, lp[idx], old[idx], adv[idx], mask[idx], **kw)
    assert torch.equal(sub, grad[idx])


def test_policy_loss_micro_batches_add_up_to_the_batch():
    lp, old, adv, mask, _ = _policy_inputs(b=6)
    n = int(mask.sum())
    whole, _, grad = _loss(policy_loss, lp, old, adv, mask, table=TABLE)
    parts = [
        _loss(policy_loss, lp[i], old[i], adv[i], mask[i], num_tokens=n, table=TABLE)
        for i in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole, atol=1e-7, rtol=1e-6)
    assert torch.equal(torch.cat([parts[0][2], parts[1][2]]), grad)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp,bias", [(10.0, False), (None, False), (3.0, True)])
def test_kl_penalty_vs_reference(kind, dtype, clamp, bias):
    g = torch.Generator().manual_seed(1)
    ref_lp = torch.randn(3, 300, generator=g)
    lp = (ref_lp + 4 * torch.randn(3, 300, generator=g)).to(dtype)  # k3 hits its clamp
    old = (lp.float() + 0.3 * torch.randn(3, 300, generator=g)).to(dtype) if bias else None
    ref_lp = ref_lp.to(dtype)
    lp[0, 0] = ref_lp[0, 0]  # d = 0 exactly: |d| has gradient 0 there, as in torch
    cot = torch.randn(3, 300, generator=g)
    kw = dict(clamp=clamp, old_logprobs=old)
    x = lp.clone().requires_grad_()
    kl = kl_penalty(x, ref_lp, kind, table=TABLE, **kw)
    (kl * cot).sum().backward()
    xr = lp.clone().requires_grad_()
    rkl = ref.kl_penalty(xr, ref_lp, kind, **kw)
    (rkl * cot).sum().backward()
    assert kl.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(kl, rkl, atol=2e-6, rtol=2e-6)
    # A bf16 gradient may round the other way: one unit of its last place.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=tol)


def test_kl_penalty_tuning_invariance():
    g = torch.Generator().manual_seed(2)
    lp, ref_lp = torch.randn(5, 700, generator=g), torch.randn(5, 700, generator=g)
    old = lp + 0.1 * torch.randn(5, 700, generator=g)
    results = []
    for cfg in tuning.op_configs(TABLE, "kl_penalty"):
        with tuning.force("kl_penalty", cfg):
            x = lp.clone().requires_grad_()
            kl = kl_penalty(x, ref_lp, "k3+", old_logprobs=old, table=TABLE)
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
    adv = grpo_advantages(rewards, size, norm_std=norm_std, eps=1e-6, table=TABLE)
    radv = ref.grpo_advantages(rewards, size, norm_std=norm_std, eps=1e-6)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, radv, atol=2e-6, rtol=2e-6)


def _ids(n_groups, seed):
    """Group ids of unequal, interleaved groups (singletons too) and their rewards."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n_groups, (n_groups * 5,), generator=g) * 7 - 3
    return ids, torch.randn(ids.numel(), generator=g)


@pytest.mark.parametrize(
    "estimator,norm_std",
    [("grpo", "group"), ("grpo", "none"), ("grpo", "batch"), ("rloo", "group"),
     ("reinforce++-baseline", "group"), ("reinforce++", "group")],
)  # fmt: skip
def test_grpo_estimators_vs_reference(estimator, norm_std):
    ids, rewards = _ids(9, 4)
    ids[:3] = 1000  # a group with std 0
    rewards[:3] = 0.5
    kw = dict(norm_std=norm_std, estimator=estimator, eps=1e-6)
    if estimator != "reinforce++":
        kw["group_ids"] = ids
    if estimator.startswith("reinforce++"):
        g = torch.Generator().manual_seed(5)
        kw["mask"] = torch.rand(ids.numel(), 40, generator=g) < 0.5
        kw["mask"][3] = False
    adv = grpo_advantages(rewards, table=TABLE, **kw)
    radv = ref.grpo_advantages(rewards, **kw)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape
    torch.testing.assert_close(adv, radv, atol=2e-6, rtol=2e-6)


def test_grpo_group_ids_equal_contiguous_groups_bitwise():
    g = torch.Generator().manual_seed(6)
    rewards = torch.randn(8 * 70, generator=g)
    ids = torch.arange(8).repeat_interleave(70) * 3 + 11
    for kw in (dict(), dict(norm_std=False), dict(estimator="rloo")):
        by_size = grpo_advantages(rewards, 70, table=TABLE, **kw)
        by_ids = grpo_advantages(rewards, group_ids=ids, table=TABLE, **kw)
        assert torch.equal(by_size, by_ids)


def test_grpo_group_ids_invariance():
    """A group's advantages alone == among other groups, shuffled, whatever its ids' order."""
    ids, rewards = _ids(12, 7)
    full = grpo_advantages(rewards, group_ids=ids, table=TABLE)
    # Shuffle the batch but keep each group's members in their relative order: the contract
    # fixes a group's sums by that order.
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(8))
    for gid in ids.unique():
        perm[(ids[perm] == gid).nonzero()[:, 0]] = (ids == gid).nonzero()[:, 0]
    shuffled = grpo_advantages(rewards[perm], group_ids=ids[perm], table=TABLE)
    assert torch.equal(shuffled, full[perm])
    for gid in ids.unique()[:4]:
        at = (ids == gid).nonzero()[:, 0]
        alone = grpo_advantages(rewards[at], group_ids=ids[at], table=TABLE)
        assert torch.equal(alone, full[at])
    for cfg in tuning.op_configs(TABLE, "grpo_advantages"):
        with tuning.force("grpo_advantages", cfg):
            assert torch.equal(grpo_advantages(rewards, group_ids=ids, table=TABLE), full)


def test_grpo_group_invariance_and_tuning():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(9 * 70, generator=g)
    results = []
    for cfg in tuning.op_configs(TABLE, "grpo_advantages"):
        with tuning.force("grpo_advantages", cfg):
            results.append(grpo_advantages(rewards, 70, table=TABLE))
    assert len(results) >= 2 and all(torch.equal(results[0], r) for r in results[1:])
    sub = grpo_advantages(rewards[140:350], 70, table=TABLE)  # groups 2..4 alone
    assert torch.equal(sub, results[0][140:350])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_policy_loss_has_no_host_sync_and_matches_reference():
    lp, old, adv, mask, roll = _policy_inputs(b=64, length=2048, tis=True)
    lp, old, adv, mask, roll = (t.cuda() for t in (lp, old, adv, mask, roll))
    kw = dict(clip_c=1.5, agg="seq-mean-token-mean", rollout_logprobs=roll, is_max=1.5,
              ratio_level="sequence", reject={"seq_mean_k3": 0.02},
              num_seqs=torch.tensor(60.0, device="cuda"), is_normalize=True)  # fmt: skip
    x = lp.clone().requires_grad_()
    policy_loss(x, old, adv, mask, table=TABLE, **kw)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = policy_loss(x, old, adv, mask, table=TABLE, **kw)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rloss, rmetrics = ref.policy_loss(lp, old, adv, mask, **kw)
    torch.testing.assert_close(loss.cpu(), rloss.cpu(), atol=1e-6, rtol=1e-5)
    for name in rmetrics:
        torch.testing.assert_close(metrics[name].cpu(), rmetrics[name].cpu(), atol=1e-6, rtol=1e-5)
