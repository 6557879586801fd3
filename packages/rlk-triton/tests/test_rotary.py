"""rlk_triton.rotary: apply_rotary accuracy vs float64, batch and tuning invariance."""

from __future__ import annotations

import pytest
import torch

from rlk_triton import backend, rotary, tuning

TABLE = backend.default_table()
# The small-shape tests run on the GPU when there is one, else under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _inputs(T, NH, D, dtype, cs_dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, NH, D, generator=g).to(device=device, dtype=dtype)
    pos = torch.arange(T, dtype=torch.float64)[:, None] * 0.37
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)
    cos = ang.cos().to(device=device, dtype=cs_dtype)
    sin = ang.sin().to(device=device, dtype=cs_dtype)
    dy = torch.randn(T, NH, D, generator=g).to(device=device, dtype=dtype)
    return x, cos, sin, dy


def _run(x, cos, sin, dy, cs_grad=False):
    x = x.detach().clone().requires_grad_()
    cos = cos.detach().clone().requires_grad_(cs_grad)
    sin = sin.detach().clone().requires_grad_(cs_grad)
    y = rotary.apply_rotary(x, cos, sin, table=TABLE)
    y.backward(dy)
    return y.detach(), x.grad, cos.grad, sin.grad


def _reference(x, cos, sin, dy):
    x, cos, sin = (t.detach().double().requires_grad_() for t in (x, cos, sin))
    x1, x2 = x.chunk(2, dim=-1)
    y = x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]
    y.backward(dy.double())
    return y.detach(), x.grad, cos.grad, sin.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cs_fp32", [True, False], ids=["cs_fp32", "cs_xdtype"])
@pytest.mark.parametrize("D", [64, 80, 128])
def test_accuracy(dtype, cs_fp32, D):
    tol = TOL[dtype]
    cs_dtype = torch.float32 if cs_fp32 else dtype
    for T, NH in ((1, 1), (5, 3), (9, 2)):
        args = _inputs(T, NH, D, dtype, cs_dtype, seed=T)
        got = _run(*args, cs_grad=True)
        want = _reference(*args)
        for name, g, w in zip(("y", "dx", "dcos", "dsin"), got, want):
            ref_dtype = cs_dtype if name in ("dcos", "dsin") else dtype
            assert g.dtype == ref_dtype, name
            scale = NH if name in ("dcos", "dsin") else 1  # sums over heads
            torch.testing.assert_close(
                g.double(), w, atol=tol * scale, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_matches_torch_formula_fp32():
    # fp32 in, fp32 out: the kernel computes x * cos + rotate_half(x) * sin.
    x, cos, sin, _ = _inputs(4, 3, 64, torch.float32, torch.float32, seed=2)
    y = rotary.apply_rotary(x, cos, sin, table=TABLE)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)


def test_matches_rlk_reference():
    ref = pytest.importorskip("rlk_reference")
    for dtype in DTYPES:
        x, cos, sin, _ = _inputs(5, 3, 80, dtype, torch.float32, seed=2)
        y = rotary.apply_rotary(x, cos, sin, table=TABLE)
        want = ref.apply_rotary(x, cos, sin)
        torch.testing.assert_close(y, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_batch_and_tuning_invariance():
    args = _inputs(9, 6, 80, torch.bfloat16, torch.float32, seed=3)
    out = _run(*args, cs_grad=True)
    x, cos, sin, dy = args
    for i in (0, 4, 8):
        one = _run(x[i : i + 1], cos[i : i + 1], sin[i : i + 1], dy[i : i + 1], cs_grad=True)
        for a, b in zip(one, out):
            assert torch.equal(a, b[i : i + 1])
    configs = tuning.op_configs(TABLE, "apply_rotary")
    assert len(configs) >= 2
    for cfg in configs:
        with tuning.force("apply_rotary", cfg):
            got = _run(*args, cs_grad=True)
        assert all(torch.equal(a, b) for a, b in zip(got, out)), cfg


@pytest.mark.parametrize("with_k", [False, True])
def test_no_grad_path_equals_autograd_path(with_k):
    """Without inputs that need a gradient apply_rotary skips autograd.Function: the same
    kernel, so the same bits, on non-contiguous inputs too (every other token)."""
    q, cos, sin, _ = _inputs(12, 4, 16, torch.bfloat16, torch.float32, seed=5)
    k, _, _, _ = _inputs(12, 2, 16, torch.bfloat16, torch.float32, seed=6)
    q, k, cos, sin = q[::2], k[::2], cos[::2], sin[::2]
    kk = k if with_k else None
    with torch.no_grad():
        plain = rotary.apply_rotary(q, cos, sin, kk, table=TABLE)
    recorded = rotary.apply_rotary(q.clone().requires_grad_(), cos, sin, kk, table=TABLE)
    plain = plain if isinstance(plain, tuple) else (plain,)
    recorded = recorded if isinstance(recorded, tuple) else (recorded,)
    assert all(o.grad_fn is None for o in plain) and recorded[0].grad_fn is not None
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))


def test_no_cos_sin_grad():
    x, cos, sin, dy = _inputs(3, 2, 64, torch.float32, torch.float32, seed=4)
    _, dx, dcos, dsin = _run(x, cos, sin, dy, cs_grad=False)
    assert dx is not None and dcos is None and dsin is None


def _pair_vs_alone(T, NH, NK, D, dtype, device=DEVICE, cs_grad=True):
    """The pair call against two calls: outputs and every gradient, bit for bit. Returns the
    pair's outputs and gradients (dq, dk, dcos, dsin)."""
    q, cos, sin, dq = _inputs(T, NH, D, dtype, torch.float32, seed=NH, device=device)
    k, _, _, dk = _inputs(T, NK, D, dtype, torch.float32, seed=NK + 100, device=device)

    def leaves():
        return [t.detach().clone().requires_grad_(g) for t, g in
                ((q, True), (k, True), (cos, cs_grad), (sin, cs_grad))]  # fmt: skip

    a = leaves()
    yq, yk = rotary.apply_rotary(a[0], a[2], a[3], a[1], table=TABLE)
    torch.autograd.backward([yq, yk], [dq, dk])
    b = leaves()
    zq = rotary.apply_rotary(b[0], b[2], b[3], table=TABLE)
    zk = rotary.apply_rotary(b[1], b[2], b[3], table=TABLE)
    torch.autograd.backward([zq, zk], [dq, dk])
    assert torch.equal(yq, zq) and torch.equal(yk, zk)
    for name, x, y in zip(("dq", "dk", "dcos", "dsin"), a, b):
        assert (x.grad is None) == (y.grad is None), name
        assert x.grad is None or torch.equal(x.grad, y.grad), name
    return (yq, yk, *(t.grad for t in a))


def _pair_at_every_config(T, NH, NK, D, device=DEVICE):
    """:func:`_pair_vs_alone` at every tuning config, each giving the default's bits."""
    want = _pair_vs_alone(T, NH, NK, D, torch.bfloat16, device=device)
    for cfg in tuning.op_configs(TABLE, "apply_rotary"):
        with tuning.force("apply_rotary", cfg):
            got = _pair_vs_alone(T, NH, NK, D, torch.bfloat16, device=device)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), cfg


@pytest.mark.parametrize("NH,NK,D", [(6, 2, 64), (3, 3, 80), (2, 5, 32), (14, 2, 64)])
def test_pair_equals_two_calls(NH, NK, D):
    """q and k rotated in one launch are bitwise what two calls give, forward and backward,
    at every tuning config (the pair's head blocks are the longer tensor's)."""
    _pair_at_every_config(9, NH, NK, D)
    _pair_vs_alone(5, NH, NK, D, torch.float32, cs_grad=False)


class _Launches:
    """Stands in for a kernel and records the grid of each launch."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_pair_is_one_launch(monkeypatch):
    launches = _Launches(rotary._rotary_kernel)
    monkeypatch.setattr(rotary, "_rotary_kernel", launches)
    q, cos, sin, _ = _inputs(4, 6, 64, torch.bfloat16, torch.float32)
    rotary.apply_rotary(q, cos, sin, q[:, :2].contiguous(), table=TABLE)
    assert len(launches.grids) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("NH,NK,D", [(32, 8, 128), (14, 2, 64), (16, 16, 128)])
def test_gpu_pair_equals_two_calls(NH, NK, D):
    _pair_at_every_config(4096, NH, NK, D, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("NH,D", [(14, 64), (16, 128), (32, 128), (40, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_invariance(NH, D, dtype):
    args = _inputs(4096, NH, D, dtype, torch.float32, seed=NH, device="cuda")
    out = _run(*args, cs_grad=True)
    want = _reference(*args)
    torch.testing.assert_close(out[0].double(), want[0], atol=TOL[dtype], rtol=TOL[dtype])
    for cfg in tuning.op_configs(TABLE, "apply_rotary"):
        with tuning.force("apply_rotary", cfg):
            got = _run(*args, cs_grad=True)
        assert all(torch.equal(a, b) for a, b in zip(got, out)), cfg
    x, cos, sin, dy = args
    one = _run(x[5:6], cos[5:6], sin[5:6], dy[5:6], cs_grad=True)
    assert all(torch.equal(a, b[5:6]) for a, b in zip(one, out))
