"""The special-value cases of the conformance kit (rlk.testing.special_values): the reference
agrees with itself, and a backend that hides a NaN, invents one or overflows fails."""

from __future__ import annotations

import pytest
import torch

import rlk_reference as ref
from rlk.testing import special_values as sv

CPU = torch.device("cpu")


@pytest.mark.parametrize("op", list(sv.BUILDERS))
def test_reference_agrees_with_itself(op):
    assert sv.cases(op, CPU)
    assert sv.check(getattr(ref, op), getattr(ref, op), op, CPU) == []


def test_a_hidden_nan_fails():
    def hiding(*args, **kwargs):  # the old Triton k3: the clamp returned -10 for NaN
        return ref.kl_penalty(*args, **kwargs).nan_to_num(-10.0)

    failures = sv.check(hiding, ref.kl_penalty, "kl_penalty", CPU)
    assert any("NaN" in f for f in failures)


def test_an_invented_nan_fails():
    def inventing(logits, *args, **kwargs):  # exp(inf - inf) in the log-sum-exp
        lp, ent = ref.logprobs(logits, *args, **kwargs)
        return lp.where(logits.isinf().any(-1).logical_not(), float("nan")), ent

    failures = sv.check(inventing, ref.logprobs, "logprobs", CPU)
    assert any("NaN where the reference has none" in f for f in failures)


def test_an_fp32_overflow_fails():
    def naive(x, weight, eps=1e-6, residual=None, *, table=None):  # squares in fp32
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight).to(x.dtype)

    failures = sv.check(naive, ref.rms_norm, "rms_norm", CPU)
    assert any("finite values" in f for f in failures)


def test_sample_must_give_minus_one_for_nan_rows():
    def arbitrary(logits, *args, **kwargs):
        return ref.sample(logits.nan_to_num(0.0), *args, **kwargs)

    assert sv.check(arbitrary, ref.sample, "sample", CPU)
