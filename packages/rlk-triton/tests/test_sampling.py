"""sample kernel: the Philox stream bit for bit, tokens vs the reference, filters, invariances.

Tests patch BLOCK to 128 so that V = 300 spans three blocks (the last one partial).
"""

from __future__ import annotations

import pytest
import torch

import rlk_reference as ref
from rlk_reference._sampling import keep_mask
from rlk_reference.philox import philox_uniform
from rlk_triton import backend, tuning
from rlk_triton import sampling as smod
from rlk_triton._triton import jit, tl

TABLE = backend.default_table()


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    monkeypatch.setattr(smod, "BLOCK", 128)


def _params(b, seed, temp=None, top_k=None, top_p=None):
    g = torch.Generator().manual_seed(seed)
    return dict(
        temperature=torch.rand(b, generator=g) + 0.3 if temp is None else temp,
        top_k=torch.randint(0, 40, (b,), generator=g) if top_k is None else top_k,
        top_p=torch.rand(b, generator=g) * 0.9 + 0.1 if top_p is None else top_p,
    )


def _rows(b, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * 3).to(dtype)
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    offsets = torch.randint(0, 2**40, (b,), generator=g)
    return logits, seeds, offsets


def _sample(logits, seeds, offsets, **p):
    return smod.sample(logits, seeds, offsets, table=TABLE, **p)


def test_uniforms_equal_the_reference_bit_for_bit():
    seeds = torch.tensor([0, 1, -1, -5, 2**32 - 1, 2**40 + 7, -(2**63), 2**63 - 1])
    offsets = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**33 + 5, 17, 2**62, 2**63 - 1])
    u = smod.uniforms(seeds, offsets, 1500)
    expect = philox_uniform(seeds, offsets, 1500)
    assert u.dtype == torch.float32
    assert torch.equal(u.view(torch.int32), expect.view(torch.int32))
    assert float(u.min()) > 0 and float(u.max()) < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tokens_match_the_reference(dtype):
    b = 24
    logits, seeds, offsets = _rows(b, 300, dtype, seed=1)
    p = _params(b, seed=2)
    p["top_k"][:4] = 0  # top-p alone
    p["top_p"][4:8] = 1.0  # top-k alone
    p["top_k"][8:10], p["top_p"][8:10] = 0, 1.0  # plain sampling
    p["temperature"][10:12] = 0.0  # greedy
    p["top_k"][12:14] = 1  # top-1: the argmax whatever the noise
    p["top_k"][14] = 1000  # larger than V: off
    tok = _sample(logits, seeds, offsets, **p)
    expect = ref.sample(logits, seeds, offsets, **p)
    assert tok.dtype == torch.int64
    same = tok == expect
    assert same[10:14].all()  # greedy and top-1 are exact
    assert same.float().mean() >= 0.99, (tok, expect)


def test_sampled_tokens_survive_the_filters():
    b = 8
    logits, seeds, offsets = _rows(b, 300, torch.float32, seed=3)
    p = _params(b, seed=4, temp=torch.full((b,), 4.0))  # flat rows: filters decide the token
    p["top_k"] = torch.tensor([3, 0, 5, 0, 10, 2, 0, 1])
    p["top_p"] = torch.tensor([1.0, 0.3, 0.5, 0.05, 0.2, 1.0, 0.9, 0.5])
    for step in range(3):
        tok = _sample(logits, seeds, offsets + step, **p)
        for r in range(b):
            z = logits[r].double() / float(p["temperature"][r])
            keep = keep_mask(z, int(p["top_k"][r]), float(p["top_p"][r]))
            assert keep[tok[r]], (r, step)


def test_top_k_keeps_ties_and_greedy_takes_lowest_index():
    logits = torch.zeros(3, 300)
    logits[:, [7, 100, 250]] = 5.0
    seeds, offsets = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    greedy = _sample(
        logits,
        seeds,
        offsets,
        temperature=torch.zeros(3),
        top_k=torch.zeros(3, dtype=torch.int64),
        top_p=torch.ones(3),
    )
    assert greedy.tolist() == [7, 7, 7]
    seen = set()
    for step in range(6):
        tok = _sample(
            logits,
            seeds,
            offsets + step,
            temperature=torch.ones(3),
            top_k=torch.ones(3, dtype=torch.int64),
            top_p=torch.ones(3),
        )
        seen |= set(tok.tolist())
    assert seen <= {7, 100, 250} and len(seen) > 1  # the three tied maxima all survive top-1


def test_top_k_cut_through_ties_made_by_the_division():
    # top-k is searched on the logits and divided once; the kept set must still be every token
    # whose z = x / temperature (fp32, correctly rounded) reaches the k-th largest z. Logits one
    # ulp apart near 1.9 divided by 3 collide in fp32 (z spacing 2/3 ulp), so a cut can fall
    # inside a tie of z that the logits do not have.
    v, t = 300, 3.0
    x = torch.full((v,), -30.0)
    x[10:30] = 1.9 + torch.arange(20, dtype=torch.float32) * 2.0**-23
    z = x / t
    zs = z.sort(descending=True).values
    k = next(i for i in range(1, 19) if zs[i - 1] == zs[i] and zs[i - 2] != zs[i - 1])
    kept = set(torch.nonzero(z >= zs[k - 1]).flatten().tolist())
    assert len(kept) > k
    n = 300
    tok = _sample(
        x.expand(n, v).contiguous(),
        torch.full((n,), 5, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        temperature=torch.full((n,), t),
        top_k=torch.full((n,), k, dtype=torch.int64),
        top_p=torch.ones(n),
    )
    assert set(tok.tolist()) == kept


def test_skipping_blocks_without_kept_tokens_changes_no_token(monkeypatch):
    # The top-k passes skip blocks below their bucket, the top-p passes and the pick blocks
    # whose largest logit cannot reach the threshold: with both skips turned off every row
    # must draw the very same token (rows with top-k alone, top-p alone, both, neither, and
    # one with a NaN).
    b = 16
    logits, seeds, offsets = _rows(b, 300, torch.float32, seed=7)
    logits[3, 250] = float("nan")
    p = _params(b, seed=8)
    p["top_k"][:4] = 0
    p["top_p"][4:8] = 1.0
    p["top_k"][8:10], p["top_p"][8:10] = 0, 1.0
    p["top_k"][10:13] = torch.tensor([1, 2, 3])
    fast = _sample(logits, seeds, offsets, **p)

    @jit
    def keep_all(block_max, temperature, kept):
        return tl.full([], 1, tl.int1)

    @jit
    def count_all(block_max, prefix):
        return tl.full([], 1, tl.int1)

    monkeypatch.setattr(smod, "_may_keep", keep_all)
    monkeypatch.setattr(smod, "_may_count", count_all)
    slow = _sample(logits, seeds, offsets, **p)
    assert fast[3] == -1 and torch.equal(fast, slow)


def test_split_pick_merges_ranges_as_one_pass():
    # Few rows split each row's pick into ranges of whole blocks (a program each), merged by a
    # third kernel. The merge must give the one-pass answer (a config with programs=0) where it
    # is delicate: equal maxima in different ranges (the lowest index wins), a row all -inf
    # (index 0), a NaN only in the last range (-1), and greedy next to sampled rows.
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    logits[0:2, [260, 140, 20]] = 9.0
    logits[2] = float("-inf")
    logits[3, 299] = float("nan")
    seeds, offsets = torch.arange(6), torch.arange(6) * 11
    p = dict(
        temperature=torch.tensor([0.0, 0.0, 1.0, 1.0, 0.7, 1.3]),
        top_k=torch.tensor([0, 0, 0, 0, 5, 0]),
        top_p=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 1.0]),
    )
    rule = TABLE["sample.fwd"]
    one_pass = [c for c in rule.configs if c["programs"] == 0]
    split = [c for c in rule.configs if c["programs"] >= 6 * 3]
    assert one_pass and split  # a config of each kind, or the comparison proves nothing
    results = []
    for cfg in one_pass + split:
        with tuning.force("sample", {"sample.fwd": cfg}):
            results.append(_sample(logits, seeds, offsets, **p))
    assert results[0][:4].tolist() == [20, 20, 0, -1]
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_batch_invariance_and_determinism():
    b = 6
    logits, seeds, offsets = _rows(b, 300, torch.bfloat16, seed=5)
    p = _params(b, seed=6)
    tok = _sample(logits, seeds, offsets, **p)
    assert torch.equal(tok, _sample(logits, seeds, offsets, **p))
    idx = torch.tensor([4, 1, 5])
    sub = _sample(logits[idx], seeds[idx], offsets[idx], **{k: v[idx] for k, v in p.items()})
    assert torch.equal(sub, tok[idx])


def test_every_tuning_config_gives_identical_tokens():
    b = 4
    logits, seeds, offsets = _rows(b, 300, torch.float32, seed=7)
    p = _params(b, seed=8)
    configs = tuning.op_configs(TABLE, "sample")
    assert len(configs) >= 2
    results = []
    for cfg in configs:
        with tuning.force("sample", cfg):
            results.append(_sample(logits, seeds, offsets, **p))
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_tokens_match_the_reference_at_real_vocab():
    b, v = 64, 151936
    logits, seeds, offsets = _rows(b, v, torch.bfloat16, seed=9)
    p = _params(b, seed=10)
    p["temperature"][:4] = 0.0
    expect = ref.sample(logits, seeds, offsets, **p)
    cuda = {k: t.cuda() for k, t in p.items()}
    results = []
    for cfg in tuning.op_configs(TABLE, "sample"):
        with tuning.force("sample", cfg):
            results.append(_sample(logits.cuda(), seeds.cuda(), offsets.cuda(), **cuda).cpu())
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert torch.equal(results[0][:4], expect[:4])
    assert (results[0] == expect).float().mean() >= 0.95
    u = smod.uniforms(seeds.cuda(), offsets.cuda(), v).cpu()
    assert torch.equal(u, philox_uniform(seeds, offsets, v))
