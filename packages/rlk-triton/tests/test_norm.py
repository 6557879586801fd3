"""rlk_triton.norm: accuracy vs float64, batch/tuning/order invariance, fused == unfused."""

from __future__ import annotations

import pytest
import torch

from rlk_triton import backend, norm, tuning

TABLE = backend.default_table()
# The small-shape tests run on the GPU when there is one, else under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (forward atol/rtol, gradient atol/rtol) per dtype, vs float64.
TOL = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 4e-2),
    torch.float16: (3e-3, 6e-3),
}
EPS = 1e-6


def _inputs(T, H, dtype, residual, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).to(device=device, dtype=dtype)
    w = (1 + 0.5 * torch.randn(H, generator=g)).to(device=device, dtype=dtype)
    r = torch.randn(T, H, generator=g).to(device=device, dtype=dtype) if residual else None
    dy = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    ds = torch.randn(T, H, generator=g).to(device=device, dtype=dtype) if residual else None
    return x, w, r, dy, ds


def _run(x, w, r, dy, ds):
    """Forward and backward through the public function: (outputs, grads) detached."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
    out = norm.rms_norm(
        leaves[0], leaves[1], EPS, leaves[2] if r is not None else None, table=TABLE
    )
    outs = out if isinstance(out, tuple) else (out,)
    grads_out = (dy, ds) if r is not None else (dy,)
    torch.autograd.backward(outs, grads_out)
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _reference(x, w, r, dy, ds):
    """float64 RMSNorm of x (+ r); the rounding of s is the identity for gradients."""
    leaves = [
        t.detach().double().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())
    ]
    s = leaves[0] + leaves[2] if r is not None else leaves[0]
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * leaves[1]
    outs = (y, s) if r is not None else (y,)
    torch.autograd.backward(outs, (dy.double(), ds.double()) if r is not None else (dy.double(),))
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _close(got, want, atol, rtol, what):
    torch.testing.assert_close(
        got.double(), want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [64, 80, 128])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_accuracy(dtype, H, residual):
    fwd_tol, grad_tol = TOL[dtype]
    for T in (1, 3, 9):
        args = _inputs(T, H, dtype, residual, seed=T)
        outs, grads = _run(*args)
        ref_outs, ref_grads = _reference(*args)
        for i, (o, ro) in enumerate(zip(outs, ref_outs)):
            assert o.dtype == dtype
            _close(o, ro, fwd_tol, fwd_tol, f"output {i}")
        # dweight sums T rows: scale its tolerance with the number of rows.
        for i, (g, rg) in enumerate(zip(grads, ref_grads)):
            tol = grad_tol * (T if i == 1 else 1)
            _close(g, rg, tol, grad_tol, f"grad {i}")
        if residual:
            assert torch.equal(outs[1], args[0] + args[2])  # s is x + residual rounded once


def test_matches_rlk_reference():
    ref = pytest.importorskip("rlk_reference")
    for dtype in DTYPES:
        x, w, r, _, _ = _inputs(5, 80, dtype, True, seed=2)
        y, s = norm.rms_norm(x, w, EPS, r, table=TABLE)
        ry, rs = ref.rms_norm(x, w, EPS, r)
        assert torch.equal(s, rs)  # s is rounded once, like the reference
        tol = TOL[dtype][0]
        torch.testing.assert_close(y.double(), ry.double(), atol=tol, rtol=tol)


def test_fused_equals_unfused_bitwise():
    for dtype in DTYPES:
        for H in (64, 80):
            x, w, r, _, _ = _inputs(7, H, dtype, True, seed=H)
            y, s = norm.rms_norm(x, w, EPS, r, table=TABLE)
            y2 = norm.rms_norm(x + r, w, EPS, None, table=TABLE)
            assert torch.equal(s, x + r)
            assert torch.equal(y, y2), (dtype, H)


@pytest.mark.parametrize("residual", [False, True])
def test_no_grad_path_equals_autograd_path(residual):
    """Without inputs that need a gradient rms_norm skips autograd.Function: the same kernel,
    so the same bits, on non-contiguous inputs too (x and residual: every other row)."""
    x, w, r, _, _ = _inputs(14, 64, torch.bfloat16, residual, seed=7)
    x = x[::2]
    r = r[::2] if r is not None else None
    with torch.no_grad():
        plain = norm.rms_norm(x, w, EPS, r, table=TABLE)
    recorded = norm.rms_norm(x.clone().requires_grad_(), w, EPS, r, table=TABLE)
    plain = plain if isinstance(plain, tuple) else (plain,)
    recorded = recorded if isinstance(recorded, tuple) else (recorded,)
    assert all(o.grad_fn is None for o in plain) and recorded[0].grad_fn is not None
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
def test_heads_view_reads_in_place(monkeypatch, chunked):
    """A heads view [T, heads, D] of a wider tensor (q in a fused q/k/v product): read in place
    with no grad, copied with one, the bits of its rows' contiguous copy either way; through
    rlk.rms_norm too, which refuses other non-contiguous layouts by name."""
    import rlk

    if chunked:  # rows longer than MAX_BLOCK go through the chunked loops
        monkeypatch.setattr(norm, "MAX_BLOCK", 16)
    T, heads, D = 5, 3, 32
    x, _, _, _, _ = _inputs(T, 2 * heads * D, torch.bfloat16, False, seed=3)
    w = _inputs(1, D, torch.bfloat16, False, seed=4)[1]
    x3 = x[:, : heads * D].view(T, heads, D)
    assert not x3.is_contiguous()
    want = norm.rms_norm(x3.reshape(-1, D), w, EPS, None, table=TABLE).view(T, heads, D)
    with torch.no_grad():
        assert torch.equal(norm.rms_norm(x3, w, EPS, None, table=TABLE), want)
        got = rlk.rms_norm(x.view(1, T, -1)[..., : heads * D].view(1, T, heads, D), w, EPS)
        assert got.shape == (1, T, heads, D) and torch.equal(got[0], want)
    leaf = x.clone().requires_grad_()
    y = norm.rms_norm(leaf[:, : heads * D].view(T, heads, D), w, EPS, None, table=TABLE)
    assert y.grad_fn is not None and torch.equal(y, want)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rlk.rms_norm(x3.transpose(1, 2), w[:heads], EPS)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rlk.rms_norm(x3, w, EPS, residual=torch.zeros_like(x3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_invariance(dtype):
    T, H = 9, 80
    args = _inputs(T, H, dtype, True, seed=1)
    outs, grads = _run(*args)
    for i in (0, 4, 8):
        one = [None if t is None else (t if t.dim() == 1 else t[i : i + 1]) for t in args]
        o1, g1 = _run(*one)
        assert torch.equal(o1[0], outs[0][i : i + 1]) and torch.equal(o1[1], outs[1][i : i + 1])
        assert torch.equal(g1[0], grads[0][i : i + 1])  # dx (== dresidual)
        assert torch.equal(g1[2], grads[2][i : i + 1])
    # A row's result must not depend on its neighbours either.
    x, w, r, dy, ds = args
    x2 = x.clone()
    x2[1:] = torch.randn(T - 1, H).to(DEVICE, dtype) * 100
    o2, g2 = _run(x2, w, r, dy, ds)
    assert torch.equal(o2[0][0], outs[0][0]) and torch.equal(g2[0][0], grads[0][0])


def test_non_finite_neighbours_keep_bits():
    # A tile with a non-finite term takes the masked branch of _exact_sum (and one with an
    # overflowing sum of squares the rescue); finite rows in it must get the bits they get alone,
    # where the tile is all finite and takes the unmasked branch.
    T, H = 6, 80
    for dtype in (torch.float32, torch.bfloat16):
        x, w, _, dy, _ = _inputs(T, H, dtype, False, seed=9)
        x[1, 7] = float("nan")
        x[3, 2] = float("inf")
        if dtype == torch.float32:
            x[4] = x[4] * 1e30  # squares overflow fp32: the rescued row
        outs, grads = _run(x, w, None, dy, None)
        for i in (0, 2, 4, 5):
            o1, g1 = _run(x[i : i + 1], w, None, dy[i : i + 1], None)
            assert torch.equal(o1[0], outs[0][i : i + 1]), (dtype, i)
            assert torch.equal(g1[0], grads[0][i : i + 1]), (dtype, i)


def _tree_permutation(H: int, seed: int) -> torch.Tensor:
    # Column permutations under which the row sums keep their bits: the groups of
    # 2**PAIR_LEVELS columns in any order (their sums are added exactly), and inside a group
    # the two halves of any level swapped (each tree node adds two operands, which commute).
    gen = torch.Generator().manual_seed(seed)
    size = 1 << norm.PAIR_LEVELS
    groups = torch.randperm(H // size, generator=gen)
    flips = torch.randint(0, size, (H // size,), generator=gen)
    inner = torch.arange(size)
    return torch.cat([g * size + (inner ^ f) for g, f in zip(groups.tolist(), flips.tolist())])


def test_reduction_order_free():
    # Permuting the columns of x and weight by a permutation that keeps the pair tree permutes
    # y and the gradients bit for bit: the groups' sums do not depend on the order in which
    # they are added (a plain fp32 tl.sum's would), nor a pair's on which operand comes first.
    # (In fp32, a plain tl.sum changes 7 of these 32 rows under the interpreter.)
    T, H = 32, 128
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, _, dy, _ = _inputs(T, H, dtype, False, seed=5)
        scale = 10 ** (torch.rand(T, H, generator=gen) * 2 - 1)  # magnitudes over 2 decades
        x = (x.float() * scale.to(DEVICE)).to(dtype)
        perm = _tree_permutation(H, seed=0).to(DEVICE)
        outs, grads = _run(x, w, None, dy, None)
        p_outs, p_grads = _run(x[:, perm], w[perm], None, dy[:, perm], None)
        assert torch.equal(p_outs[0], outs[0][:, perm])
        assert torch.equal(p_grads[0], grads[0][:, perm])
        assert torch.equal(p_grads[1], grads[1][perm])


@pytest.mark.parametrize("T", [9, 69])
def test_tuning_invariance(T):
    # 69 rows: three dweight partials, the last one partial.
    args = _inputs(T, 80, torch.bfloat16, True, seed=3)
    outs, grads = _run(*args)
    configs = tuning.op_configs(TABLE, "rms_norm")
    assert len(configs) >= 2
    for cfg in configs:
        with tuning.force("rms_norm", cfg):
            o, g = _run(*args)
        assert all(torch.equal(a, b) for a, b in zip(o, outs)), cfg
        assert all(torch.equal(a, b) for a, b in zip(g, grads)), cfg


def test_weight_grad_many_blocks_deterministic():
    # More rows than _dw_rows(H) * DW_GROUP: two levels of partial sums.
    H = 64
    T = norm._dw_rows(norm._block(H)) * norm.DW_GROUP + 3
    args = _inputs(T, H, torch.float32, False, seed=7)
    _, g1 = _run(*args)
    _, g2 = _run(*args)
    assert torch.equal(g1[1], g2[1])
    _, ref = _reference(*args)
    _close(g1[1], ref[1], 1e-3, 1e-4, "dweight")


@pytest.mark.parametrize("n", [65, 200, 1024, 1025])
def test_two_levels_in_one_launch_equal_a_launch_per_level(monkeypatch, n):
    """The dweight partials summed with both levels in one launch give the bits of a launch
    per level, non-finite and huge partials included (n partials: 2, 4, 16 and 17 groups, the
    last beyond the one-launch limit either way)."""
    g = torch.Generator().manual_seed(n)
    part = torch.randn(n, 96, generator=g) * 10.0 ** torch.randint(-30, 30, (n, 96), generator=g)
    part[3, 5], part[n - 1, 7], part[n // 2, 7] = float("inf"), float("nan"), 3e38
    part = part.to(DEVICE)
    both = norm._sum_partials(part, torch.bfloat16, TABLE)
    monkeypatch.setattr(norm, "TWO_LEVELS_MAX_GROUPS", 1)
    per_level = norm._sum_partials(part, torch.bfloat16, TABLE)
    assert torch.equal(both.view(torch.int16), per_level.view(torch.int16))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_chunked_rows(monkeypatch, residual):
    # Rows longer than MAX_BLOCK go through the chunked kernels; shrink it to test them here.
    monkeypatch.setattr(norm, "MAX_BLOCK", 32)
    args = _inputs(5, 80, torch.float32, residual, seed=11)
    outs, grads = _run(*args)
    ref_outs, ref_grads = _reference(*args)
    for o, ro in zip(outs, ref_outs):
        _close(o, ro, 1e-5, 1e-5, "output")
    for g, rg in zip(grads, ref_grads):
        _close(g, rg, 1e-4, 1e-4, "grad")
    o1, g1 = _run(*[None if t is None else (t if t.dim() == 1 else t[2:3]) for t in args])
    assert torch.equal(o1[0], outs[0][2:3]) and torch.equal(g1[0], grads[0][2:3])


def test_special_values():
    H = 64
    x = torch.randn(3, H, device=DEVICE)
    x[0] = 0.0
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    w = torch.ones(H, device=DEVICE)
    y = norm.rms_norm(x, w, EPS, None, table=TABLE)
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    assert y[1].isnan().any() and y[2].isnan().all()
    # Extreme but finite rows: the fixed-point scaling must cover fp32's whole exponent range,
    # and rows whose squares overflow fp32 (1e19 and above) still give the float64 answer.
    g = torch.Generator().manual_seed(0)
    for scale, eps in ((1e-18, 1e-45), (1e17, 1e-6), (1e19, 1e-6), (1e30, 1e-6), (1e38, 1e-6)):
        # |x| <= 3 * scale: at 1e38 a larger draw would not fit fp32 (its max is 3.4e38).
        x = torch.randn(2, H, dtype=torch.float64, generator=g).clamp(-3, 3).to(DEVICE) * scale
        x[1] = x[1] / scale  # an ordinary row beside the extreme one
        y = norm.rms_norm(x.float(), w, eps, None, table=TABLE)
        want = x.float().double()
        want = want / (want.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5, msg=str(scale))
    # Long rows (summed in chunks) too.
    x = torch.randn(2, norm.MAX_BLOCK + 5, dtype=torch.float64, generator=g).to(DEVICE) * 1e30
    y = norm.rms_norm(x.float(), torch.ones(x.shape[1], device=DEVICE), 1e-6, None, table=TABLE)
    want = x.float().double()
    want = want / want.pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [896, 2048, 4096, 8192, 12288])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_invariance(H, dtype):
    T = 4096
    args = _inputs(T, H, dtype, True, seed=H, device="cuda")
    outs, grads = _run(*args)
    ref_outs, ref_grads = _reference(*args)
    _close(outs[0], ref_outs[0], TOL[dtype][0], TOL[dtype][0], "y")
    for cfg in tuning.op_configs(TABLE, "rms_norm"):
        with tuning.force("rms_norm", cfg):
            o, g = _run(*args)
        assert all(torch.equal(a, b) for a, b in zip(o, outs)), cfg
        assert all(torch.equal(a, b) for a, b in zip(g, grads)), cfg
    idx = torch.tensor([0, 1, 777, T - 1], device="cuda")
    sub = [None if t is None else (t if t.dim() == 1 else t[idx].contiguous()) for t in args]
    o1, g1 = _run(*sub)
    assert torch.equal(o1[0], outs[0][idx]) and torch.equal(g1[0], grads[0][idx])
    # Misaligned views must not change the bits either.
    x, w, r, _, _ = args
    xv = x.view(-1)[1 : 1 + 3 * H].view(3, H)
    rv = r.view(-1)[1 : 1 + 3 * H].view(3, H)
    y, _ = norm.rms_norm(xv, w, EPS, rv, table=TABLE)
    assert torch.equal(y, norm.rms_norm(xv.clone() + rv.clone(), w, EPS, None, table=TABLE))
    assert torch.equal(norm.rms_norm(x + r, w, EPS, None, table=TABLE), outs[0])
