"""The special-value cases of the conformance kit (rlk.testing.special_values): the reference
agrees with itself, and a backend that hides a NaN, invents one or overflows fails."""

from __future__ import annotations

import functools

import pytest
import torch

import rlk
import rlk_reference as ref
from rlk.testing import bad_inputs
from rlk.testing import special_values as sv
from rlk.testing.case_tools import Gen

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


# Logits whose ``logit / temperature`` overflows fp32 (the dtype every backend scales in) are
# outside the domain: NaN log-probabilities, entropy and gradient for that row, and no token
# (-1), on every backend; the other rows of the batch keep the bits they have alone.

BACKENDS = ("reference", "triton", "ascend")
BAD = [1, 2, 3, 4]  # the rows of sv.overflowing_logits outside the domain
GOOD = [0, 5]


def _ops(backend: str) -> dict:
    """The backend's logprobs, linear_logprobs and sample, called directly (no host checks)."""
    if backend == "reference":
        return {op: getattr(ref, op) for op in ("logprobs", "linear_logprobs", "sample")}
    if backend == "ascend":
        from rlk_ascend import portable

        return {op: getattr(portable, op) for op in ("logprobs", "linear_logprobs", "sample")}
    from rlk_triton import backend as triton_backend
    from rlk_triton import fused_logprobs, logprobs, sampling

    table = triton_backend.default_table()
    return {
        "logprobs": functools.partial(logprobs.logprobs, table=table),
        "linear_logprobs": functools.partial(fused_logprobs.linear_logprobs, table=table),
        "sample": functools.partial(sampling.sample, table=table),
    }


def _overflowing(device=CPU, vocab=40):
    return sv.overflowing_logits(Gen("overflow", device), vocab=vocab).to(torch.bfloat16)


def _check_logprobs(fn, logits, targets):
    """NaN log-prob, entropy and gradient rows where outside the domain; the others as alone."""
    x = logits.detach().requires_grad_()
    lp, ent = fn(x, targets, 1e-3, True)
    assert lp[BAD].isnan().all() and ent[BAD].isnan().all()
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), x)
    assert grad[BAD].isnan().all()
    x_good = logits[GOOD].detach().requires_grad_()
    lp_good, ent_good = fn(x_good, targets[GOOD], 1e-3, True)
    (grad_good,) = torch.autograd.grad(lp_good.sum() + ent_good.sum(), x_good)
    assert torch.isfinite(lp_good).all() and torch.isfinite(grad_good).all()
    assert torch.equal(lp[GOOD], lp_good) and torch.equal(ent[GOOD], ent_good)
    assert torch.equal(grad[GOOD], grad_good)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_of_overflowing_rows_are_nan(backend):
    logits = _overflowing()
    fn = _ops(backend)["logprobs"]
    # Row 1's target is tied with the row's maxima, row 4's is not (and the reverse).
    for targets in ([2, 3, 4, 25, 20, 1], [2, 20, 5, 1, 3, 1]):
        _check_logprobs(fn, logits, torch.tensor(targets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_logprobs_of_overflowing_rows_are_nan(backend):
    g = Gen("overflow/linear", CPU)
    hidden, weight = g.randn(6, 16), g.randn(40, 16)
    hidden[BAD, 0] = 1e36  # logits of about 1e36 (finite in fp32): 1e39 at temperature 1e-3
    targets = torch.tensor([2, 3, 4, 25, 20, 1])
    fn = _ops(backend)["linear_logprobs"]
    lp, ent = fn(hidden, weight, targets, None, 1e-3, True, torch.float32)
    assert lp[BAD].isnan().all() and ent[BAD].isnan().all()
    lp_good, ent_good = fn(hidden[GOOD], weight, targets[GOOD], None, 1e-3, True, torch.float32)
    assert torch.isfinite(lp_good).all()
    assert torch.equal(lp[GOOD], lp_good) and torch.equal(ent[GOOD], ent_good)


def _sample_args(b, device=CPU, filters=True):
    temperature = torch.full((b,), 1e-3, device=device)
    temperature[0] = 0.0  # greedy: nothing is divided, the first maximum is drawn
    kw = {"temperature": temperature, "top_k": None, "top_p": None}
    if filters:
        kw["top_k"] = torch.full((b,), 5, dtype=torch.int64, device=device)
        kw["top_p"] = torch.full((b,), 0.9, device=device)
    seeds = torch.arange(b, device=device)
    return seeds, torch.zeros_like(seeds), kw


def _rows(kw, rows):
    return {n: None if v is None else v[rows] for n, v in kw.items()}


def _check_sample(fn, logits, filters):
    """-1 where outside the domain, the greedy row its first maximum, the others as alone."""
    logits = logits.clone()
    logits[0, 1:3] = 3e38
    seeds, offsets, kw = _sample_args(logits.shape[0], logits.device, filters)
    got = fn(logits, seeds, offsets, **kw)
    assert got[BAD].tolist() == [-1] * len(BAD) and got[0] == 1
    alone = fn(logits[GOOD], seeds[GOOD], offsets[GOOD], **_rows(kw, GOOD))
    assert torch.equal(got[GOOD], alone)


@pytest.mark.parametrize("filters", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_of_overflowing_rows_draws_no_token(backend, filters):
    # 1100 logits: three vocabulary blocks, the Triton split threshold and pick on CPU.
    _check_sample(_ops(backend)["sample"], _overflowing(vocab=1100), filters)


def test_triton_sample_of_overflowing_rows_on_every_path():
    # The one-program kernel and the split threshold and pick, with and without the candidate
    # step (top-k), give the reference's tokens.
    from rlk_triton import backend as triton_backend
    from rlk_triton import sampling, tuning

    table = triton_backend.default_table()
    logits = _overflowing(vocab=1100)
    seeds, offsets, kw = _sample_args(6)
    want = ref.sample(logits, seeds, offsets, **kw)
    for cfg in table["sample.fwd"].configs[:2]:  # programs 528 (split) and 0 (one program)
        with tuning.force("sample", {"sample.fwd": cfg}):
            for top_k in (kw["top_k"], None):
                args = dict(kw, top_k=top_k)
                got = sampling.sample(logits, seeds, offsets, **args, table=table)
                assert torch.equal(got, ref.sample(logits, seeds, offsets, **args))
                assert got[BAD].tolist() == [-1] * len(BAD)
    assert want[BAD].tolist() == [-1] * len(BAD)


def test_rlk_sample_rejects_overflowing_rows_where_value_checks_run():
    logits = _overflowing()
    seeds = torch.arange(6)
    with pytest.raises(ValueError, match=r"logits / temperature overflows float32 in rows \[1, 2"):
        rlk.sample(logits, seeds, torch.zeros_like(seeds), temperature=1e-3)
    # Greedy divides nothing; at temperature 1 nothing overflows.
    assert rlk.sample(logits, seeds, torch.zeros_like(seeds), temperature=0.0)[1] == 0
    assert (rlk.sample(logits, seeds, torch.zeros_like(seeds), temperature=1.0) >= 0).all()
    with bad_inputs.default_mode():
        out = rlk.sample(logits, seeds, torch.zeros_like(seeds), temperature=1e-3)
    assert out[BAD].tolist() == [-1] * len(BAD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_overflowing_rows_are_nan_and_draw_no_token():
    # The Triton kernels on the GPU (every sampling config), a real vocabulary, and the public
    # ops in default mode (no host read): the same outcomes.
    from rlk_triton import backend as triton_backend
    from rlk_triton import tuning

    ops = _ops("triton")
    dev = torch.device("cuda")
    logits = _overflowing(dev, vocab=151936)
    targets = torch.tensor([2, 3, 4, 25, 20, 1], device=dev)
    _check_logprobs(ops["logprobs"], logits, targets)
    for filters in (False, True):
        for cfg in tuning.op_configs(triton_backend.default_table(), "sample"):
            with tuning.force("sample", cfg):
                _check_sample(ops["sample"], logits, filters)
    with bad_inputs.default_mode():
        lp = rlk.logprobs(logits, targets, temperature=1e-3)
        seeds, offsets, kw = _sample_args(6, dev)
        tok = rlk.sample(logits, seeds, offsets, **kw)
    assert lp[BAD].isnan().all() and torch.isfinite(lp[GOOD]).all()
    assert tok[BAD].tolist() == [-1] * len(BAD)
