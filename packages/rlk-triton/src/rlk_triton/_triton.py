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


def jit(fn=None, **kwargs):
    """``triton.jit`` for rlk kernels: their launches default to ``enable_fp_fusion=False``.

    With fusion on, the compiler may contract ``a * b + c`` into one FMA in one variant of a
    kernel and not in another (another tile shape or warp count, the fused or the unfused path),
    which changes last bits between configs that the contract says must agree. rlk kernels write
    the FMAs they want explicitly (``tl.fma``), so contraction is off for every launch.
    """

    def wrap(f):
        kernel = triton.jit(f, **kwargs)
        run = kernel.run

        def run_without_contraction(*args, **kw):
            kw.setdefault("enable_fp_fusion", False)
            return run(*args, **kw)

        kernel.run = run_without_contraction
        return kernel

    return wrap if fn is None else wrap(fn)


__all__ = ["INTERPRET", "jit", "tl", "triton"]
