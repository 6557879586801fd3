import pytest
import torch

import rlk_reference as ref
from rlk_reference._sampling import keep_mask
from rlk_reference.philox import philox4x32_10, philox_uniform

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, expected output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    out = philox4x32_10([torch.tensor(c) for c in counter], [torch.tensor(k) for k in key])
    assert tuple(int(x) for x in out) == want


def test_philox_uniform_wiring_and_range():
    seeds = torch.tensor([0, -1, 0x243F6A88_A4093822, 7], dtype=torch.int64)
    offsets = torch.tensor([0, 5, 1 << 40, (1 << 63) - 1], dtype=torch.int64)
    u = philox_uniform(seeds, offsets, 37)
    assert u.dtype == torch.float32 and u.shape == (4, 37)
    assert ((u > 0) & (u < 1)).all()
    odd = u.double() * 2**24
    assert torch.equal(odd, odd.round()) and (odd.long() % 2 == 1).all()
    for b in range(4):
        s, o = int(seeds[b]) & (2**64 - 1), int(offsets[b])
        for v in (0, 1, 36):
            ctr = [torch.tensor(x) for x in (v, o & 0xFFFFFFFF, o >> 32, 0)]
            key = [torch.tensor(x) for x in (s & 0xFFFFFFFF, s >> 32)]
            x0 = int(philox4x32_10(ctr, key)[0])
            assert u[b, v].item() == (2 * (x0 >> 9) + 1) / 2**24
    # Row 0, v = 0 is the first known-answer vector.
    assert u[0, 0].item() == (2 * (0x6627E8D5 >> 9) + 1) / 2**24


def _sample(logits, seeds, offsets, temperature=1.0, top_k=0, top_p=1.0):
    b = logits.shape[0]
    return ref.sample(
        logits,
        torch.as_tensor(seeds, dtype=torch.int64).expand(b).contiguous(),
        torch.as_tensor(offsets, dtype=torch.int64).expand(b).contiguous(),
        temperature=torch.full((b,), temperature, dtype=torch.float32),
        top_k=torch.full((b,), top_k, dtype=torch.int64),
        top_p=torch.full((b,), top_p, dtype=torch.float32),
    )


def test_greedy_and_top1_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    logits[3, [7, 40]] = 50.0  # a tie: the lowest index wins
    want = logits.argmax(-1)
    assert want[3] == 7
    out = _sample(logits, 1, torch.arange(16), temperature=0.0)
    assert out.dtype == torch.int64 and torch.equal(out, want)
    assert torch.equal(_sample(logits, 1, torch.arange(16), temperature=0.8, top_k=1), want)


def test_deterministic_and_batch_invariant():
    torch.manual_seed(1)
    logits = torch.randn(8, 1000, dtype=torch.bfloat16)
    seeds, offsets = torch.arange(8) * 1000 + 3, torch.arange(8) + 77
    a = _sample(logits, seeds, offsets, temperature=0.9, top_k=50, top_p=0.9)
    b = _sample(logits, seeds, offsets, temperature=0.9, top_k=50, top_p=0.9)
    assert torch.equal(a, b)
    for row in (0, 5):
        alone = _sample(logits[row : row + 1], seeds[row], offsets[row], 0.9, 50, 0.9)
        assert alone.item() == a[row].item()


def test_offsets_and_seeds_change_draws():
    logits = torch.zeros(64, 1000)  # uniform: draws follow the noise only
    by_offset = _sample(logits, 123, torch.arange(64))
    by_seed = _sample(logits, torch.arange(64), 5)
    assert len(set(by_offset.tolist())) > 50 and len(set(by_seed.tolist())) > 50


def _chi_square(counts, probs):
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_empirical_frequencies_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5]])
    n, temperature = 6000, 1.3
    draws = _sample(logits.expand(n, 8).contiguous(), 42, torch.arange(n), temperature)
    counts = torch.bincount(draws, minlength=8).double()
    probs = torch.softmax(logits[0].double() / temperature, -1)
    # 7 degrees of freedom: 35 is far in the tail (p < 1e-5); a wrong sampler is far above it.
    assert _chi_square(counts, probs) < 35
    wrong = torch.softmax(logits[0].double(), -1)  # ignoring the temperature is detected
    assert _chi_square(counts, wrong) > 35


def _nucleus(probs, top_p):
    """Independent nucleus: add distinct probability levels, highest first, until >= top_p."""
    kept = set()
    mass = 0.0
    for level in sorted(set(probs.tolist()), reverse=True):
        kept |= {i for i, p in enumerate(probs.tolist()) if p == level}
        mass = sum(p for p in probs.tolist() if p >= level)
        if mass >= top_p:
            break
    return kept


def test_top_p_never_samples_outside_the_nucleus():
    torch.manual_seed(2)
    logits = torch.randn(1, 40) * 2
    n, top_p = 3000, 0.6
    probs = torch.softmax(logits[0].double(), -1)
    nucleus = _nucleus(probs, top_p)
    assert 1 < len(nucleus) < 40
    draws = _sample(logits.expand(n, 40).contiguous(), 9, torch.arange(n), top_p=top_p)
    assert set(draws.tolist()) <= nucleus
    idx = sorted(nucleus)
    counts = torch.bincount(draws, minlength=40).double()[idx]
    renorm = probs[idx] / probs[idx].sum()
    assert _chi_square(counts, renorm) < 20 + 3 * len(idx)


def test_top_k_then_top_p_with_ties():
    z = torch.tensor([3.0, 3.0, 2.0, 2.0, 1.0], dtype=torch.float64).log()  # p .3 .3 .2 .2 .1 -ish
    assert keep_mask(z, 3, 1.0).tolist() == [True, True, True, True, False]  # ties at k kept
    p = torch.softmax(z, -1)
    assert keep_mask(z, 0, float(p[0] + p[1]) * 0.9).tolist() == [True, True, False, False, False]
    assert keep_mask(z, 0, float(p[0] * 0.5)).tolist() == [True, True, False, False, False]
    assert keep_mask(z, 0, float(p[:3].sum()) * 0.999).tolist() == [True, True, True, True, False]
    # top_p renormalises over the top-k survivors.
    assert keep_mask(z, 2, 0.9).tolist() == [True, True, False, False, False]


def test_top_k_frequencies():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, 2.5]])
    n = 4000
    draws = _sample(logits.expand(n, 6).contiguous(), 11, torch.arange(n), top_k=3)
    assert set(draws.tolist()) <= {2, 3, 5}
    counts = torch.bincount(draws, minlength=6).double()[[2, 3, 5]]
    probs = torch.softmax(torch.tensor([2.0, 3.0, 2.5], dtype=torch.float64), -1)
    assert _chi_square(counts, probs) < 25


@pytest.mark.parametrize(
    "which, value", [("temperature", -1.0), ("temperature", float("nan")),
                     ("temperature", float("inf")), ("top_k", -1),
                     ("top_p", 1.5), ("top_p", 0.0), ("top_p", float("nan"))],
)  # fmt: skip
def test_an_invalid_per_row_value_draws_no_token(which, value):
    # Reachable with the value checks off (a GPU without RLK_VALIDATE): that row only gives -1.
    logits = torch.randn(3, 16)
    kw = dict(temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int64),
              top_p=torch.ones(3))  # fmt: skip
    kw[which] = kw[which].clone()
    kw[which][1] = value
    seeds, offsets = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    out = ref.sample(logits, seeds, offsets, **kw)
    assert out[1] == -1 and (out[[0, 2]] >= 0).all()


def test_a_row_whose_fp32_scaling_overflows_draws_no_token():
    # Outside the domain: 3e38 (or -3e38) at temperature 1e-3 overflows fp32, where the kernels
    # scale; that row gives -1, greedy rows divide nothing, the others draw as alone.
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    logits[1, 2:5] = 3e38
    logits[2, 7] = -3e38
    logits[3, 9] = 3e38
    kw = dict(temperature=torch.tensor([1e-3, 1e-3, 1e-3, 0.0]), top_k=None, top_p=None)
    seeds, offsets = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    out = ref.sample(logits, seeds, offsets, **kw)
    assert out.tolist()[1:] == [-1, -1, 9]
    alone = ref.sample(
        logits[:1], seeds[:1], offsets[:1], **dict(kw, temperature=kw["temperature"][:1])
    )
    assert out[0] == alone[0] >= 0
    kw["temperature"] = torch.full((4,), 0.5)  # 3e38 / 0.5 overflows too
    assert ref.sample(logits, seeds, offsets, **kw)[1:].tolist() == [-1, -1, -1]
