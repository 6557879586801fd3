"""GEMM: ``rlk.linear`` against cuBLAS (``torch.nn.functional.linear``), bf16.

Shapes are the projections of Llama-3-8B and Qwen2-0.5B at the M of decode (1-256 running
requests) and of prefill / training (1024-16384 tokens), and two projections no launch config
was chosen on (Qwen2.5-7B's fused qkv, Qwen3-4B's down): the choice must generalise.
``x [M, K] @ W[N, K].T``; TFLOP/s counts ``2 M N K``. Where one weight fits in the 60 MB L2,
each timed call runs the product over several distinct weights (their sum far above L2), so
that W is read from memory as in a model, and ``ms`` is per product. Forward + backward (dX
and dW) at M = 8192 for the two MLP projections.

Rows are GPU time, timed as CUDA graphs (``rlk.bench.timing``), as a decode loop runs in a
serving engine. The host's cost of a launch is its own row, ``linear.eager_call``: the wall time
per call of back-to-back eager calls at M = 1 (the first shape), host and launch included.
"""

from __future__ import annotations

import math

import torch

import rlk
from rlk.bench import timing as _timing

# (name, K, N)
SHAPES = [
    ("o_proj", 4096, 4096),
    ("up", 4096, 14336),
    ("down", 14336, 4096),
    ("qwen2-0.5b up", 896, 4864),
    ("lm_head", 4096, 151936),
    ("qwen2.5-7b qkv, held out", 3584, 4608),
    ("qwen3-4b down, held out", 9728, 2560),
]
MS = [1, 16, 64, 256, 1024, 4096, 16384]
QUICK_SHAPES = [SHAPES[0], SHAPES[2]]
QUICK_MS = [1, 64, 4096]
#: Forward + backward shapes (name, M, K, N).
BACKWARD = [("up", 8192, 4096, 14336), ("down", 8192, 14336, 4096)]
#: Bytes of weights one timed call streams at least (a multiple of the 60 MB L2).
STREAM_BYTES = 256 << 20


def _copies(n_bytes: int) -> int:
    return max(1, min(16, math.ceil(STREAM_BYTES / n_bytes)))


def _forward_rows(name: str, M: int, K: int, N: int, emit) -> None:
    dev, dt = _timing.DEVICE, torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt)
    n = _copies(N * K * 2) if M <= 256 else 1
    ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(n)]
    shape = f"M={M} K={K} N={N} ({name})"
    flops = 2 * M * N * K
    nbytes = (M * K + N * K + M * N) * 2
    for impl, op in (("rlk", rlk.linear), ("cublas", torch.nn.functional.linear)):
        ms, how = _timing.time_call(lambda op=op: [op(x, w) for w in ws])
        emit(
            _timing.row(
                "linear.fwd", shape, "bf16", impl, ms / n, timing=how, flops=flops, nbytes=nbytes
            )
        )


def _eager_rows(name: str, K: int, N: int, emit) -> None:
    dev, dt = _timing.DEVICE, torch.bfloat16
    x = torch.randn(1, K, device=dev, dtype=dt)
    w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    shape = f"M=1 K={K} N={N} ({name})"
    for impl, op in (("rlk", rlk.linear), ("cublas", torch.nn.functional.linear)):
        us = _timing.eager_call_us(lambda op=op: op(x, w))
        emit(_timing.row("linear.eager_call", shape, "bf16", impl, us / 1e3, timing="wall", us=us))


def _backward_rows(name: str, M: int, K: int, N: int, emit) -> None:
    dev, dt = _timing.DEVICE, torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(N, K, device=dev, dtype=dt) / K**0.5).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=dt)
    shape = f"M={M} K={K} N={N} ({name})"
    for impl, op in (("rlk", rlk.linear), ("cublas", torch.nn.functional.linear)):

        def step(op=op):
            return torch.autograd.grad(op(x, w), (x, w), dy)

        emit(_timing.timed("linear.fwd+bwd", shape, "bf16", impl, step, flops=3 * 2 * M * N * K))


def run(quick: bool, emit) -> None:
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if quick else (SHAPES, MS)
    for name, K, N in shapes:
        for M in ms:
            _forward_rows(name, M, K, N, emit)
    _eager_rows(*shapes[0], emit)
    for name, M, K, N in BACKWARD[:1] if quick else BACKWARD:
        _backward_rows(name, M, K, N, emit)
