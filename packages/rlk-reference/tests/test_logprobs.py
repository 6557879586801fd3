import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import rlk_reference as ref


def _independent(logits, targets, temperature):
    logp = F.log_softmax(logits.double() / temperature, dim=-1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_matches_log_softmax(dtype, temperature):
    torch.manual_seed(0)
    logits = (torch.randn(9, 301, dtype=torch.float64) * 4).to(dtype)
    targets = torch.randint(0, 301, (9,))
    lp, ent = ref.logprobs(logits, targets, temperature, True)
    out = torch.float64 if dtype == torch.float64 else torch.float32
    assert lp.dtype == ent.dtype == out and lp.shape == ent.shape == (9,)
    want_lp, want_ent = _independent(logits, targets, temperature)
    torch.testing.assert_close(lp, want_lp.to(out), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent.to(out), rtol=1e-12, atol=1e-12)
    alone = ref.logprobs(logits, targets, temperature, False)
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, lp)


def test_logprobs_gradcheck():
    torch.manual_seed(1)
    logits = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3])
    assert gradcheck(lambda x: ref.logprobs(x, targets, 0.8, True), (logits,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_logprobs_equals_unfused(dtype, with_bias):
    torch.manual_seed(2)
    h, w = torch.randn(6, 32).to(dtype), torch.randn(97, 32).to(dtype)
    b = torch.randn(97).to(dtype) if with_bias else None
    t = torch.randint(0, 97, (6,))
    fused = ref.linear_logprobs(h, w, t, b, 0.9, True, None)
    unfused = ref.logprobs(ref.linear(h, w, b), t, 0.9, True)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    # logits_dtype: the logits are rounded to it, whatever hidden's dtype.
    fused32 = ref.linear_logprobs(h, w, t, b, 0.9, False, torch.float32)
    unfused32 = ref.logprobs(
        ref.linear(h.float(), w.float(), None if b is None else b.float()), t, 0.9, False
    )
    assert torch.equal(fused32, unfused32)


def test_linear_logprobs_float64_is_exact():
    torch.manual_seed(3)
    h, w, t = torch.randn(4, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64), \
        torch.randint(0, 50, (4,))  # fmt: skip
    lp = ref.linear_logprobs(h, w, t, None, 1.0, False, torch.bfloat16)  # no rounding for fp64
    assert lp.dtype == torch.float64
    want, _ = _independent(h @ w.T, t, 1.0)
    torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-12)


def test_linear_logprobs_gradcheck():
    torch.manual_seed(4)
    h = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 10, 4])
    fn = lambda h, w, b: ref.linear_logprobs(h, w, t, b, 1.3, True, None)  # noqa: E731
    assert gradcheck(fn, (h, w, b))


def test_large_vocab_runs_quickly():
    torch.manual_seed(5)
    logits = torch.randn(64, 32000, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 32000, (64,))
    start = time.perf_counter()
    lp, ent = ref.logprobs(logits, t, 1.0, True)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None and torch.isfinite(lp).all()
    assert time.perf_counter() - start < 20


def test_logprobs_of_huge_finite_scaled_logits_are_exact():
    # Ten equal maxima of 3e35 at temperature 1e-3: z = logit / T is 3e38, still finite in fp32,
    # and the log-probability of each maximum is exactly log(1/10) (no cancellation).
    logits = torch.full((1, 12), -1.0).to(torch.bfloat16)
    logits[0, :10] = 3e35
    lp = ref.logprobs(logits, torch.tensor([3]), temperature=1e-3)
    assert math.isclose(lp.item(), math.log(0.1), rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_logits_whose_fp32_scaling_overflows_are_outside_the_domain(dtype):
    # Ten equal maxima near bf16's largest value at temperature 1e-3: z = 3e41 overflows fp32,
    # as the kernels scale. That row (target tied with the maxima or not) and the row with a
    # logit of -3e38 (z = -inf) give NaN log-probs, entropy and gradient; the others are as
    # alone. float64 logits too: the check is in float32.
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(6)).to(dtype)
    logits[1, :10] = 3e38
    logits[2, 4] = -3e38
    logits.requires_grad_()
    targets = torch.tensor([3, 3, 0, 11])
    for t in (targets, torch.tensor([3, 11, 0, 11])):
        lp, ent = ref.logprobs(logits, t, temperature=1e-3, return_entropy=True)
        assert lp[1:3].isnan().all() and ent[1:3].isnan().all()
        (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
        assert grad[1:3].isnan().all() and not grad[[0, 3]].isnan().any()
        alone = ref.logprobs(logits[[0, 3]], t[[0, 3]], temperature=1e-3)
        assert torch.equal(lp[[0, 3]], alone)
    # At temperature 1 nothing overflows: the exact values.
    assert ref.logprobs(logits, targets)[1].item() == pytest.approx(math.log(0.1), rel=1e-6)


def test_linear_logprobs_whose_fp32_scaling_overflows_give_nan():
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    w = torch.randn(20, 8, generator=torch.Generator().manual_seed(8))
    h[1, 0] = 1e36  # logits of about 1e36 (finite in fp32), 1e39 at temperature 1e-3
    lp = ref.linear_logprobs(h, w, torch.tensor([1, 2, 3]), None, 1e-3, False, None)
    assert lp[1].isnan() and not lp[[0, 2]].isnan().any()
