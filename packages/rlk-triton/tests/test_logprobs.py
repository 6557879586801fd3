"""logprobs kernels: accuracy and gradients vs float64, batch/tuning invariance, determinism.

V = 300 is cut into vocabulary leaves merged by a fixed tree. The fixture runs each test with
the op's constants (CHUNK, VOCAB_LEAVES) as shipped (8 leaves of 38 logits, one 64-wide chunk
each, the last leaf 34 logits) and patched to (16, 2) (two leaves of 150 logits, ten chunks
each, the last one partial, so the NSUB=4 config reads chunks past the end of a leaf).
"""

from __future__ import annotations

import pytest
import torch

import rlk_reference as ref
from rlk_triton import backend, tuning
from rlk_triton import logprobs as lpmod

TABLE = backend.default_table()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(t, v, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g) * 4).to(dtype).to(device)
    targets = torch.randint(0, v, (t,), generator=g).to(device)
    return logits, targets


def _run(logits, targets, temp=1.0, entropy=True, g_lp=None, g_ent=None):
    x = logits.clone().requires_grad_()
    out = lpmod.logprobs(x, targets, temp, entropy, table=TABLE)
    lp, ent = out if entropy else (out, None)
    if g_lp is not None:
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy else 0)
        loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), x.grad


@pytest.fixture(params=[(1024, 8), (16, 2)], ids=["leaves8", "leaves2-chunk16"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(lpmod, "CHUNK", request.param[0])
    monkeypatch.setattr(lpmod, "VOCAB_LEAVES", request.param[1])
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_accuracy_vs_float64(dtype, temp, chunk):
    logits, targets = _inputs(5, 300, dtype)
    logits[1, 3] = float("-inf")  # masked vocabulary entries must not poison the row
    lp, ent, _ = _run(logits, targets, temp)
    rlp, _ = ref.logprobs(logits, targets, temp, True)
    # -p log p with its limit 0 where p = 0 (the reference's lse - sum(p z) is NaN at -inf)
    log_p = torch.log_softmax(logits.double() / temp, -1)
    rent = -(log_p.exp() * torch.where(torch.isinf(log_p), 0.0, log_p)).sum(-1).float()
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, rlp, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(ent, rent, atol=2e-6, rtol=2e-6)
    lp2 = lpmod.logprobs(logits, targets, temp, False, table=TABLE)
    assert torch.equal(lp2, lp)  # entropy on or off: the same log-probabilities


def test_entropy_whether_or_not_the_max_moves(chunk):
    """The chunk loop skips the entropy rescale when no row's max moved: rows whose max moves
    in every chunk (ascending), in none after the first (descending), and a mix in one program,
    against float64."""
    up = torch.linspace(-20.0, 20.0, 300)
    logits = torch.stack([up, up.flip(0), up, torch.randn(300) * 4, up.flip(0)])
    targets = torch.tensor([0, 299, 150, 7, 3])
    lp, ent, _ = _run(logits, targets)
    log_p = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(lp, log_p.gather(1, targets[:, None])[:, 0].float())
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(-1).float(), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_vs_float64_autograd(dtype, chunk):
    temp = 0.8
    logits, targets = _inputs(4, 300, dtype, seed=1)
    logits[2, 5] = float("-inf")
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(4, generator=g), torch.randn(4, generator=g)
    _, _, grad = _run(logits, targets, temp, True, g_lp, g_ent)
    assert grad.dtype == dtype

    z = logits.double().requires_grad_()
    s = z / temp
    log_p = torch.log_softmax(s, -1)
    rlp = log_p.gather(1, targets[:, None])[:, 0]
    rent = -(log_p.exp() * torch.where(torch.isinf(log_p), 0.0, log_p)).sum(-1)
    ((rlp * g_lp.double()).sum() + (rent * g_ent.double()).sum()).backward()
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding of the gradient
    torch.testing.assert_close(grad.double(), z.grad, atol=tol, rtol=tol)


def test_gradient_of_logprobs_only_and_entropy_only():
    logits, targets = _inputs(3, 300, torch.float32, seed=3)
    g = torch.ones(3)
    _, _, grad = _run(logits, targets, 1.0, False, g_lp=g)
    p = torch.softmax(logits.double(), -1)
    expect = torch.nn.functional.one_hot(targets, 300).double() - p
    torch.testing.assert_close(grad.double(), expect, atol=1e-6, rtol=1e-6)
    x = logits.clone().requires_grad_()
    _, ent = lpmod.logprobs(x, targets, 1.0, True, table=TABLE)
    ent.sum().backward()  # the log-prob output gets no gradient at all
    log_p = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(
        x.grad.double(), -p * (log_p + (-(p * log_p).sum(-1, keepdim=True))), atol=1e-6, rtol=1e-6
    )


def test_temperature_one_skips_the_division_with_the_same_bits(chunk, monkeypatch):
    # The kernels skip z = x / temperature at temperature 1 (x / 1 == x in IEEE arithmetic):
    # forcing the division must give the same bits, specials and signed zeros included.
    logits, targets = _inputs(6, 300, torch.float32)
    logits[0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0])
    logits[1, 7] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 5] = 1.0
    g_lp, g_ent = torch.randn(6), torch.randn(6)
    fast = _run(logits, targets, 1.0, True, g_lp, g_ent)
    monkeypatch.setattr(lpmod, "_unit", lambda temperature: False)
    slow = _run(logits, targets, 1.0, True, g_lp, g_ent)
    for a, b in zip(fast, slow):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.signbit(), b.signbit())


def test_batch_invariance(chunk):
    logits, targets = _inputs(8, 300, torch.bfloat16, seed=4)
    g = torch.randn(8)
    lp, ent, grad = _run(logits, targets, 0.9, True, g, g)
    for rows in ([5], [6, 0, 3], [7, 1, 2, 4, 5]):
        idx = torch.tensor(rows)
        lps, ents, grads = _run(logits[idx], targets[idx], 0.9, True, g[idx], g[idx])
        assert torch.equal(lps, lp[idx])
        assert torch.equal(ents, ent[idx])
        assert torch.equal(grads, grad[idx])


def test_strided_rows_give_the_same_bits():
    logits, targets = _inputs(4, 300, torch.float32, seed=5)
    wide = torch.zeros(4, 320)
    wide[:, :300] = logits
    a = lpmod.logprobs(logits, targets, 1.0, True, table=TABLE)
    b = lpmod.logprobs(wide[:, :300], targets, 1.0, True, table=TABLE)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_determinism():
    logits, targets = _inputs(6, 300, torch.float16, seed=6)
    g = torch.randn(6)
    first = _run(logits, targets, 1.3, True, g, g)
    second = _run(logits, targets, 1.3, True, g, g)
    assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_every_tuning_config_gives_identical_bits(monkeypatch):
    monkeypatch.setattr(lpmod, "CHUNK", 16)  # leaves of 75 logits in 5 chunks: NSUB=4 folds
    monkeypatch.setattr(lpmod, "VOCAB_LEAVES", 4)  # 3 past the end of each leaf
    configs = tuning.op_configs(TABLE, "logprobs")
    assert len(configs) >= 2 and {"logprobs.fwd", "logprobs.bwd"} <= set(configs[0])
    logits, targets = _inputs(7, 300, torch.bfloat16, seed=7)
    g = torch.randn(7)
    results = []
    for cfg in configs:
        with tuning.force("logprobs", cfg):
            results.append(_run(logits, targets, 0.7, True, g, g))
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


@pytest.mark.parametrize("parts", [2, 4, 8])
@pytest.mark.parametrize("entropy", [True, False])
def test_vocabulary_split_merges_to_the_same_bits(parts, entropy):
    """What a vocabulary-parallel rank does: leaf states of its own columns, its subtree merged,
    then the parts' triples merged by the top of the tree: the one-device bits, exactly."""
    v = 320  # 8 leaves of 40 logits
    logits, targets = _inputs(6, v, torch.bfloat16, seed=8)
    want = lpmod.logprobs_forward(logits, targets, 0.8, entropy, TABLE)
    width = v // parts
    triples, zt = [], torch.zeros(6)
    for r in range(parts):
        m, s, t, z = lpmod.leaf_states(
            logits[:, r * width : (r + 1) * width], targets, 0.8, entropy, TABLE, v, r * width
        )
        triples.append(lpmod.merge_states(m, s, t, final=False))
        mine = (targets >= r * width) & (targets < (r + 1) * width)
        zt = torch.where(mine, z, zt)
    m, s, t = (torch.stack(x, 1) if x[0] is not None else None for x in zip(*triples))
    got = lpmod.merge_states(m, s, t, zt, final=True)
    for x, y in zip(got, want):
        assert (x is None and y is None) or torch.equal(x, y)


def test_vocabulary_offset_must_be_a_leaf_boundary():
    logits, targets = _inputs(2, 320, torch.float32)
    with pytest.raises(ValueError, match="leaf boundary"):
        lpmod.leaf_states(logits[:, 5:], targets, 1.0, False, TABLE, 320, 5)


def test_empty_rows():
    lp = lpmod.logprobs(
        torch.empty(0, 300), torch.empty(0, dtype=torch.int64), 1.0, False, table=TABLE
    )
    assert lp.shape == (0,) and lp.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [32000, 151936])
def test_gpu_accuracy_and_tuning_invariance(dtype, v):
    logits, targets = _inputs(64, v, dtype, device="cuda")
    g = torch.randn(64, device="cuda")
    rlp, rent = ref.logprobs(logits, targets, 0.9, True)
    results = []
    for cfg in tuning.op_configs(TABLE, "logprobs"):
        with tuning.force("logprobs", cfg):
            results.append(_run(logits, targets, 0.9, True, g, g))
    lp, ent, _ = results[0]
    torch.testing.assert_close(lp, rlp.to(lp.device), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent, rent.to(ent.device), atol=2e-5, rtol=2e-5)
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))
    idx = torch.tensor([63, 0, 17], device="cuda")
    sub = _run(logits[idx], targets[idx], 0.9, True, g[idx], g[idx])
    assert all(torch.equal(x, y[idx]) for x, y in zip(sub, results[0]))
