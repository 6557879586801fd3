"""Import triton for the kernel modules, after choosing compiled or interpreted execution.

Triton decides at decoration time whether a kernel is compiled or interpreted, so this must run
before any ``@triton.jit``: kernel modules write ``from rlk_triton._triton import tl, triton``.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if INTERPRET:
    from rlk_triton import _interpreter

    _interpreter.patch()

__all__ = ["INTERPRET", "tl", "triton"]
