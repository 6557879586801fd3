"""rlk_triton.activation: silu_and_mul accuracy vs float64, batch and tuning invariance."""

from __future__ import annotations

import pytest
import torch

from rlk_triton import activation, backend, tuning

TABLE = backend.default_table()
# The small-shape tests run on the GPU when there is one, else under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _inputs(T, I, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, 2 * I, generator=g) * 3).to(device=device, dtype=dtype)
    dy = torch.randn(T, I, generator=g).to(device=device, dtype=dtype)
    return x, dy


def _run(x, dy):
    x = x.detach().clone().requires_grad_()
    y = activation.silu_and_mul(x, table=TABLE)
    y.backward(dy)
    return y.detach(), x.grad


def _reference(x, dy):
    x = x.detach().double().requires_grad_()
    g, u = x.chunk(2, dim=-1)
    y = torch.nn.functional.silu(g) * u
    y.backward(dy.double())
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("I", [64, 80, 128])
def test_accuracy(dtype, I):
    tol = TOL[dtype]
    for T in (1, 4, 9):
        x, dy = _inputs(T, I, dtype, seed=T)
        y, dx = _run(x, dy)
        ry, rdx = _reference(x, dy)
        assert y.shape == (T, I) and y.dtype == dtype and dx.dtype == dtype
        torch.testing.assert_close(y.double(), ry, atol=tol, rtol=tol)
        torch.testing.assert_close(dx.double(), rdx, atol=2 * tol, rtol=2 * tol)


def test_matches_rlk_reference():
    ref = pytest.importorskip("rlk_reference")
    for dtype in DTYPES:
        x, _ = _inputs(5, 80, dtype, seed=2)
        y = activation.silu_and_mul(x, table=TABLE)
        torch.testing.assert_close(y, ref.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("split", [False, True])
def test_no_grad_path_equals_autograd_path(split):
    """Without inputs that need a gradient silu_and_mul skips autograd.Function: the same
    kernel, so the same bits, on non-contiguous inputs too (every other row; gate and up as
    one tensor or as two)."""
    x, _ = _inputs(10, 80, torch.bfloat16, seed=3)
    x = x[::2]
    args = (x[:, :80], x[:, 80:]) if split else (x,)
    with torch.no_grad():
        plain = activation.silu_and_mul(*args, table=TABLE)
    leaves = [a.clone().requires_grad_() for a in args]
    recorded = activation.silu_and_mul(*leaves, table=TABLE)
    assert plain.grad_fn is None and recorded.grad_fn is not None
    assert torch.equal(plain, recorded)


def test_batch_and_tuning_invariance():
    x, dy = _inputs(9, 80, torch.bfloat16, seed=3)
    y, dx = _run(x, dy)
    for i in (0, 5, 8):
        y1, dx1 = _run(x[i : i + 1], dy[i : i + 1])
        assert torch.equal(y1, y[i : i + 1]) and torch.equal(dx1, dx[i : i + 1])
    configs = tuning.op_configs(TABLE, "silu_and_mul")
    assert len(configs) >= 2
    for cfg in configs:
        with tuning.force("silu_and_mul", cfg):
            y2, dx2 = _run(x, dy)
        assert torch.equal(y2, y) and torch.equal(dx2, dx), cfg


def test_many_column_blocks():
    # I larger than a config's block: several programs along the columns of a row.
    x, dy = _inputs(3, 1100, torch.float32, seed=4)
    with tuning.force("silu_and_mul", {"silu_and_mul.fwd": {"block": 256, "num_warps": 4}}):
        y, _ = _run(x, dy)
    ry, _ = _reference(x, dy)
    torch.testing.assert_close(y.double(), ry, atol=1e-5, rtol=1e-5)


def _pair_vs_joined(x, dy):
    """silu_and_mul(gate, up) against silu_and_mul(cat(gate, up)): output and gradients, bit
    for bit; returns the pair's results."""
    y, dx = _run(x, dy)
    i = x.shape[1] // 2
    gate = x[:, :i].contiguous().requires_grad_()
    up = x[:, i:].contiguous().requires_grad_()
    y2 = activation.silu_and_mul(gate, up, table=TABLE)
    y2.backward(dy)
    assert torch.equal(y2, y)
    assert torch.equal(gate.grad, dx[:, :i]) and torch.equal(up.grad, dx[:, i:])
    return y2.detach(), gate.grad, up.grad


def _pair_at_every_config(x, dy):
    want = _pair_vs_joined(x, dy)
    for cfg in tuning.op_configs(TABLE, "silu_and_mul"):
        with tuning.force("silu_and_mul", cfg):
            got = _pair_vs_joined(x, dy)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), cfg
    return want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gate_and_up_equal_one_tensor(dtype):
    """The two-tensor form is the one-tensor form's bits, forward and backward, at every
    config; its gradients come back as two tensors of the inputs' shape."""
    want = _pair_at_every_config(*_inputs(9, 80, dtype, seed=5))
    assert want[1].shape == want[2].shape == (9, 80)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("I", [896, 4864, 14336])
def test_gpu_gate_and_up_equal_one_tensor(I):
    _pair_at_every_config(*_inputs(2048, I, torch.bfloat16, seed=I, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("I", [896, 4864, 18944])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_invariance(I, dtype):
    x, dy = _inputs(2048, I, dtype, seed=I, device="cuda")
    y, dx = _run(x, dy)
    ry, _ = _reference(x, dy)
    torch.testing.assert_close(y.double(), ry, atol=TOL[dtype], rtol=TOL[dtype])
    for cfg in tuning.op_configs(TABLE, "silu_and_mul"):
        with tuning.force("silu_and_mul", cfg):
            y2, dx2 = _run(x, dy)
        assert torch.equal(y2, y) and torch.equal(dx2, dx), cfg
    y1, dx1 = _run(x[7:8], dy[7:8])
    assert torch.equal(y1, y[7:8]) and torch.equal(dx1, dx[7:8])
