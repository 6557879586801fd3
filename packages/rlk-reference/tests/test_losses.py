import math

import pytest
import torch
from torch.autograd import gradcheck

import rlk_reference as ref

AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


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
# r=0.5 -> max(-0.5, -0.8) = -0.5. Seq 1, A=-2: r=1.1 -> 2.2. Sum 0.5 over 3 tokens.
EXPECTED = {
    "token-mean": 0.5 / 3,
    "seq-mean-token-sum": (-1.7 + 2.2) / 2,
    "seq-mean-token-mean": (-0.85 + 2.2) / 2,
    "seq-mean-token-sum-norm": 0.5 / 4,
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
        "seq-mean-token-sum": (1 / 2, 1 / 2),
        "seq-mean-token-mean": (1 / 4, 1 / 2),
        "seq-mean-token-sum-norm": (1 / 4, 1 / 4),
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
    loss, _ = ref.policy_loss(new, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0)
    assert math.isclose(plain.item(), (-1.0 - 1.1 - 0.5) / 3, rel_tol=1e-12)
    assert math.isclose(loss.item(), (-0.5 - 2.2 - 0.5) / 3, rel_tol=1e-12)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_policy_loss_empty_mask(agg, clip_c):
    new = torch.randn(2, 3, dtype=torch.float32, requires_grad=True)
    old, adv = torch.randn(2, 3), torch.randn(2)
    mask = torch.zeros(2, 3)
    loss, m = ref.policy_loss(new, old, adv, mask, agg=agg, clip_c=clip_c,
                              rollout_logprobs=torch.randn(2, 3), tis_cap=2.0)  # fmt: skip
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
                               rollout_logprobs=rollout, tis_cap=1.5)[0]  # fmt: skip

    assert gradcheck(fn, (new,))
    fn(new).backward()
    assert old.grad is None and adv.grad is None and rollout.grad is None


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
