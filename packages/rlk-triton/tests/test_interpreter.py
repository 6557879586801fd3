"""The interpreter patches of :mod:`rlk_triton._interpreter`: a dot whose bits do not depend on
the host's BLAS, and no numpy floating-point warnings from inside kernels."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import rlk
from rlk_triton import _interpreter, gemm
from rlk_triton._triton import INTERPRET
from rlk_triton.backend import default_table

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton interpreter only (CPU)")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def test_ordered_dot_is_elementwise_and_accurate():
    g = np.random.default_rng(0)
    a = g.standard_normal((37, 70)).astype(np.float32)
    b = g.standard_normal((70, 23)).astype(np.float32)
    acc = g.standard_normal((37, 23)).astype(np.float32)
    full = _interpreter._ordered_dot(a, b, acc)
    ref = a.astype(np.float64) @ b.astype(np.float64) + acc
    assert np.abs(full - ref).max() < 1e-4
    # Any subset of rows and columns gives the same bits: no blocking by shape.
    part = _interpreter._ordered_dot(a[5:9], b[:, 3:4], acc[5:9, 3:4])
    assert np.array_equal(part, full[5:9, 3:4])
    batched = _interpreter._ordered_dot(np.stack([a, a]), np.stack([b, b]), np.stack([acc, acc]))
    assert np.array_equal(batched[1], full)


def test_linear_does_not_call_the_host_blas(monkeypatch):
    def no_blas(*args, **kwargs):
        raise AssertionError("numpy.matmul called from a kernel")

    monkeypatch.setattr(np, "matmul", no_blas)
    x = torch.randn(9, 40)
    w = torch.randn(24, 40)
    y = gemm.linear(x, w, None, table=default_table())
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


_FP32_BATCH_INVARIANCE = """
import torch, rlk
torch.manual_seed(99)
x = torch.randn(131, 520, dtype=torch.float32)
W = torch.randn(300, 520, dtype=torch.float32) / 23
b = torch.randn(300, dtype=torch.float32)
y = rlk.linear(x, W, b)
for lo, hi in ((57, 64), (57, 59), (0, 1), (64, 131)):
    assert torch.equal(rlk.linear(x[lo:hi].contiguous(), W, b), y[lo:hi]), (lo, hi)
print("ok")
"""


@pytest.mark.parametrize("core", ["Haswell", "Sandybridge"])
def test_fp32_linear_batch_invariant_under_each_blas_kernel(core):
    """Rows of an fp32 linear equal the full batch's under OpenBLAS's FMA (Haswell) and non-FMA
    (Sandybridge) kernels: with numpy.matmul as the dot, Haswell's blocking changed the bits."""
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("OPENBLAS_CORETYPE names x86-64 kernels")
    need = {"Haswell": {"avx2", "fma"}, "Sandybridge": {"avx"}}[core]
    if not need <= flags:
        pytest.skip(f"this CPU lacks {sorted(need - flags)} for OpenBLAS's {core} kernels")
    env = dict(os.environ, OPENBLAS_CORETYPE=core, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _FP32_BATCH_INVARIANCE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_kernels_raise_no_numpy_warnings():
    """log(0) in a kernel is -inf on a GPU without a word; the interpreter stays quiet too."""
    logits = torch.full((2, 16), float("-inf"))
    logits[:, 3] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp = rlk.logprobs(logits, torch.tensor([3, 3]))
    assert torch.equal(lp, torch.zeros(2))
