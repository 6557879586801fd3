import math

import pytest
import torch
from torch.autograd import gradcheck

import rlk_reference as ref
from rlk.ops import AGG_MODES

AGGS = AGG_MODES


def _tiny():
    """3 sequences of L = 4; the last has no response tokens. Padding holds garbage."""
    ratios = torch.tensor([[1.5, 0.5, 1.0, 1.0], [1.1, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]],
                          dtype=torch.float64)  # fmt: skip
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    old = torch.full((3, 4), -2.0, dtype=torch.float64)
    new = old + ratios.log()
    new[~mask] = 1e4  # must not leak into the loss, metrics or gradient
    old[~mask] = -1e4
    adv = torch.tensor([1.0, -2.0, 5.0], dtype=torch.float64)
    return new, old, adv, mask


# Per token (clip 0.2): seq 0, A=1: r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped);
# r=0.5 -> max(-0.5, -0.8) = -0.5. Seq 1, A=-2: r=1.1 -> 2.2. Sum 0.5 over 3 tokens; 2 of the 3
# rows have tokens; L = 4.
EXPECTED = {
    "token-mean": 0.5 / 3,
    "token-sum": 0.5,
    "seq-mean-token-sum": (-1.7 + 2.2) / 2,
    "seq-mean-token-mean": (-0.85 + 2.2) / 2,
    "seq-mean-token-sum-norm": 0.5 / (2 * 4),
    "row-mean-token-mean": (-0.85 + 2.2) / 3,
    "row-mean-token-sum-norm": 0.5 / (3 * 4),
}


@pytest.mark.parametrize("agg", AGGS)
def test_policy_loss_hand_example(agg):
    new, old, adv, mask = _tiny()
    new.requires_grad_()
    loss, m = ref.policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, agg=agg)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    assert math.isclose(loss.item(), EXPECTED[agg], rel_tol=1e-12)
    assert set(m) == {"clip_fraction", "approx_kl", "ratio_mean", "ratio_max"}
    assert math.isclose(m["clip_fraction"].item(), 1 / 3, rel_tol=1e-12)
    assert math.isclose(m["ratio_mean"].item(), (1.5 + 0.5 + 1.1) / 3, rel_tol=1e-12)
    assert math.isclose(m["ratio_max"].item(), 1.5, rel_tol=1e-12)
    kl = -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3
    assert math.isclose(m["approx_kl"].item(), kl, rel_tol=1e-12)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    loss.backward()
    g = new.grad
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    # Clipped token: no gradient. Unclipped ones: d(-A r)/d logp = -A r, scaled by the aggregation.
    assert g[0, 0] == 0
    scale = {
        "token-mean": (1 / 3, 1 / 3),
        "token-sum": (1, 1),
        "seq-mean-token-sum": (1 / 2, 1 / 2),
        "seq-mean-token-mean": (1 / 4, 1 / 2),
        "seq-mean-token-sum-norm": (1 / 8, 1 / 8),
        "row-mean-token-mean": (1 / 6, 1 / 3),
        "row-mean-token-sum-norm": (1 / 12, 1 / 12),
    }[agg]
    assert math.isclose(g[0, 1].item(), -0.5 * scale[0], rel_tol=1e-12)
    assert math.isclose(g[1, 0].item(), 2.2 * scale[1], rel_tol=1e-12)


def test_policy_loss_dual_clip():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[5.0, 1.1, 0.5]], dtype=torch.float64).log()
    adv = torch.tensor([[-2.0, -2.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    plain, m0 = ref.policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss, m = ref.policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    # Token 0: max(10, 2.4) = 10, bounded by -A * c = 6. Token 1: 2.2. Token 2: max(-0.5, -0.8).
    assert math.isclose(plain.item(), (10 + 2.2 - 0.5) / 3, rel_tol=1e-12)
    assert math.isclose(loss.item(), (6 + 2.2 - 0.5) / 3, rel_tol=1e-12)
    assert "dual_clip_fraction" not in m0
    assert math.isclose(m["dual_clip_fraction"].item(), 1 / 3, rel_tol=1e-12)
    assert m["clip_fraction"].item() == 0.0


def test_policy_loss_truncated_importance_sampling():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[1.0, 1.1, 0.5]], dtype=torch.float64).log()
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    rollout = -torch.tensor([[0.5, 4.0, 1.0]], dtype=torch.float64).log()  # IS weights 0.5, 4, 1
    plain, _ = ref.policy_loss(new, old, adv, mask)
    loss, m = ref.policy_loss(new, old, adv, mask, rollout_logprobs=rollout, is_max=2.0)
    assert math.isclose(plain.item(), (-1.0 - 1.1 - 0.5) / 3, rel_tol=1e-12)
    assert math.isclose(loss.item(), (-0.5 - 2.2 - 0.5) / 3, rel_tol=1e-12)
    assert math.isclose(m["is_weight_mean"].item(), (0.5 + 2 + 1) / 3, rel_tol=1e-12)


def test_policy_loss_unbounded_importance_weights():
    """``rollout_logprobs`` without ``is_min``/``is_max``: the weights apply unclipped."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[1.0, 1.1, 0.5]], dtype=torch.float64).log()
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    rollout = -torch.tensor([[0.5, 4.0, 1.0]], dtype=torch.float64).log()  # IS weights 0.5, 4, 1
    for mode in ("truncate", "mask"):
        loss, m = ref.policy_loss(new, old, adv, mask, rollout_logprobs=rollout, is_mode=mode)
        assert math.isclose(loss.item(), (-0.5 - 4.4 - 0.5) / 3, rel_tol=1e-12)
        assert math.isclose(m["is_weight_mean"].item(), (0.5 + 4 + 1) / 3, rel_tol=1e-12)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_policy_loss_empty_mask(agg, clip_c):
    new = torch.randn(2, 3, dtype=torch.float32, requires_grad=True)
    old, adv = torch.randn(2, 3), torch.randn(2)
    mask = torch.zeros(2, 3)
    loss, m = ref.policy_loss(new, old, adv, mask, agg=agg, clip_c=clip_c,
                              rollout_logprobs=torch.randn(2, 3), is_max=2.0)  # fmt: skip
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    assert all(v.item() == 0.0 and v.dtype == torch.float32 for v in m.values())
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(2, 3))


def test_policy_loss_mask_and_advantage_forms_agree():
    torch.manual_seed(0)
    new, old = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    adv = torch.randn(3, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.4
    a = ref.policy_loss(new, old, adv, mask, agg="seq-mean-token-mean")
    b = ref.policy_loss(new, old, adv[:, None].expand(3, 5).contiguous(), mask.double(),
                        agg="seq-mean-token-mean")  # fmt: skip
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_policy_loss_low_precision_gives_float32(dtype):
    new, old = torch.randn(2, 4).to(dtype), torch.randn(2, 4).to(dtype)
    loss, m = ref.policy_loss(new, old, torch.randn(2).to(dtype), torch.ones(2, 4))
    assert loss.dtype == torch.float32 and all(v.dtype == torch.float32 for v in m.values())


@pytest.mark.parametrize("agg", AGGS)
def test_policy_loss_gradcheck_and_only_logprobs_get_gradient(agg):
    torch.manual_seed(1)
    new = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.randn(3, dtype=torch.float64, requires_grad=True)
    rollout = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 4) > 0.3

    def fn(x):
        return ref.policy_loss(x, old, adv, mask, agg=agg, clip_c=3.0,
                               rollout_logprobs=rollout, is_max=1.5)[0]  # fmt: skip

    assert gradcheck(fn, (new,))
    fn(new).backward()
    assert old.grad is None and adv.grad is None and rollout.grad is None


def test_policy_loss_sequence_ratio_gspo():
    new, old, adv, mask = _tiny()
    new.requires_grad_()
    loss, m = ref.policy_loss(new, old, adv, mask, ratio_level="sequence")
    # Seq 0: s = exp(mean(log 1.5, log 0.5)) = sqrt(0.75), inside the clip range, A = 1.
    # Seq 1: s = 1.1, A = -2: 2.2 on its one token.
    s0 = math.sqrt(0.75)
    assert math.isclose(loss.item(), (-2 * s0 + 2.2) / 3, rel_tol=1e-12)
    assert math.isclose(m["ratio_mean"].item(), (2 * s0 + 1.1) / 3, rel_tol=1e-12)
    loss.backward()
    # Each token gets the sequence ratio's gradient: d(-A s) = -A s per token, / 3 tokens.
    assert torch.allclose(new.grad[0, :2], torch.full((2,), -s0 / 3, dtype=torch.float64))
    assert math.isclose(new.grad[1, 0].item(), 2.2 / 3, rel_tol=1e-12)
    assert (new.grad[~mask] == 0).all()


def _is_case():
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[1.0, 1.1, 0.5], [1.0, 1.0, 1.0]], dtype=torch.float64).log()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    # Weights exp(old - rollout): seq 0 per token 0.5, 4, 1 (product 2); seq 1: 2, 2 (product 4).
    rollout = -torch.tensor([[0.5, 4.0, 1.0], [2.0, 2.0, 7.0]], dtype=torch.float64).log()
    return new, old, adv, mask, rollout


def test_policy_loss_importance_sampling_levels_and_modes():
    new, old, adv, mask, rollout = _is_case()
    pg = [[-1.0, -1.1, -0.5], [1.0, 1.0]]  # no clipping here

    def loss(**kw):
        return ref.policy_loss(new, old, adv, mask, rollout_logprobs=rollout, **kw)

    tok_mask, m = loss(is_mode="mask", is_min=0.6, is_max=3.0)  # 0.5 and 4 fall out
    assert math.isclose(tok_mask.item(), (pg[0][2] * 1 + 2 * 2) / 5, rel_tol=1e-12)
    assert math.isclose(m["is_weight_mean"].item(), (0 + 0 + 1 + 2 + 2) / 5, rel_tol=1e-12)
    seq_trunc, m = loss(is_level="sequence", is_max=3.0)  # seq 0: 2; seq 1: 4 -> 3
    assert math.isclose(seq_trunc.item(), (sum(pg[0]) * 2 + 2 * 3) / 5, rel_tol=1e-12)
    assert math.isclose(m["is_weight_mean"].item(), (2 + 3) / 2, rel_tol=1e-12)
    seq_mask, _ = loss(is_level="sequence", is_mode="mask", is_max=3.0)  # seq 1 weighs 0
    assert math.isclose(seq_mask.item(), sum(pg[0]) * 2 / 5, rel_tol=1e-12)
    lower, _ = loss(is_level="sequence", is_min=3.0)  # truncation from below: seq 0 -> 3
    assert math.isclose(lower.item(), (sum(pg[0]) * 3 + 2 * 4) / 5, rel_tol=1e-12)
    norm, m = loss(is_max=2.0, is_normalize=True)  # weights 0.5, 2, 1, 2, 2: mean 1.5
    plain, _ = loss(is_max=2.0)
    assert math.isclose(norm.item(), plain.item() / 1.5, rel_tol=1e-12)
    given, _ = loss(is_max=2.0, is_normalize=3.0)
    assert math.isclose(given.item(), plain.item() / 3.0, rel_tol=1e-12)


def test_policy_loss_rejection_removes_tokens_and_sequences():
    new, old, adv, mask, rollout = _is_case()
    full, _ = ref.policy_loss(new, old, adv, mask)
    # token_k1 keeps 1/3 <= rho <= 3 (rho = exp(old - rollout)): the token with rho = 4 goes.
    kw = dict(rollout_logprobs=rollout, is_level=None)  # rejection only, no weights
    loss, m = ref.policy_loss(new, old, adv, mask, reject={"token_k1": (1 / 3, 3.0)}, **kw)
    assert math.isclose(loss.item(), (-1.0 - 0.5 + 2.0) / 4, rel_tol=1e-12)
    assert math.isclose(m["reject_fraction"].item(), 1 / 5, rel_tol=1e-12)
    # seq_sum_k1 with one bound u keeps 1/u <= prod rho <= u: u = 3 drops seq 1 (prod 4).
    loss, m = ref.policy_loss(
        new, old, adv, mask, reject={"seq_sum_k1": 3.0}, agg="seq-mean-token-sum", **kw
    )
    assert math.isclose(loss.item(), -2.6, rel_tol=1e-12)
    assert math.isclose(m["reject_fraction"].item(), 2 / 5, rel_tol=1e-12)
    # seq_max_k2 <= 0.5 * log(2)^2 keeps seq 1 (both tokens log 2) but not seq 0 (log 4 there).
    thr = 0.5 * math.log(2) ** 2 + 1e-9
    loss, _ = ref.policy_loss(new, old, adv, mask, reject={"seq_max_k2": thr}, **kw)
    assert math.isclose(loss.item(), 1.0, rel_tol=1e-12)
    assert math.isclose(full.item(), (-2.6 + 2.0) / 5, rel_tol=1e-12)


def test_policy_loss_global_counts():
    new, old, adv, mask = _tiny()
    loss, _ = ref.policy_loss(new, old, adv, mask, num_tokens=6)
    assert math.isclose(loss.item(), 0.5 / 6, rel_tol=1e-12)
    loss, _ = ref.policy_loss(new, old, adv, mask, agg="seq-mean-token-mean", num_seqs=5)
    assert math.isclose(loss.item(), (-0.85 + 2.2) / 5, rel_tol=1e-12)
    loss, _ = ref.policy_loss(new, old, adv, mask, agg="row-mean-token-sum-norm",
                              num_seqs=torch.tensor(8), norm_length=10)  # fmt: skip
    assert math.isclose(loss.item(), 0.5 / 80, rel_tol=1e-12)
    # Micro-batches with the whole batch's counts add up to the whole batch's loss.
    whole, _ = ref.policy_loss(new, old, adv, mask, agg="seq-mean-token-sum")
    parts = [
        ref.policy_loss(new[i], old[i], adv[i], mask[i], agg="seq-mean-token-sum", num_seqs=2)[0]
        for i in (slice(0, 1), slice(1, 3))
    ]
    assert math.isclose(sum(p.item() for p in parts), whole.item(), rel_tol=1e-12)


def test_kl_penalty_kinds():
    new = torch.tensor([[0.0, -1.0, 2.0, -20.0, 20.0]], dtype=torch.float64)
    ref_lp = torch.zeros_like(new)
    d = new[0].tolist()
    k3 = [min(max(math.exp(-x) + x - 1, -10.0), 10.0) for x in d]
    expect = {"k1": d, "abs": [abs(x) for x in d], "k2": [x * x / 2 for x in d], "k3": k3}
    for kind, want in expect.items():
        got = ref.kl_penalty(new, ref_lp, kind)
        assert got.dtype == torch.float64 and got.shape == (1, 5)
        torch.testing.assert_close(got[0], torch.tensor(want, dtype=torch.float64))
    assert ref.kl_penalty(new.bfloat16(), ref_lp.bfloat16(), "k3").dtype == torch.float32


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_penalty_gradcheck(kind):
    torch.manual_seed(2)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 3, dtype=torch.float64)
    assert gradcheck(lambda x: ref.kl_penalty(x, r, kind), (x,))


def test_kl_penalty_straight_through_and_clamp():
    x = torch.tensor([[0.3, -1.0, 2.0, -20.0]], dtype=torch.float64, requires_grad=True)
    r = torch.zeros_like(x)
    for kind in ("k1", "k3", "abs"):
        plus = ref.kl_penalty(x, r, kind + "+")
        assert torch.equal(plus, ref.kl_penalty(x, r, kind))
        (g,) = torch.autograd.grad(plus.sum(), x)
        assert torch.equal(g, x.detach())  # the gradient of k2 = d^2 / 2
    k3 = ref.kl_penalty(x, r, "k3", clamp=None)
    assert math.isclose(k3[0, 3].item(), math.exp(20) - 21, rel_tol=1e-12)
    assert ref.kl_penalty(x, r, "k3", clamp=5.0)[0, 3].item() == 5.0


def test_kl_penalty_bias_correction():
    torch.manual_seed(3)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    r, old = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    got = ref.kl_penalty(x, r, "k3", old_logprobs=old)
    want = ref.kl_penalty(x, r, "k3") * torch.exp(x - old)
    torch.testing.assert_close(got, want)
    assert gradcheck(lambda x: ref.kl_penalty(x, r, "k3", old_logprobs=old), (x,))
    # Straight through with the ratio: d(kl * w) = (d + kl) * w, where d is k2's gradient.
    (g,) = torch.autograd.grad(ref.kl_penalty(x, r, "k3+", old_logprobs=old).sum(), x)
    d = (x - r).detach()
    torch.testing.assert_close(
        g, (d + ref.kl_penalty(d, 0 * d, "k3")) * torch.exp(x - old).detach()
    )


def test_grpo_advantages_tiny():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    adv = ref.grpo_advantages(r, 4, norm_std=True, eps=0.0)
    s = math.sqrt(1 / 3)  # group 1: mean 0.5, unbiased variance 4 * 0.25 / 3
    want = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.5, 0.5, 0.5, -1.5]  # group 2: std 0.5
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))
    centred = ref.grpo_advantages(r.float(), 4, norm_std=False, eps=1e-6)
    assert centred.dtype == torch.float32
    torch.testing.assert_close(
        centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    )
    # A constant group has std 0: eps keeps it finite (zero advantage).
    flat = ref.grpo_advantages(torch.ones(4), 4, eps=1e-6)
    assert torch.equal(flat, torch.zeros(4))


def test_grpo_advantages_gradcheck():
    r = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda r: ref.grpo_advantages(r, 3, norm_std=True, eps=1e-6), (r,))


def test_grpo_advantages_group_ids():
    ids = torch.tensor([5, 7, 5, 9, 7, 5])
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 5.0], dtype=torch.float64)
    # Group 5: 1, 3, 5 (mean 3, std 2); group 7: 2, 6 (mean 4, std 2 sqrt 2); 9 alone: 4 / 1.
    adv = ref.grpo_advantages(r, group_ids=ids, eps=0.0)
    h = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-1, -h, 0, 4, h, 1], dtype=torch.float64))
    rloo = ref.grpo_advantages(r, group_ids=ids, estimator="rloo")
    torch.testing.assert_close(rloo, torch.tensor([-3.0, -4, 0, 4, 4, 3], dtype=torch.float64))
    batch = ref.grpo_advantages(r, group_ids=ids, norm_std="batch", eps=0.0)
    centred = torch.tensor([-2.0, -2, 0, 4, 2, 2], dtype=torch.float64)
    torch.testing.assert_close(batch, centred / r.std())
    # Contiguous groups by id == by size.
    r8 = torch.randn(8, dtype=torch.float64)
    ids8 = torch.tensor([3, 3, 3, 3, 0, 0, 0, 0])
    torch.testing.assert_close(ref.grpo_advantages(r8, 4), ref.grpo_advantages(r8, group_ids=ids8))


def test_reinforce_plus_plus_whitens_over_tokens():
    ids = torch.tensor([0, 0, 1])
    r = torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    v = torch.tensor([-1.0, 1.0, 5.0], dtype=torch.float64)  # minus the group mean; alone: r
    w = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)  # token counts
    mu = (w * v).sum() / 6
    var = (w * (v - mu) ** 2).sum() / 5
    got = ref.grpo_advantages(r, group_ids=ids, estimator="reinforce++-baseline", mask=mask)
    torch.testing.assert_close(got, (v - mu) / torch.sqrt(var + 1e-8))
    got = ref.grpo_advantages(r, estimator="reinforce++", mask=mask)
    mu = (w * r).sum() / 6
    var = (w * (r - mu) ** 2).sum() / 5
    torch.testing.assert_close(got, (r - mu) / torch.sqrt(var + 1e-8))


@pytest.mark.parametrize("bad", [0.5, float("nan"), 2.0, -1.0])
def test_policy_loss_mask_value_not_0_or_1_gives_nan(bad):
    # Reachable with the value checks off (a GPU without RLK_VALIDATE): the loss is NaN (and
    # the gradient has NaN), never a loss computed as if the value were 1.
    new = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    old, adv = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    good, _ = ref.policy_loss(new, old, adv, mask)
    assert good.isfinite()
    mask[0, 1] = bad
    loss, _ = ref.policy_loss(new, old, adv, mask)
    loss.backward()
    assert loss.isnan() and new.grad.isnan().any()


@pytest.mark.parametrize("bad", [0.5, float("nan")])
def test_reinforce_plus_plus_mask_value_not_0_or_1_gives_nan(bad):
    # Reachable with the value checks off: every advantage is NaN, never whitened as if 1.
    rewards = torch.randn(3, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    assert ref.grpo_advantages(rewards, estimator="reinforce++", mask=mask).isfinite().all()
    mask[2, 1] = bad
    assert ref.grpo_advantages(rewards, estimator="reinforce++", mask=mask).isnan().all()
