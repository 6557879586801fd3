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
from rlk_triton import sampling_filters as sf
from rlk_triton._triton import jit, tl

TABLE = backend.default_table()


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    # Small blocks and parts of 2 blocks: several parts per row at test sizes, so that the
    # split threshold combines parts.
    monkeypatch.setattr(smod, "BLOCK", 128)
    monkeypatch.setattr(smod, "PART_BLOCKS", 2)


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


def _geometry(v):
    """``(blocks, meta, sizes)``: a row of ``v`` logits' block count and the constexprs that
    sampling.sample passes its kernels, for the tests that launch them directly."""
    blocks = -(-v // smod.BLOCK)
    meta = dict(BLOCK=smod.BLOCK, RADIX_BITS=smod.RADIX_BITS)
    sizes = dict(PART_BLOCKS=smod.PART_BLOCKS, MAX_BLOCKS=1 << (blocks - 1).bit_length())
    return blocks, meta, sizes


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


@pytest.mark.parametrize("v", [300, 3000])
def test_skipping_blocks_without_kept_tokens_changes_no_token(monkeypatch, v):
    # The top-k passes skip blocks below their bucket or below the row's floor (the k-th
    # largest block maximum), the top-p passes and the pick blocks whose largest logit cannot
    # reach the threshold: with the skips turned off every row must draw the very same token
    # (rows with top-k alone, top-p alone, both, neither, one with a NaN; at V = 3000, 24
    # blocks, most rows have k below the block count, and row 13's logits are whole numbers:
    # ties across blocks at the floor).
    b = 16
    logits, seeds, offsets = _rows(b, v, torch.float32, seed=7)
    logits[3, 250] = float("nan")
    logits[13] = logits[13].round()
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

    monkeypatch.setattr(smod, "_may_keep", keep_all)  # the candidate step
    monkeypatch.setattr(sf, "_may_keep", keep_all)  # the passes and the pick (_live_blocks)
    monkeypatch.setattr(sf, "_may_count", count_all)
    slow = _sample(logits, seeds, offsets, **p)
    assert fast[3] == -1 and torch.equal(fast, slow)


def _candidate_rows():
    """Rows for the candidate step: 24 blocks a row (V = 3000); k from 1 to 40 (above 24 no
    floor: the radix passes), top-p on and off, whole-number logits (ties across blocks at the
    floor), +inf and -inf logits, a NaN, a greedy row."""
    b = 16
    logits, seeds, offsets = _rows(b, 3000, torch.float32, seed=21)
    p = _params(b, seed=22)
    p["top_k"] = torch.tensor([1, 2, 3, 5, 8, 13, 20, 23, 24, 25, 40, 4, 6, 7, 9, 10])
    p["top_p"][::3] = 1.0
    logits[[2, 11]] = logits[[2, 11]].round()
    logits[4, [7, 2900]] = float("inf")
    logits[5, 100:900] = float("-inf")
    logits[6, 1234] = float("nan")
    p["temperature"][7] = 0.0
    return logits, seeds, offsets, p


@pytest.mark.parametrize("programs", [0, 2048])
def test_candidate_step_draws_the_radix_token(monkeypatch, programs):
    """A top-k row's token from its few candidates (FEW_CAP) is the token of the radix passes
    (FEW_CAP 0), with one program per row and split; a cap of 8 sends the rows with more
    candidates to the radix passes in the same call."""
    logits, seeds, offsets, p = _candidate_rows()
    cfg = next(c for c in TABLE["sample.fwd"].configs if c["programs"] == programs)
    results = {}
    for cap in (smod.FEW_CAP, 8, 0):
        monkeypatch.setattr(smod, "FEW_CAP", cap)
        with tuning.force("sample", {"sample.fwd": cfg}):
            results[cap] = _sample(logits, seeds, offsets, **p)
    assert results[0][6] == -1
    assert all(torch.equal(results[0], r) for r in results.values())


def test_candidate_step_decides_some_rows_and_leaves_others():
    # Without this the comparison above could pass with the candidate step deciding nothing.
    logits, seeds, offsets, p = _candidate_rows()
    b, v = logits.shape
    blocks, meta, sizes = _geometry(v)
    cap = smod.FEW_CAP
    few = (seeds, offsets, torch.empty(b, cap), torch.empty(b, cap, dtype=torch.int32),
           torch.empty(b, dtype=torch.int64))  # fmt: skip
    params = (p["top_k"], p["top_p"])
    has = dict(HAS_TOPK=True, HAS_TOPP=True)
    _, done = smod._split_threshold(logits, p["temperature"], params, has,
                                    torch.empty(b, blocks, dtype=torch.int32), meta, sizes,
                                    dict(num_warps=4), few)  # fmt: skip
    decided = set(torch.nonzero(done).flatten().tolist())
    # k <= 23 with a floor, no NaN, sampled: decided; k >= 25 (no floor), NaN, greedy: not.
    assert {0, 1, 2, 3, 4, 5, 11, 12} <= decided
    assert not decided & {6, 7, 9, 10}


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


def test_split_threshold_equals_one_program():
    """The threshold as a launch per pass over (row, part) programs gives every row the token
    of the one-program threshold: the parts' counts add exactly and their top-p masses add in
    the one-program order (12 parts a row here; rows with top-k, top-p, both, neither, greedy,
    ties, and a NaN)."""
    b = 8
    logits, seeds, offsets = _rows(b, 3000, torch.float32, seed=11)
    logits[1, [5, 1500, 2999]] = 30.0  # ties for the top
    logits[6, 2100] = float("nan")
    p = _params(b, seed=12)
    p["top_k"][0], p["top_p"][2], p["temperature"][3] = 0, 1.0, 0.0
    p["top_k"][4], p["top_p"][4] = 0, 1.0
    rule = TABLE["sample.fwd"]
    results = {}
    for cfg in rule.configs:
        with tuning.force("sample", {"sample.fwd": cfg}):
            results[cfg["programs"]] = _sample(logits, seeds, offsets, **p)
    assert 0 in results and len(results) >= 2
    assert results[0][6] == -1
    assert all(torch.equal(results[0], r) for r in results.values())


@jit
def _one_program_threshold(logits, temp, topk, topp, maxima, kept_out, V, stride, n_blocks,
                           BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
                           PART_BLOCKS: tl.constexpr, MAX_BLOCKS: tl.constexpr):  # fmt: skip
    # The one-program radix threshold of _sample_kernel, its key written out.
    row = tl.program_id(0)
    t, k, p, on_k, on_p = sf._filters(temp, topk, topp, row, V, True, True)
    sf._block_maxima(logits + row * stride, V, 0, n_blocks, t, maxima + row * n_blocks, BLOCK)
    tl.debug_barrier()
    kept = sf._row_kept(logits + row * stride, V, t, k, p, on_k, on_p, n_blocks,
                          maxima + row * n_blocks, BLOCK, RADIX_BITS, PART_BLOCKS,
                          MAX_BLOCKS)  # fmt: skip
    tl.store(kept_out + row, kept.to(tl.int64))


def test_split_threshold_keys_equal_one_program_keys():
    """The thresholds themselves, bit for bit: the split threshold's key of every row is the
    one-program key (top-k alone, top-p alone, both; 12 parts a row), and top-k alone keeps
    exactly the reference's tokens."""
    b, v = 6, 3000
    logits, _, _ = _rows(b, v, torch.float32, seed=15)
    p = _params(b, seed=16)
    p["top_k"][:2] = 0
    p["top_p"][2:4] = 1.0
    temp, k, q = p["temperature"], p["top_k"], p["top_p"]
    blocks, meta, sizes = _geometry(v)
    one = torch.empty(b, dtype=torch.int64)
    _one_program_threshold[(b,)](logits, temp, k, q, torch.empty(b, blocks, dtype=torch.int32),
                                 one, v, v, blocks, **meta, **sizes)  # fmt: skip
    has = dict(HAS_TOPK=True, HAS_TOPP=True)
    split, _ = smod._split_threshold(logits, temp, (k, q), has,
                                     torch.empty(b, blocks, dtype=torch.int32), meta, sizes,
                                     dict(num_warps=4))  # fmt: skip
    assert torch.equal(split, one)
    z = logits.double() / temp.double()[:, None]
    for row in (2, 3):  # top-k alone: z >= the k-th largest z
        kept = int(one[row])
        keys = torch.tensor([smod_key(float(x)) for x in (logits[row] / temp[row]).tolist()])
        assert torch.equal(keys >= kept, keep_mask(z[row], int(k[row]), 1.0))


@jit
def _one_program_masses(logits, maxima, temp, out, V, n_blocks, SHIFT: tl.constexpr,
                        BLOCK: tl.constexpr, NCAND: tl.constexpr, PART_BLOCKS: tl.constexpr,
                        MAX_BLOCKS: tl.constexpr):  # fmt: skip
    # The first top-p pass's masses of row 0 as the one-program threshold adds them.
    t = tl.load(temp)
    z_max = sf._row_z_max(maxima, n_blocks, t, MAX_BLOCKS)
    mass = sf._row_masses(logits, V, tl.zeros([], tl.uint32), SHIFT, t, tl.zeros([], tl.uint32),
                            z_max, n_blocks, maxima, BLOCK, NCAND, PART_BLOCKS)  # fmt: skip
    tl.store(out + tl.arange(0, NCAND), mass)


def test_top_p_masses_are_exact_fixed_point_sums():
    """A top-p pass's masses are the int64 sums of floor(exp(z - z_max) * 2**40) over the
    tokens at or above each candidate key: the split threshold's parts add up to the
    one-program masses, and both to the sum computed here from the kernel's own terms (so no
    order of addition can show)."""
    v, ncand = 3000, 1 << smod.RADIX_BITS
    logits, _, _ = _rows(1, v, torch.float32, seed=17)
    temp = torch.tensor([0.7])
    blocks, meta, sizes = _geometry(v)
    n_parts = -(-blocks // smod.PART_BLOCKS)
    k, q = torch.zeros(1, dtype=torch.int64), torch.tensor([0.9])
    has = dict(HAS_TOPK=False, HAS_TOPP=True)
    maxima = torch.empty(1, blocks, dtype=torch.int32)
    prefix = torch.empty(1, 2 * smod.LEVELS, dtype=torch.int64)
    counts = torch.empty(2, 1, n_parts, ncand, dtype=torch.int32)
    masses = torch.empty(2, 1, n_parts, ncand, dtype=torch.int64)
    sf._maxima_kernel[(1, n_parts)](logits, temp, k, q, maxima, v, v, blocks, **has,
                                      BLOCK=smod.BLOCK, PART_BLOCKS=smod.PART_BLOCKS)  # fmt: skip
    sf._level_kernel[(1, n_parts)](logits, temp, k, q, maxima, prefix, counts, masses,
                                     torch.empty(1, dtype=torch.int64),
                                     torch.empty(1, dtype=torch.float64),
                                     torch.empty(1, dtype=torch.int64),
                                     torch.empty(1, dtype=torch.int32), v, v, blocks, n_parts,
                                     TOPP=True, LEVEL=0, **has, **meta, **sizes,
                                     MAX_PARTS=1 << (n_parts - 1).bit_length(),
                                     FEW=False)  # fmt: skip
    split = masses[0, 0].sum(0)
    one = torch.empty(ncand, dtype=torch.int64)
    _one_program_masses[(1,)](logits, maxima, temp, one, v, blocks, SHIFT=32 - smod.RADIX_BITS,
                              BLOCK=smod.BLOCK, NCAND=ncand, **sizes)  # fmt: skip
    assert torch.equal(split, one)
    z = logits[0] / temp  # what div_rn gives: IEEE division
    terms = (torch.exp(z - z.max()) * 2.0**40).double().floor()
    keys = torch.tensor([smod_key(float(x)) for x in z.tolist()])
    for d in range(ncand):
        want = float(terms[keys >= d << (32 - smod.RADIX_BITS)].sum())
        # torch's exp and the interpreter's (numpy's) may differ in the last bit of a term
        assert abs(int(one[d]) - want) <= 1e-6 * want + 1
    assert one[0] >= 2**40


def smod_key(x: float) -> int:
    """The kernel's order-preserving uint32 key of fp32 ``x`` (see sampling._key)."""
    bits = int(torch.tensor(0.0 if x == 0.0 else x, dtype=torch.float32).view(torch.int32))
    bits &= 0xFFFFFFFF
    return (~bits) & 0xFFFFFFFF if bits >> 31 else bits | 0x80000000


@pytest.mark.parametrize("programs", [0, 2048])
def test_filters_passed_as_none_are_off(programs):
    """None for top_k / top_p (what rlk.sample passes for 0 and 1.0) is the filter off in every
    row, with one program per row and with the split threshold."""
    b = 5
    logits, seeds, offsets = _rows(b, 700, torch.bfloat16, seed=13)
    g = torch.Generator().manual_seed(14)
    t = torch.rand(b, generator=g) + 0.3
    k, q = torch.randint(1, 30, (b,), generator=g), torch.rand(b, generator=g) * 0.8 + 0.1
    cfg = next(c for c in TABLE["sample.fwd"].configs if c["programs"] == programs)
    with tuning.force("sample", {"sample.fwd": cfg}):
        for top_k, top_p, off in ((k, None, dict(top_k=k, top_p=torch.ones(b))),
                                  (None, q, dict(top_k=torch.zeros(b, dtype=torch.int64), top_p=q)),
                                  (None, None, dict(top_k=torch.zeros(b, dtype=torch.int64),
                                                    top_p=torch.ones(b)))):  # fmt: skip
            got = _sample(logits, seeds, offsets, temperature=t, top_k=top_k, top_p=top_p)
            assert torch.equal(got, _sample(logits, seeds, offsets, temperature=t, **off))


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


def test_top_p_beyond_exact_int64_masses_is_an_error():
    # 2**22 tokens at 2**40 each is the most an int64 mass holds exactly.
    logits = torch.zeros(1, smod.MAX_VOCAB + 1)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits: a vocabulary of 4194305"):
        _sample(logits, one, one, temperature=torch.ones(1), top_k=None, top_p=torch.full([1], 0.9))


#: Row -> (temperature, top_k, top_p): valid rows around rows whose parameters are invalid
#: (reachable without host value checks: a GPU without RLK_VALIDATE).
_INVALID_ROWS = [
    (0.8, 5, 0.9),
    (-1.0, 5, 0.9),
    (float("nan"), 5, 0.9),
    (float("inf"), 5, 0.9),
    (0.8, -1, 0.9),
    (0.8, 5, 1.5),
    (0.8, 5, 0.0),
    (0.8, 5, float("nan")),
    (0.0, 0, 1.0),
    (0.0, 0, 1.5),
    (0.7, 0, 0.9),
]
_BAD = [1, 2, 3, 4, 5, 6, 7, 9]


def _invalid_rows(v, device="cpu"):
    b = len(_INVALID_ROWS)
    logits, seeds, offsets = _rows(b, v, torch.bfloat16, seed=21)
    t, k, p = (torch.tensor(c) for c in zip(*_INVALID_ROWS, strict=True))
    p = dict(temperature=t.float(), top_k=k.long(), top_p=p.float())
    args = (logits, seeds, offsets)
    return tuple(a.to(device) for a in args), {n: x.to(device) for n, x in p.items()}


def _check_invalid_rows(got, args, p):
    """Invalid rows give -1, as in the reference; the valid rows their own tokens."""
    good = [i for i in range(len(_INVALID_ROWS)) if i not in _BAD]
    assert got[_BAD].tolist() == [-1] * len(_BAD)
    want = ref.sample(*(a.cpu() for a in args), **{n: x.cpu() for n, x in p.items()})
    assert torch.equal(want[_BAD], got[_BAD].cpu())
    sub = _sample(*(a[good] for a in args), **{n: x[good] for n, x in p.items()})
    assert torch.equal(got[good], sub) and (sub >= 0).all()


@pytest.mark.parametrize("programs", [0, 2048])
def test_invalid_per_row_parameters_draw_no_token(programs):
    args, p = _invalid_rows(300)
    cfg = next(c for c in TABLE["sample.fwd"].configs if c["programs"] == programs)
    with tuning.force("sample", {"sample.fwd": cfg}):
        _check_invalid_rows(_sample(*args, **p), args, p)
        # Without filters (None: no threshold pass), temperature alone decides.
        got = _sample(*args, temperature=p["temperature"], top_k=None, top_p=None)
    assert got[[1, 2, 3]].tolist() == [-1] * 3 and (got[[0, 4, 5, 6, 7, 8, 9, 10]] >= 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_invalid_per_row_parameters_draw_no_token():
    args, p = _invalid_rows(151936, "cuda")
    for cfg in tuning.op_configs(TABLE, "sample"):
        with tuning.force("sample", cfg):
            _check_invalid_rows(_sample(*args, **p), args, p)
