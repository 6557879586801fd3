import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import rlk_reference as ref

LOW = [torch.bfloat16, torch.float16, torch.float32]


def _randn(*shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def test_all_ops_exported():
    # That these are exactly the ops of rlk's catalog is checked by rlk-api's test_catalog.py
    # (rlk-reference does not depend on rlk).
    assert len(ref.__all__) == len(set(ref.__all__)) > 0
    for op in ref.__all__:
        assert callable(getattr(ref, op))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(dtype, with_bias):
    torch.manual_seed(0)
    x, w = _randn(7, 33).to(dtype), _randn(19, 33).to(dtype)
    b = _randn(19).to(dtype) if with_bias else None
    y = ref.linear(x, w, b, table=None)
    assert y.dtype == dtype and y.shape == (7, 19)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert torch.equal(y, want.to(dtype))


@pytest.mark.parametrize("dtype", LOW)
def test_rms_norm(dtype):
    torch.manual_seed(1)
    x, w = _randn(5, 48).to(dtype), _randn(48).to(dtype)
    y = ref.rms_norm(x, w, 1e-5, None)
    want = F.rms_norm(x.double(), (48,), w.double(), 1e-5)
    assert y.dtype == dtype
    assert torch.equal(y, want.to(dtype))


@pytest.mark.parametrize("dtype", LOW + [torch.float64])
def test_rms_norm_residual_equals_unfused(dtype):
    torch.manual_seed(2)
    x, r, w = _randn(6, 40).to(dtype), _randn(6, 40).to(dtype), _randn(40).to(dtype)
    y, s = ref.rms_norm(x, w, 1e-6, r)
    s_unfused = x + r  # torch rounds the exact sum once, like the oracle
    assert s.dtype == dtype and torch.equal(s, s_unfused)
    assert torch.equal(y, ref.rms_norm(s_unfused, w, 1e-6, None))


def test_rms_norm_residual_gradient_reaches_both_inputs():
    torch.manual_seed(3)
    x, r = _randn(4, 16, requires_grad=True), _randn(4, 16, requires_grad=True)
    w = _randn(16, requires_grad=True)
    assert gradcheck(lambda x, r, w: ref.rms_norm(x, w, 1e-6, r), (x, r, w))
    # In low precision the rounding of s is the identity for autograd: dx == dr.
    xb = x.detach().bfloat16().requires_grad_()
    rb = r.detach().bfloat16().requires_grad_()
    y, s = ref.rms_norm(xb, w.detach().bfloat16(), 1e-6, rb)
    (y.float().square().sum() + s.float().sum()).backward()
    assert xb.grad is not None and torch.equal(xb.grad, rb.grad)


def test_rms_norm_gradcheck():
    x, w = _randn(3, 10, requires_grad=True), _randn(10, requires_grad=True)
    assert gradcheck(lambda x, w: ref.rms_norm(x, w, 1e-6, None), (x, w))


@pytest.mark.parametrize("dtype", LOW)
def test_silu_and_mul(dtype):
    torch.manual_seed(4)
    x = _randn(5, 2 * 24).to(dtype)
    y = ref.silu_and_mul(x)
    want = F.silu(x.double()[:, :24]) * x.double()[:, 24:]
    assert y.dtype == dtype and y.shape == (5, 24)
    assert torch.equal(y, want.to(dtype))


def test_silu_and_mul_gradcheck():
    assert gradcheck(ref.silu_and_mul, (_randn(3, 8, requires_grad=True),))


@pytest.mark.parametrize("dtype,cs_dtype", [(torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float16),
                                            (torch.float32, torch.float32)])  # fmt: skip
def test_apply_rotary_pairwise(dtype, cs_dtype):
    torch.manual_seed(5)
    T, H, D = 6, 3, 16
    x = _randn(T, H, D).to(dtype)
    angle = torch.rand(T, D // 2, dtype=torch.float64) * 6
    angle = torch.cat([angle, angle], dim=-1)
    cos, sin = angle.cos().to(cs_dtype), angle.sin().to(cs_dtype)
    y = ref.apply_rotary(x, cos, sin)
    assert y.dtype == dtype
    # Independent formula: rotate the pair (i, i + D/2) by the angle of each half.
    xd, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    h = D // 2
    want = torch.empty_like(xd)
    want[..., :h] = xd[..., :h] * c[..., :h] - xd[..., h:] * s[..., :h]
    want[..., h:] = xd[..., h:] * c[..., h:] + xd[..., :h] * s[..., h:]
    assert torch.equal(y, want.to(dtype))


def test_apply_rotary_gradcheck():
    x = _randn(3, 2, 8, requires_grad=True)
    cos, sin = _randn(3, 8), _randn(3, 8)
    assert gradcheck(lambda x: ref.apply_rotary(x, cos, sin), (x,))


def test_linear_gradcheck():
    x, w, b = (_randn(4, 6, requires_grad=True), _randn(5, 6, requires_grad=True),
               _randn(5, requires_grad=True))  # fmt: skip
    assert gradcheck(ref.linear, (x, w, b))


def test_through_public_api():
    import rlk

    torch.manual_seed(6)
    x, w = _randn(2, 3, 8).float(), _randn(4, 8).float()
    with rlk.use_backend("reference"):
        y = rlk.linear(x, w)
    assert torch.equal(y, F.linear(x.double(), w.double()).float())
