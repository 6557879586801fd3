"""GAE and the clipped value loss against verl 0.9.1's formulas, written out here in plain
PyTorch (``compute_gae_advantage_return`` with ``masked_whiten``, ``compute_value_loss`` with
``agg_loss``), independently of rlk's code: the float64 reference must agree with them to
1e-6 and the fp32 triton kernels to 2e-5 (relative to values above 1), on random inputs with
holes in the response mask."""

from __future__ import annotations

import pytest
import torch

from rlk_reference import _ppo as ref
from rlk_triton import backend, ppo

TABLE = {**backend.default_table(), **ppo.TUNING}
IMPLS = {"reference": ref, "triton": ppo}


def _kw(impl):
    return {"table": TABLE} if impl == "triton" else {}


def _verl_masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def _verl_gae(rewards, values, mask, gamma, lam):
    m = mask.double()
    r, v = rewards.double(), values.double()
    nextvalues, lastgaelam, out = 0.0, 0.0, []
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
    seq_mask = (seq_tokens > 0).double()
    if mode == "seq-mean-token-mean":
        seq = (mat * m).sum(-1) / (seq_tokens + 1e-8)
        return (seq * seq_mask).sum() / seq_mask.sum()
    seq = (mat * m).sum(-1)
    loss = (seq * seq_mask).sum() / seq_mask.sum()
    return loss / m.shape[-1] if mode == "seq-mean-token-sum-norm" else loss


def _verl_value_loss(vpreds, returns, values, mask, cliprange, mode):
    m = mask.double()
    vp, ret, old = vpreds.double(), returns.double(), values.double()
    clipped = torch.max(torch.min(vp, old + cliprange), old - cliprange)
    l1, l2 = (vp - ret) ** 2, (clipped - ret) ** 2
    return 0.5 * _verl_agg(torch.max(l1, l2), m, mode), _verl_masked_mean((l2 > l1).double(), m)


def _data(seed, b=6, length=40):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, length, generator=g) < 0.75
    mask[2, 10:20] = False  # a hole (a tool's output) inside a response
    mask[4] = False  # an empty row
    return [torch.randn(b, length, generator=g) for _ in range(3)], mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_verl(impl, gamma, lam):
    (r, v, _), mask = _data(0)
    want_adv, want_ret = _verl_gae(r, v, mask, gamma, lam)
    adv, ret = IMPLS[impl].gae_advantages(r, v, mask, gamma=gamma, lam=lam, **_kw(impl))
    for got, want in ((adv, want_adv), (ret, want_ret)):
        # Relative to values above 1 (a return sums up to L rewards); the fp32 kernels'
        # sequential scan rounds at every step: their bound is that of the other objectives.
        err = (got.double() - want)[mask].abs() / want[mask].abs().clamp(min=1.0)
        assert err.max() <= (1e-6 if impl == "reference" else 2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm"],
)  # fmt: skip
def test_value_loss_matches_verl(impl, mode):
    (old, ret, noise), mask = _data(1)
    v = old + 0.6 * noise
    want, want_frac = _verl_value_loss(v, ret, old, mask, 0.5, mode)
    loss, m = IMPLS[impl].value_loss(v, old, ret, mask, clip=0.5, agg=mode, **_kw(impl))
    tol = 1e-6 if impl == "reference" else 2e-5
    assert abs(float(loss) - float(want)) <= tol * max(1.0, abs(float(want)))
    assert abs(float(m["clip_fraction"]) - float(want_frac)) <= 1e-6
    assert 0 < float(want_frac) < 1
