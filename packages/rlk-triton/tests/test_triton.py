"""The launch layer of :mod:`rlk_triton._triton`: host-side integer helpers, and the cached
launcher that must launch exactly the kernel Triton's own ``run`` would."""

from __future__ import annotations

import pytest
import torch

from rlk_triton import _triton
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl, triton


def test_int_helpers_match_triton():
    for a in range(0, 300):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_arg_key_separates_what_triton_specialises_on():
    key = _triton._arg_key
    # Ints: 1 (a constant to Triton), multiples of 16 (divisibility), and the width class.
    assert len({key(v, False) for v in (1, 2, 16, 32, 2**31, 2**63)}) == 5
    assert key(2, False) == key(3, False) and key(16, False) == key(32, False)
    assert key(2**31, False) != key(2**31 - 1, False)
    assert key(True, False) != key(1, False)
    # Tensors: dtype and 16-byte alignment of the data pointer.
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert key(x, False) == key(x[8:], False) != key(x[1:], False)
    assert key(x, False) != key(x.float(), False)
    # Constexprs: their value; anything unknown sends the launch to Triton's run.
    assert key(128, True) == 128 and key(torch.float32, True) == torch.float32
    assert key(object(), False) is _triton._MISSING
    assert key(2.5, False) == key(0.5, False) and key(None, False) is None


@jit
def _scaled_copy_kernel(x_ptr, out_ptr, n, stride, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i * stride, mask=mask)
    tl.store(out_ptr + i, x * scale, mask=mask)


def _scaled_copy(x, n, stride, scale):
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _scaled_copy_kernel[(cdiv(n, 128),)](x, out, n, stride, scale, BLOCK=128)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cached_launch_runs_the_kernel_triton_would():
    """Every specialisation Triton distinguishes (n == 1, n % 16, stride == 1, an unaligned
    pointer) gets its own entry, and a cached launch computes what Triton's run computes."""
    base = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    cases = [
        (base, 1000, 1, 2.0),
        (base, 1024, 1, 0.5),
        (base, 1, 1, 3.0),
        (base[1:], 1000, 1, 2.0),  # unaligned
        (base[8:], 1000, 3, 2.0),  # aligned, strided
    ]
    launcher = _scaled_copy_kernel.run
    launcher.cache.clear()
    try:
        for fast in (False, True, True):  # Triton's run, then a miss, then a hit, per case
            _triton.FAST_LAUNCH = fast
            for x, n, stride, scale in cases:
                got = _scaled_copy(x, n, stride, scale)
                want = (x[: n * stride : stride].float() * scale).to(x.dtype)
                assert torch.equal(got, want), (n, stride, x.data_ptr() % 16, fast)
    finally:
        _triton.FAST_LAUNCH = True
    assert len(launcher.cache) == len(cases)
