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


def _probe(x_ptr, out_ptr, n, stride, scale, BLOCK: tl.constexpr = 64, FLAG: tl.constexpr = 0):
    pass


class _Compiled:
    """A stand-in for a compiled kernel: records what its launcher is given."""

    function, packed_metadata = 7, (4, 1, 0)

    def __init__(self, calls):
        self.calls = calls

    @property
    def run(self):
        return lambda *a: self.calls.append(a)


def _launcher(monkeypatch):
    """A _Launcher over a compiled-mode JITFunction, with Triton's run and the CUDA calls
    replaced by recorders, so that its cache logic runs on a CPU."""
    from triton.runtime.jit import JITFunction

    launches, misses = [], []
    launcher = _triton._Launcher(JITFunction(_probe))

    def triton_run(*args, grid, warmup, **kw):
        misses.append((args, kw))
        return _Compiled(launches)

    launcher.triton_run = triton_run
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 99, raising=False)
    return launcher, launches, misses


def test_launch_cache_hits_and_misses(monkeypatch):
    launcher, launches, misses = _launcher(monkeypatch)
    x = torch.zeros(64, dtype=torch.bfloat16)
    out = torch.zeros(64, dtype=torch.bfloat16)
    launcher(x, out, 48, 1, 2.0, grid=(3,), BLOCK=64)
    assert len(misses) == 1 and not launches  # the first launch is Triton's
    launcher(x, out, 32, 1, 0.5, grid=(3, 2), BLOCK=64)  # same specialisation
    assert len(misses) == 1 and len(launches) == 1
    grid0, grid1, grid2, stream, function, meta, lmeta, enter, leave, *args = launches[0]
    assert (grid0, grid1, grid2, stream, function) == (3, 2, 1, 99, 7)
    assert (lmeta, enter, leave) == (None, None, None)
    # Every parameter in order: tensors as their pointers, defaults filled in.
    assert args == [x.data_ptr(), out.data_ptr(), 32, 1, 0.5, 64, 0]
    # What Triton specialises on is a new entry: n % 16, stride == 1, alignment, a constexpr.
    for call in (
        lambda: launcher(x, out, 33, 1, 2.0, grid=(3,), BLOCK=64),
        lambda: launcher(x, out, 48, 2, 2.0, grid=(3,), BLOCK=64),
        lambda: launcher(x[1:], out, 48, 1, 2.0, grid=(3,), BLOCK=64),
        lambda: launcher(x, out, 48, 1, 2.0, grid=(3,), BLOCK=128),
        lambda: launcher(x, out, 48, 1, 2.0, grid=(3,), BLOCK=64, num_warps=8),
    ):
        before = len(misses)
        call()
        assert len(misses) == before + 1
    assert len(launcher.cache) == 6
    # A run-time parameter by keyword, a callable grid, a warmup: Triton's run, every time.
    for call in (
        lambda: launcher(x, out, 48, 1, scale=2.0, grid=(3,), BLOCK=64),
        lambda: launcher(x, out, 48, 1, 2.0, grid=lambda meta: (3,), BLOCK=64),
        lambda: launcher(x, out, 48, 1, 2.0, grid=(3,), warmup=True, BLOCK=64),
    ):
        before = len(misses)
        call()
        call()
        assert len(misses) == before + 2
    assert all(kw["enable_fp_fusion"] is False for _, kw in misses)


def test_launch_cache_steps_aside_for_launch_hooks(monkeypatch):
    launcher, launches, misses = _launcher(monkeypatch)
    x = torch.zeros(64)
    launcher(x, x, 48, 1, 2.0, grid=(1,))
    launcher(x, x, 48, 1, 2.0, grid=(1,))
    assert (len(misses), len(launches)) == (1, 1)
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a hook chain
        probe = lambda *a: None  # noqa: E731
        hook.add(probe)
        try:
            launcher(x, x, 48, 1, 2.0, grid=(1,))
        finally:
            hook.remove(probe)
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
        launcher(x, x, 48, 1, 2.0, grid=(1,))
    assert (len(misses), len(launches)) == (2, 1)


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
