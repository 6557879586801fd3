"""Import triton for the kernel modules, after choosing compiled or interpreted execution.

Triton decides at decoration time whether a kernel is compiled or interpreted, so this must run
before any ``@triton.jit``: kernel modules write ``from rlk_triton._triton import tl, triton``.
"""

from __future__ import annotations

import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    if "triton.language" in sys.modules:
        # Triton's own library functions (tl.sum, ...) were decorated for compiled execution
        # when something imported triton first; interpreted kernels would then fail deep inside.
        raise ImportError(
            "rlk's Triton kernels run under Triton's CPU interpreter on this machine (no GPU), "
            "but triton was imported before rlk could enable it. Set TRITON_INTERPRET=1 in the "
            "environment, or import rlk before any module that imports triton."
        )
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if INTERPRET:
    from rlk_triton import _interpreter

    _interpreter.patch()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: ``triton.cdiv`` without its per-call constexpr wrapping."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (0 for ``n`` <= 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


#: Launch compiled kernels through :class:`_Launcher`'s cache (True), or through Triton's own
#: ``run`` every time (False: slower on the host, the same kernels and bits).
FAST_LAUNCH = True

_MISSING = object()

#: Under the interpreter, called as ``LAUNCH_RECORDER(kernel, args, kwargs)`` before each launch
#: of a kernel built by :func:`jit` (``kwargs`` with the launch options); a true result skips
#: the launch. How ``rlk aot`` (:mod:`rlk_triton.aot`) learns the arguments and options rlk
#: launches each kernel with.
LAUNCH_RECORDER = None


def _arg_key(value, const: bool):
    """What Triton compiles ``value`` into: a constexpr's value; a tensor's dtype, 16-byte
    alignment and whether it is on the GPU; an int's width class, ``== 1`` and divisibility by
    16; a float's or a bool's type. ``_MISSING`` for anything else (the launch then goes through
    Triton's ``run``)."""
    if const:
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0, value.is_cuda)
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, int):
        return _int_spec(value)
    if isinstance(value, float):
        return float
    if value is None:
        return None
    return _MISSING


_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Specialisations of the ints seen so far (launch arguments repeat: shapes, strides).
_INT_SPEC: dict[int, tuple] = {}


def _int_spec(value: int) -> tuple:
    spec = (-(2**31) <= value < 2**31, value >= 2**63, value == 1, value % 16 == 0)
    if len(_INT_SPEC) > 65536:  # bound the memo; it only saves a few comparisons
        _INT_SPEC.clear()
    _INT_SPEC[value] = spec
    return spec


class _Launcher:
    """``kernel.run`` with a cache in front: the second launch of a kernel with the same
    specialisation calls the compiled kernel's launcher directly.

    Triton's ``run`` binds and specialises every argument, hashes the options and looks the
    kernel up on each call; for the short kernels of a training step that host work takes
    longer than the kernel itself. The cache key holds everything Triton specialises on (see
    :func:`_arg_key`) plus the launch options and the device, so a hit launches exactly the
    kernel that Triton's ``run`` would have chosen; a miss, a callable grid, a warmup or an
    installed launch hook (a profiler such as proton) go through Triton's ``run``.
    """

    def __init__(self, kernel):
        self.triton_run = kernel.run
        names = tuple(p.name for p in kernel.params)
        self.const = tuple(p.is_constexpr for p in kernel.params)
        defaults = tuple(p.default if p.has_default else _MISSING for p in kernel.params)
        self.count = len(names)
        # The parameters after the first n positional ones, with their defaults, for every n.
        self.tails = [tuple(zip(names[n:], defaults[n:])) for n in range(self.count + 1)]
        # Run-time (not constexpr) parameters: given by keyword, they take Triton's run (the
        # key below takes keyword arguments by value, right for constexprs and options only).
        self.runtime = frozenset(n for n, c in zip(names, self.const) if not c)
        self.cache = {}

    def __call__(self, *args, grid, warmup=False, **kw):
        kw.setdefault("enable_fp_fusion", False)
        rt = triton.knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if (
            warmup
            or not FAST_LAUNCH
            or callable(grid)
            or (enter is not None and getattr(enter, "calls", True))
            or (leave is not None and getattr(leave, "calls", True))
            or not self.runtime.isdisjoint(kw)
        ):
            return self.triton_run(*args, grid=grid, warmup=warmup, **kw)
        # The launcher takes a pointer given as an int as it is; for a tensor it calls
        # data_ptr() and asks the driver whether the pointer is device memory
        # (cuPointerGetAttribute), a few us per argument. The key holds is_cuda, so a CPU
        # tensor never gets here: its miss raises in Triton's run.
        ptrs = [v.data_ptr() if type(v) in _TENSORS else v for v in args]
        # The key: the device (torch.cuda.current_device() less its lazy-init check: a CUDA
        # tensor is here, so CUDA is initialised), the keyword arguments (constexprs and launch
        # options, by value), then what Triton specialises each positional argument on.
        # Parameters left to their defaults are the same at every call.
        key = (
            torch._C._cuda_getDevice(),
            *kw.items(),
            *[
                v if c else (
                    (v.dtype, p & 15 == 0, v.is_cuda) if type(v) in _TENSORS
                    else _INT_SPEC.get(v) or _int_spec(v) if type(v) is int
                    else _arg_key(v, False)
                )
                for v, p, c in zip(args, ptrs, self.const)
            ],
        )  # fmt: skip
        if _MISSING in key:
            return self.triton_run(*args, grid=grid, warmup=warmup, **kw)
        try:
            hit = self.cache.get(key)
        except TypeError:  # an unhashable constexpr
            return self.triton_run(*args, grid=grid, warmup=warmup, **kw)
        n = len(args)
        if n < self.count:
            ptrs += [kw.get(name, d) for name, d in self.tails[n]]
        if hit is None:
            kernel = self.triton_run(*args, grid=grid, warmup=warmup, **kw)
            if kernel is not None:
                self.cache[key] = kernel
            return kernel
        # What Triton's run does once the kernel is found (no launch hooks installed).
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        hit.run(grid[0], g1, g2, stream, hit.function, hit.packed_metadata, None, None, None,
                *ptrs)  # fmt: skip
        return hit


def jit(fn=None, **kwargs):
    """``triton.jit`` for rlk kernels: their launches default to ``enable_fp_fusion=False``,
    and compiled launches go through :class:`_Launcher`.

    With fusion on, the compiler may contract ``a * b + c`` into one FMA in one variant of a
    kernel and not in another (another tile shape or warp count, the fused or the unfused path),
    which changes last bits between configs that the contract says must agree. rlk kernels write
    the FMAs they want explicitly (``tl.fma``), so contraction is off for every launch.
    """

    def wrap(f):
        kernel = triton.jit(f, **kwargs)
        # The mark of a kernel built here (a test fails on any rlk kernel without it: a bare
        # triton.jit would take Triton's fusion default, which changes in Triton 3.10).
        kernel.rlk_jit = True
        if INTERPRET:
            run = kernel.run

            def run_without_contraction(*args, **kw):
                kw.setdefault("enable_fp_fusion", False)
                if LAUNCH_RECORDER is not None:
                    launch = {k: v for k, v in kw.items() if k not in ("grid", "warmup")}
                    if LAUNCH_RECORDER(kernel, args, launch):
                        return None
                return run(*args, **kw)

            kernel.run = run_without_contraction
        else:
            kernel.run = _Launcher(kernel)
        return kernel

    return wrap if fn is None else wrap(fn)


__all__ = [
    "FAST_LAUNCH",
    "INTERPRET",
    "LAUNCH_RECORDER",
    "cdiv",
    "jit",
    "next_power_of_2",
    "tl",
    "triton",
]
