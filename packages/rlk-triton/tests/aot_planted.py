"""Kernels that break the contract on purpose, for test_aot.py (imported by name, also by
``rlk aot``'s compile workers, so they live in a module of their own)."""

from __future__ import annotations

import torch

from rlk_triton._triton import jit, tl, triton


@jit
def atomic_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sums ``x`` into ``out[0]`` with a floating-point atomic: unordered, run-to-run bits."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.atomic_add(out_ptr, tl.sum(x, axis=0))


@jit
def dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]`` tile (row-major operands)."""
    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + m[:, None] * BLOCK_K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * BLOCK_N + n[None, :])
    tl.store(c_ptr + m[:, None] * BLOCK_N + n[None, :], tl.dot(a, b))


@jit
def tf32_dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    """A bf16 dot asking for TF32: Triton's HIP backend accepts that on gfx942 only."""
    i = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i[:, None] * BLOCK + i[None, :])
    b = tl.load(b_ptr + i[:, None] * BLOCK + i[None, :])
    c = tl.dot(a, b, input_precision="tf32")
    tl.store(c_ptr + i[:, None] * BLOCK + i[None, :], c)


@jit
def nvidia_only_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """Inline PTX: compiles for NVIDIA targets only."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True,
                                  pack=1)  # fmt: skip
    tl.store(x_ptr + i, y, mask=i < n)


@jit
def ptxas_error_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """Inline PTX that ptxas rejects (Triton then prints the PTX to stdout and raises)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    y = tl.inline_asm_elementwise("no_such_op.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                  is_pure=True, pack=1)  # fmt: skip
    tl.store(x_ptr + i, y, mask=i < n)


@triton.jit
def bare_kernel(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    """Built with triton.jit itself: launched with Triton's fusion default."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    y = tl.load(y_ptr + i, mask=i < n)
    tl.store(z_ptr + i, x * y + x, mask=i < n)


@jit
def mul_add_kernel(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    """``x * y + x``: one FMA where contraction is on, a multiply and an add where it is off."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    y = tl.load(y_ptr + i, mask=i < n)
    tl.store(z_ptr + i, x * y + x, mask=i < n)


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(64, generator=g),
        "a": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b": torch.randn(32, 64, generator=g).to(torch.bfloat16),
    }
