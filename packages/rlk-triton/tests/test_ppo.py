"""gae_advantages / value_loss kernels vs the float64 reference, plus invariances.

L = 300 spans two token blocks of the value loss (BLOCK_L = 256) and several whitening tiles;
BLOCK_B is patched to 2 so that the batch sums run over several sequence blocks.
"""

from __future__ import annotations

import pytest
import torch

from rlk.ops import AGG_MODES
from rlk_reference import _ppo as ref
from rlk_triton import _objectives, backend, ppo, tuning

TABLE = {**backend.default_table(), **ppo.TUNING}


@pytest.fixture(autouse=True)
def small_batch_block(monkeypatch):
    monkeypatch.setattr(_objectives, "BLOCK_B", 2)


def _inputs(b=5, length=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, length, generator=g)
    v = torch.randn(b, length, generator=g)
    mask = torch.rand(b, length, generator=g) < 0.7  # holes: multi-turn tool outputs
    mask[1] = False  # an empty row
    r[~mask] = float("inf")  # padding may hold anything
    v[~mask] = float("nan")
    return r, v, mask


def _configs(key):
    for cfg in ppo.TUNING[key].configs:
        yield {**TABLE, key: tuning.Rule(configs=(cfg,))}


@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_reference(whiten, gamma, lam):
    r, v, mask = _inputs()
    got = ppo.gae_advantages(r, v, mask, gamma=gamma, lam=lam, whiten=whiten, table=TABLE)
    want = ref.gae_advantages(r, v, mask, gamma=gamma, lam=lam, whiten=whiten)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert bool((a[~mask] == 0).all())


def test_gae_row_depends_on_its_row_only():
    r, v, mask = _inputs(b=7)
    adv, ret = ppo.gae_advantages(r, v, mask, gamma=0.9, lam=0.8, whiten=False, table=TABLE)
    for rows in ([3], [6, 0], [2, 5, 4]):
        a, t = ppo.gae_advantages(
            r[rows], v[rows], mask[rows], gamma=0.9, lam=0.8, whiten=False, table=TABLE
        )
        assert torch.equal(a, adv[rows]) and torch.equal(t, ret[rows])


@pytest.mark.parametrize("key", ["gae_advantages.scan", "gae_advantages.whiten"])
def test_gae_tuning_never_changes_bits(key):
    r, v, mask = _inputs()
    outs = [
        ppo.gae_advantages(r, v, mask, gamma=0.99, lam=0.95, table=table) for table in _configs(key)
    ]
    for a, t in outs[1:]:
        assert torch.equal(a, outs[0][0]) and torch.equal(t, outs[0][1])


def _value_inputs(b=5, length=300, seed=1):
    _, _, mask = _inputs(b, length, seed)
    g = torch.Generator().manual_seed(seed + 10)
    old = torch.randn(b, length, generator=g)
    ret = torch.randn(b, length, generator=g)
    v = old + 0.8 * torch.randn(b, length, generator=g)  # some inside the clip range, some out
    v[~mask] = float("inf")
    return v, old, ret, mask


def _value(fn, v, *args, **kwargs):
    v = v.clone().requires_grad_()
    loss, m = fn(v, *args, **kwargs)
    loss.backward()
    return loss.detach(), m["clip_fraction"], v.grad


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("clip", [0.5, None])
def test_value_loss_matches_reference(agg, clip):
    v, old, ret, mask = _value_inputs()
    got = _value(ppo.value_loss, v, old, ret, mask, clip=clip, agg=agg, table=TABLE)
    want = _value(ref.value_loss, v, old, ret, mask, clip=clip, agg=agg)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert bool((got[2][~mask] == 0).all())
    if clip is not None:
        assert 0 < float(got[1]) < 1  # the clip is exercised


def test_value_loss_counts_and_scales():
    v, old, ret, mask = _value_inputs()
    n = float(mask.sum())
    whole, _, _ = _value(ppo.value_loss, v, old, ret, mask, table=TABLE)
    parts = [
        _value(ppo.value_loss, v[s], old[s], ret[s], mask[s], num_tokens=n, table=TABLE)[0]
        for s in (slice(0, 2), slice(2, 5))
    ]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-6, atol=0)
    for agg, kw in (("seq-mean-token-sum-norm", {"norm_length": 7.0, "num_seqs": 3.0}),):
        got = _value(ppo.value_loss, v, old, ret, mask, agg=agg, table=TABLE, **kw)
        want = _value(ref.value_loss, v, old, ret, mask, agg=agg, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["value_loss.seq", "value_loss.batch", "value_loss.bwd"])
def test_value_loss_tuning_never_changes_bits(key):
    v, old, ret, mask = _value_inputs()
    outs = [
        _value(ppo.value_loss, v, old, ret, mask, agg="seq-mean-token-mean", table=table)
        for table in _configs(key)
    ]
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))


def test_value_loss_gradient_rows_depend_on_their_rows_only():
    v, old, ret, mask = _value_inputs(b=6)
    _, _, grad = _value(ppo.value_loss, v, old, ret, mask, agg="token-sum", table=TABLE)
    rows = [4, 0]
    _, _, part = _value(
        ppo.value_loss, v[rows], old[rows], ret[rows], mask[rows], agg="token-sum", table=TABLE
    )
    assert torch.equal(part, grad[rows])
