"""rlk.batch_invariant(): aten overrides served by the backend's batch-invariant linear.

Runs on CPU with the rlk_triton kernels under the interpreter (built with make_impl, so the
test does not need every triton op to exist yet). Shapes are chosen where stock CPU fp32
``mm`` gives different bits for a row computed alone, so the tests can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rlk

rlk_triton_backend = pytest.importorskip("rlk_triton.backend")


@pytest.fixture(scope="module")
def impl():
    return rlk_triton_backend.make_impl(rlk_triton_backend.default_table())


def _data(M=17, K=64, N=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype) / K**0.5
    b = torch.randn(N, generator=g).to(dtype)
    return x, w, b


def test_stock_mm_is_not_batch_invariant_here():
    # The precondition that makes the next test meaningful on this machine's CPU.
    x, w, _ = _data()
    assert not torch.equal(torch.mm(x[:1], w.t()), torch.mm(x, w.t())[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_addmm_linear_inside(impl, dtype):
    x, w, b = _data(dtype=dtype)
    stock = F.linear(x, w, b)
    with rlk.batch_invariant(impl):
        full = torch.mm(x, w.t())
        assert torch.equal(torch.mm(x[:1], w.t()), full[:1])
        assert torch.equal(torch.mm(x[5:9], w.t()), full[5:9])
        yb = F.linear(x, w, b)  # addmm
        assert torch.equal(F.linear(x[3:4], w, b), yb[3:4])
        # N-D input (viewed as 2-D mm), torch.matmul, mv
        y3 = F.linear(x.reshape(1, 17, 64), w)
        assert torch.equal(y3[0], full)
        assert torch.equal(x @ w.t(), full)
        assert torch.equal(torch.mv(w, x[2]), full[2])
        # addmm with a full matrix and beta/alpha: elementwise after the invariant GEMM
        r = torch.addmm(stock, x, w.t(), beta=0.5, alpha=2.0)
        assert torch.equal(torch.addmm(stock[:2], x[:2], w.t(), beta=0.5, alpha=2.0), r[:2])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(yb, stock, rtol=tol, atol=tol)


def test_bmm_inside(impl):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 9, 40, generator=g)
    c = torch.randn(3, 40, 24, generator=g)
    stock = torch.bmm(a, c)
    with rlk.batch_invariant(impl):
        full = torch.bmm(a, c)
        assert torch.equal(torch.bmm(a[:, :1], c), full[:, :1])
        assert torch.equal(torch.bmm(a[1:2], c[1:2]), full[1:2])
        assert torch.equal(a @ c, full)
    torch.testing.assert_close(full, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_reductions_inside(impl, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(11, 300, generator=g) * 3).to(dtype)
    ref = {
        "sum": x.sum(-1),
        "mean": x.mean(dim=-1, keepdim=True),
        "softmax": torch.softmax(x, -1),
        "log_softmax": F.log_softmax(x, -1),
        "log_softmax_f32": F.log_softmax(x, -1, dtype=torch.float32),
    }
    fns = {
        "sum": lambda t: t.sum(-1),
        "mean": lambda t: t.mean(dim=-1, keepdim=True),
        "softmax": lambda t: torch.softmax(t, -1),
        "log_softmax": lambda t: F.log_softmax(t, -1),
        "log_softmax_f32": lambda t: F.log_softmax(t, -1, dtype=torch.float32),
    }
    sum0 = x.sum(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with rlk.batch_invariant(impl):
        for name, fn in fns.items():
            full = fn(x)
            assert full.dtype == ref[name].dtype and full.shape == ref[name].shape, name
            for rows in ([0], [4, 5, 6], [10]):
                assert torch.equal(fn(x[rows]), full[rows]), (name, rows)
            torch.testing.assert_close(full, ref[name], rtol=tol, atol=tol, msg=name)
        # Not the last dim, integers, float64: the stock kernels, unchanged.
        assert torch.equal(x.sum(0), sum0)
        assert torch.equal(torch.arange(6).reshape(2, 3).sum(-1), torch.tensor([3, 12]))
        xd = x.double()
        assert torch.equal(xd.sum(-1), torch.ops.aten.sum.dim_IntList(xd, [-1]))


def test_autograd_through_overrides(impl):
    x, w, b = _data(M=9, K=48, N=20)
    lin = torch.nn.Linear(48, 20)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)

    def run(inp):
        inp = inp.clone().requires_grad_(True)
        lin.zero_grad()
        F.log_softmax(lin(inp), -1)[:, 3].sum().backward()
        return inp.grad, lin.weight.grad.clone(), lin.bias.grad.clone()

    stock = run(x)
    with rlk.batch_invariant(impl):
        dx, dw, db = run(x)
        dx1, _, _ = run(x[4:5])
        assert torch.equal(dx1, dx[4:5])
        again = run(x)
        assert all(torch.equal(a, b) for a, b in zip(again, (dx, dw, db), strict=True))
    for got, ref in zip((dx, dw, db), stock, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_restored_on_exit_and_nesting(impl):
    x, w, _ = _data()
    stock = torch.mm(x[:1], w.t())
    full_stock = torch.mm(x, w.t())
    with rlk.batch_invariant(impl):
        inside = torch.mm(x, w.t())
        with rlk.batch_invariant(impl):
            assert torch.equal(torch.mm(x[:1], w.t()), inside[:1])
        # The inner exit keeps the override of the outer context.
        assert torch.equal(torch.mm(x[:1], w.t()), inside[:1])
    assert torch.equal(torch.mm(x[:1], w.t()), stock)
    assert torch.equal(torch.mm(x, w.t()), full_stock)
    assert not torch.equal(torch.mm(x[:1], w.t()), full_stock[:1])
    # An exception inside still restores.
    with pytest.raises(ZeroDivisionError), rlk.batch_invariant(impl):
        raise ZeroDivisionError
    assert torch.equal(torch.mm(x[:1], w.t()), stock)


def test_selected_backend_serves():
    # backend=None: the backend rlk selects for the tensors' device (here forced to the
    # float64 reference, whose own float64 mm goes to the stock kernel).
    x, w, b = _data()
    with rlk.use_backend("reference"), rlk.batch_invariant():
        y = F.linear(x, w, b)
    assert torch.equal(y, (x.double() @ w.double().t() + b.double()).float())


def test_bad_backend_argument():
    with pytest.raises(rlk.BackendError), rlk.batch_invariant("no_such_backend"):
        pass
    with pytest.raises(TypeError), rlk.batch_invariant(42):
        pass
