"""The ascend plugin and implementation builder on a machine without torch_npu: availability is
a reason (never a crash), torch_npu is never imported, and the opt-in fused operators are wired
as documented (checked against a stand-in module, not the real torch_npu)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import rlk
import rlk_reference
from rlk import selection
from rlk_ascend import backend, npu, plugin

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None,
    reason="these tests describe a machine without torch_npu",
)


def test_unavailable_with_a_reason_and_torch_npu_not_imported():
    ok, reason = plugin._available()
    assert not ok
    assert "torch_npu is not installed" in reason
    impl = backend.make_impl()
    assert not impl.missing()
    assert "torch_npu" not in sys.modules


def test_rlk_info_reports_ascend_unavailable():
    selection.reset_registry()
    entry = {b["name"]: b for b in _info()["backends"]}["ascend"]
    assert entry["available"] is False
    assert "torch_npu" in entry["reason"]
    assert entry["distribution"] == "rlk-ascend"


def test_a_broken_torch_npu_is_a_reason(monkeypatch, tmp_path):
    # A torch_npu whose import fails the way it does without CANN's shared libraries.
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise OSError("libascendcl.so: cannot open shared object file")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plugin._available() == (True, "")  # installed, so only loading can tell
    selection.reset_registry()
    try:
        with pytest.raises(rlk.BackendError, match="failed to load: torch_npu not importable: OSE"):
            selection.registry().load("ascend")
        entry = {b["name"]: b for b in _info()["backends"]}["ascend"]
        assert entry["available"] is False and "libascendcl.so" in entry["reason"]
    finally:
        selection.reset_registry()
    assert "torch_npu" not in sys.modules


def _info():
    from rlk import cli

    return cli.info_dict()


def test_delegated_names_the_code_of_every_op():
    impl = backend.make_impl(fused=())
    assert set(impl.delegated) == set(rlk.OPS)
    assert all("portable" in how for how in impl.delegated.values())


def test_fused_needs_torch_npu(monkeypatch):
    monkeypatch.setenv("RLK_ASCEND_FUSED", "1")
    with pytest.raises(RuntimeError, match="torch_npu is not loaded"):
        backend.make_impl()


def test_fused_env_parsing():
    assert npu.requested("") == ()
    assert npu.requested("0") == ()
    assert npu.requested("all") == tuple(npu.FUSED)
    assert npu.requested(" rms_norm, silu_and_mul ") == ("rms_norm", "silu_and_mul")
    with pytest.raises(ValueError, match="attention"):
        npu.requested("attention")


def _stand_in():
    """torch implementations of the documented torch_npu signatures and layouts."""
    calls = []

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls.append("npu_rms_norm")
        assert gamma.dtype == x.dtype
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_swiglu(x, dim=-1):
        calls.append("npu_swiglu")
        assert x.is_contiguous() and dim == -1
        a, b = x.float().chunk(2, dim=dim)
        return (torch.nn.functional.silu(a) * b).to(x.dtype)

    def npu_rotary_mul(x, r1, r2):
        calls.append("npu_rotary_mul")
        assert x.dim() == 4 and x.shape[0] == 1  # [B, S, N, D]
        assert r1.shape == (1, x.shape[1], 1, x.shape[3]) == r2.shape
        x1, x2 = x.float().chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
        return (x.float() * r1.float() + rot * r2.float()).to(x.dtype)

    mod = types.SimpleNamespace(
        npu_rms_norm=npu_rms_norm, npu_swiglu=npu_swiglu, npu_rotary_mul=npu_rotary_mul
    )
    return mod, calls


def test_fused_candidates_are_wired_as_documented():
    mod, calls = _stand_in()
    impl = backend.make_impl(npu=mod, fused=tuple(npu.FUSED))
    for op, name in npu.FUSED.items():
        assert name in impl.delegated[op] and "never checked" in impl.delegated[op]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).bfloat16()
    r = torch.randn(6, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    y, s = impl.ops["rms_norm"](x, w, 1e-6, r)
    y_ref, s_ref = rlk_reference.rms_norm(x, w, 1e-6, r)
    assert torch.equal(s, s_ref)
    assert torch.allclose(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    h = impl.ops["silu_and_mul"](x)
    assert torch.allclose(h.float(), rlk_reference.silu_and_mul(x).float(), rtol=2e-2, atol=2e-2)
    q = torch.randn(5, 3, 16, generator=g).bfloat16()
    cos = torch.randn(5, 16, generator=g).bfloat16()
    sin = torch.randn(5, 16, generator=g).bfloat16()
    o = impl.ops["apply_rotary"](q, cos, sin)
    o_ref = rlk_reference.apply_rotary(q, cos, sin)
    assert o.shape == q.shape
    assert torch.allclose(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2)
    assert calls == ["npu_rms_norm", "npu_swiglu", "npu_rotary_mul"]
    with pytest.raises(TypeError, match="unset RLK_ASCEND_FUSED"):
        impl.ops["apply_rotary"](q, cos.float(), sin.float())
