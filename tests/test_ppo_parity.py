"""GAE and the clipped value loss against verl 0.9.1's formulas (``compute_gae_advantage_return``
with ``masked_whiten``, ``compute_value_loss`` with ``agg_loss``), written out here in plain
PyTorch independently of rlk's code, on random inputs with holes in the response mask.

verl computes in fp32 (a reverse loop over the tokens, torch reductions): its formula runs
here in fp32 against rlk's fp32 backends (triton, through ``rlk``'s public functions, and the
portable PyTorch of rlk-ascend), and in float64 against the float64 reference, so that the
comparison measures the formula rather than fp32 rounding. Every result must be within 1e-6
(relative to values above 1: a return sums up to L rewards) of verl's."""

from __future__ import annotations

import pytest
import torch

import rlk
from rlk_ascend import portable_ppo
from rlk_reference import _ppo as ref

#: The bound of the issue's acceptance: rlk's results against verl's own formula.
TOL = 1e-6
#: The implementations, each with ``gae_advantages`` and ``value_loss``: the float64 oracle,
#: the public functions (the selected backend: triton on a CPU or GPU) and rlk-ascend's code.
IMPLS = {"reference": ref, "rlk": rlk, "portable": portable_ppo}


def _verl_masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def _verl_gae(rewards, values, mask, gamma, lam):
    """verl's loop, in the dtype of ``rewards``; ``mask`` as a float of that dtype, as verl's
    ``response_mask`` multiplies the values."""
    m = mask.to(rewards.dtype)
    r, v = rewards, values
    nextvalues, lastgaelam, out = 0, 0, []
    for t in reversed(range(r.shape[-1])):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        new = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = new * m[:, t] + (1 - m[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + v
    mean = _verl_masked_mean(adv, m)
    var = _verl_masked_mean((adv - mean) ** 2, m) * (m.sum() / (m.sum() - 1))
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


def _verl_agg(mat, m, mode):
    if mode == "token-mean":
        return (mat * m).sum() / m.sum()
    if mode == "token-sum":
        return (mat * m).sum()
    seq_tokens = m.sum(-1)
    seq_mask = (seq_tokens > 0).to(mat.dtype)
    if mode == "seq-mean-token-mean":
        seq = (mat * m).sum(-1) / (seq_tokens + 1e-8)
        return (seq * seq_mask).sum() / seq_mask.sum()
    seq = (mat * m).sum(-1)
    loss = (seq * seq_mask).sum() / seq_mask.sum()
    return loss / m.shape[-1] if mode == "seq-mean-token-sum-norm" else loss


def _verl_value_loss(vpreds, returns, values, mask, cliprange, mode):
    m = mask.to(vpreds.dtype)
    clipped = torch.max(torch.min(vpreds, values + cliprange), values - cliprange)
    l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    frac = _verl_masked_mean((l2 > l1).to(vpreds.dtype), m)
    return 0.5 * _verl_agg(torch.max(l1, l2), m, mode), frac


def _data(seed, b=6, length=40):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, length, generator=g) < 0.75
    mask[2, 10:20] = False  # a hole (a tool's output) inside a response
    mask[4] = False  # an empty row
    return [torch.randn(b, length, generator=g) for _ in range(3)], mask


def _dtype(impl):
    return torch.float64 if impl == "reference" else torch.float32


def _device(impl):
    # The public functions run where the selected backend's kernels run: on a GPU when there
    # is one (a CPU tensor there goes to another backend than the kernels under test).
    return "cuda" if impl == "rlk" and torch.cuda.is_available() else "cpu"


def _err(got, want, mask=None):
    got, want = got.detach().double(), want.detach().double()
    d = (got - want).abs() / want.abs().clamp(min=1.0)
    return float((d if mask is None else d[mask]).max())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_verl(impl, gamma, lam, seed):
    (r, v, _), mask = _data(seed)
    dt, dev = _dtype(impl), _device(impl)
    r, v, mask = r.to(dev, dt), v.to(dev, dt), mask.to(dev)
    want_adv, want_ret = _verl_gae(r, v, mask, gamma, lam)
    adv, ret = IMPLS[impl].gae_advantages(r, v, mask, gamma=gamma, lam=lam)
    assert adv.dtype == ret.dtype == dt
    # verl leaves its carried values outside the mask; rlk gives 0 there.
    assert bool((adv[~mask] == 0).all() and (ret[~mask] == 0).all())
    assert _err(adv, want_adv, mask) <= TOL
    assert _err(ret, want_ret, mask) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm"],
)  # fmt: skip
def test_value_loss_matches_verl(impl, mode):
    (old, ret, noise), mask = _data(1)
    dt, dev = _dtype(impl), _device(impl)
    old, ret, mask = old.to(dev, dt), ret.to(dev, dt), mask.to(dev)
    v = (old + 0.6 * noise.to(dev, dt)).requires_grad_()
    want, want_frac = _verl_value_loss(v, ret, old, mask, 0.5, mode)
    (want_grad,) = torch.autograd.grad(want, v)
    loss, m = IMPLS[impl].value_loss(v, old, ret, mask, clip=0.5, agg=mode)
    (grad,) = torch.autograd.grad(loss, v)
    assert _err(loss, want) <= TOL
    assert _err(grad, want_grad) <= TOL
    assert abs(float(m["clip_fraction"]) - float(want_frac)) <= TOL
    assert 0 < float(want_frac) < 1
