"""Varlen attention with one set of numbers and a deterministic backward: the op.

``attention(q [Tq, Hq, D], k/v [Tk, Hk, D], cu_seqlens_q, cu_seqlens_k)`` -> ``[Tq, Hq, D]``.
Why every path (training, prefill, chunked prefill, decode, paged) gives the same bits is told
in :mod:`rlk_triton.attention_fwd` (the forward kernels and launcher); the backward is
:mod:`rlk_triton.attention_bwd`; the paged op, on the same forward, is
:mod:`rlk_triton.paged_attention`. This module holds the launch configs (the tuning rules: no
config changes a bit) and the public function.
"""

from __future__ import annotations

import math

import torch

from rlk_triton import tuning
from rlk_triton.attention_bwd import _backward
from rlk_triton.attention_fwd import _forward, _lengths_fit, _max_len

# Launch configs: BLOCK_M in {64, 128} with 4 warps, or BLOCK_M = 128 with 8 warps (see above).
# A forward config may also cap the registers per thread (``maxnreg``: more programs per SM,
# the same instructions, so the same bits; a launch hint of NVIDIA's ptxas that Triton's AMD
# backend does not take, so an AMD launch leaves it out), or run a program per KV split
# (``SPLIT``: the same partials merged in the same order, so the same bits).
# ``TMA``: the packed path reads full KV tiles through tensor descriptors (the same values, so
# the same bits; the paged path and head dims a descriptor cannot express read through pointers
# whatever the config). ``OFF64``: int64 row offsets even where int32 ones fit (:func:`_off32`);
# never chosen, it is there for the tuning-invariance check (the same rows, so the same bits).
_FWD_CONFIGS = (
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 4, "TMA": True},
    {"BLOCK_M": 128, "num_warps": 4, "num_stages": 3, "TMA": True},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "maxnreg": 128},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 5},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "SPLIT": True},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3, "OFF64": True},
)
# Backward: BLOCK_M tiles the dQ kernel's queries, BLOCK_N the dK/dV kernel's keys; both
# kernels take num_warps, so 8 warps go with BLOCK_M = BLOCK_N = 128 only (same family rule).
_BWD_CONFIGS = (
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "OFF64": True},
)


def _long_rows(head_dim: int) -> int:
    # Long sequences, from scripts/kernel_sweep.py's attention part on an H200 (causal, GQA):
    # a 4-stage pipeline with 8 warps at head_dim 128 (+22% over 2 stages), 4 warps and 3
    # stages at head_dim 64 (+71%); K/V through descriptors on top of that: 411 -> 464 and
    # 409 -> 476 TFLOP/s at head_dim 128, 313 -> 340 at 64.
    return 5 if head_dim > 64 else 6


def _choose_fwd(rows: int, head_dim: int, **_: int) -> int:
    # rows = the longest sequence's query rows (tokens x heads of a group).
    if head_dim > 128:
        return 1
    return _long_rows(head_dim) if rows >= 1024 else 1


def _choose_bwd(rows: int, head_dim: int, **_: int) -> int:
    if head_dim > 128:
        return 2
    return 0 if rows >= 1024 else 2


TUNING = {
    "attention.fwd": tuning.Rule(configs=_FWD_CONFIGS, choose=_choose_fwd),
    "attention.bwd": tuning.Rule(configs=_BWD_CONFIGS, choose=_choose_bwd),
}

#: Under the Triton interpreter (CPU): the largest tiles (its cost is per program and per op).
CPU_TUNING = {
    "attention.fwd": tuning.Rule(configs=_FWD_CONFIGS, choose=lambda **_: 0),
    "attention.bwd": tuning.Rule(configs=_BWD_CONFIGS, choose=lambda **_: 0),
}


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, table, bounds):
        o, lse = _forward(
            q, k, v, cu_q, cu_k, None, None, causal, scale, "attention.fwd", table, True, bounds
        )
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.causal, ctx.scale, ctx.table = causal, scale, table
        if bounds is None:  # the forward already read cu_q (saved tensors are new objects)
            b = cu_q.numel() - 1
            bounds = (_max_len(cu_q), _lengths_fit(cu_k, b, k.shape[0], "cu_seqlens_k", "k"))
        ctx.max_lens = bounds
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _backward(
            do, q, k, v, o, lse, cu_q, cu_k, ctx.causal, ctx.scale, ctx.table, ctx.max_lens
        )
        return dq, dk, dv, None, None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Varlen attention: ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hk, D]``, ``cu_seqlens_*`` int32
    ``[B + 1]`` -> ``[Tq, Hq, D]`` in q's dtype. Queries are each sequence's last tokens.

    ``max_seqlen_q``/``max_seqlen_k`` (both or neither): bounds on the sequence lengths that
    size the grids, so that the offsets are not read on the host (a launch a CUDA graph can
    capture); a sequence beyond them is a bad offset (NaN rows and the index-check flag).
    Differentiable in q, k, v with a deterministic backward.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    bounds = None if max_seqlen_q is None else (int(max_seqlen_q), int(max_seqlen_k))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, cu_q, cu_k, causal, float(scale), table, bounds)
    o, _ = _forward(
        q, k, v, cu_q, cu_k, None, None, causal, float(scale), "attention.fwd", table, False, bounds
    )
    return o
