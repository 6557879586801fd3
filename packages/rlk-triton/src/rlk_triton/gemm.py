"""Batch-invariant GEMM: ``linear(x, weight, bias)`` forward and backward.

One tiled kernel computes ``C[M, N] = A[M, R] @ B[R, N] (+ bias[N])`` for any strides; it
serves the forward (``y = x @ W.T``), dX (``dY @ W``) and dW (``dY.T @ X``). The numerics are
fixed by constants of this module, never by the shape or the tuning config:

- The reduction dimension R runs in ascending order in tiles of ``BLOCK_K[dtype]`` (a module
  constant), accumulated in fp32 by one program per output tile: no split-K, no stream-K, no
  atomics. Bias is added to the fp32 sum, which is rounded once to the output dtype.
- One MMA instruction kind for every config. On Hopper, Triton lowers ``tl.dot`` to wgmma
  (MMAv3) only when the tile's M is a multiple of 64 and num_warps a multiple of 4 (and N a
  multiple of 8); otherwise it silently falls back to mma.sync (MMAv2), which may round the
  16-wide partial products differently. So every config below has BLOCK_M in {64, 128, 256},
  BLOCK_N a multiple of 16 and num_warps in {4, 8}: decode-size M pays padding (a 64-row tile
  for one row) but then runs the very instructions a 4096-row batch runs, which is what makes
  row i of a batch equal the row computed alone. On Ampere every config is mma.sync (v2), on
  AMD MFMA; fp32 inputs use ``input_precision="ieee"`` (FMA, no TF32) on all of them.
- dbias (the column sums of dY) is a product too: ``dY.T @ ones``, the rows reduced in ascending
  ``BLOCK_K`` tiles by ``tl.dot`` into fp32, as every GEMM reduces (:func:`row_sums`). When dW
  runs the pointer kernel (every eager host-bound product does), extra programs of its grid
  compute dbias, so it takes no launch of its own; otherwise (a descriptor kernel for dW, or no
  dW wanted) :func:`_row_sums_kernel` runs the same code, with the same bits.

Two kernels run this one reduction: ``_matmul_kernel`` loads tiles through pointers (any
strides, every dtype), ``_matmul_tma_kernel`` through tensor descriptors (Hopper's tensor memory
accelerator: a tile is one bulk copy, out-of-range rows and K read as zero), optionally
persistent (one program per SM walks the tiles in the grouped order). Both run the same
``tl.dot`` chain on the same tiles, so they give the same bits; a config's ``TMA`` flag picks the
second for bf16/fp16 operands whose layout a descriptor can express (unit inner stride, 16-byte
aligned base and strides), and the pointer kernel otherwise.

Tuning (``TUNING``) picks BLOCK_M / BLOCK_N / GROUP_M (grouped tile order for L2 reuse) /
num_warps / num_stages / TMA / PERSISTENT by shape; the conformance kit runs every candidate
and demands identical bits.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, tl

#: Reduction tile per input dtype. Fixed: it sets the order of the fp32 accumulation over K
#: (under the interpreter each tile is one partial sum; on GPUs the tile's 16-wide MMA steps).
BLOCK_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}

#: The standalone dbias launch: rows of dY.T per program and warps (the bits do not depend on
#: them: a row's sum is the same dot chain whatever the tile).
_ROW_SUMS_BLOCK_M = 64
_ROW_SUMS_WARPS = 4


@jit
def tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) origin, int64, of this program's output tile.

    Grouped tile order: GROUP_M row-tiles sweep the N tiles together so B stays in L2. It only
    decides which program computes a tile, never how. Origins are int64 (dY of an lm_head has
    more than 2^31 elements); offsets inside a tile stay int32.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m.to(tl.int64) * BLOCK_M, pid_n.to(tl.int64) * BLOCK_N


@jit
def k_loop(
    a_tile, b_tile, mask_m, mask_n, K, stride_am, stride_ak, stride_bk, stride_bn,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 ``A[tile rows, :K] @ B[:K, tile cols]`` from the tiles' origins ``a_tile``/``b_tile``:
    K in ascending tiles of the constant BLOCK_K, accumulated by ``tl.dot`` into one fp32 tile
    from zero; out-of-range K is read as 0 (adds +0.0). The reduction order of every GEMM."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return k_loop_from(acc, a_tile, b_tile, mask_m, mask_n, K, stride_am, stride_ak, stride_bk,
                       stride_bn, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, False)  # fmt: skip


@jit
def k_loop_from(
    acc, a_tile, b_tile, mask_m, mask_n, K, stride_am, stride_ak, stride_bk, stride_bn,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, B_ONES: tl.constexpr, UNROLL: tl.constexpr = 1,
):  # fmt: skip
    """:func:`k_loop` continuing from the fp32 tile ``acc``: a product over K split at a
    multiple of BLOCK_K and run as two calls, the second from the first's result, is the one
    call's chain of ``tl.dot`` steps, so it has its bits. With B_ONES, B is all ones (``b_tile``
    and its strides unused): row sums of A by the same chain (:func:`row_sums`).

    UNROLL (a launch parameter) loads UNROLL consecutive BLOCK_K tiles per loop iteration and
    runs their dots in ascending order, then the K tiles left over one at a time: the same
    chain of dots on the same tiles, so the same bits. A decode-size product is bound by the
    loop's per-iteration latency, which the wider step amortises over more bytes of B."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_tile + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_tile + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    k_main = 0
    if UNROLL > 1:
        # Whole groups of UNROLL tiles, every K index in range: no K mask.
        k_main = (K // (BLOCK_K * UNROLL)) * (BLOCK_K * UNROLL)
        for _ in range(0, k_main, BLOCK_K * UNROLL):
            for u in tl.static_range(UNROLL):
                a = tl.load(a_ptrs + u * BLOCK_K * stride_ak, mask=mask_m[:, None], other=0.0)
                if B_ONES:
                    b = tl.full((BLOCK_K, BLOCK_N), 1.0, dtype=a.dtype)
                else:
                    b = tl.load(b_ptrs + u * BLOCK_K * stride_bk, mask=mask_n[None, :],
                                other=0.0)  # fmt: skip
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * UNROLL * stride_ak
            b_ptrs += BLOCK_K * UNROLL * stride_bk
    for k0 in range(k_main, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            mask_k = rk < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if B_ONES:
            b = tl.full((BLOCK_K, BLOCK_N), 1.0, dtype=a.dtype)
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    rows_ptr=None,
    TILES=0,
    ROW_SUMS: tl.constexpr = False,
    ACC_IN: tl.constexpr = False,
    UNROLL: tl.constexpr = 1,
):
    # With ROW_SUMS, programs from TILES on write rows_ptr[m] = sum_k A[m, k] (dbias, when A is
    # dY.T), one BLOCK_M block of rows each; the programs before them compute C's tiles.
    if ROW_SUMS:
        if tl.program_id(0) >= TILES:
            row_sums(a_ptr, rows_ptr, (tl.program_id(0) - TILES).to(tl.int64) * BLOCK_M, M, K,
                     stride_am, stride_ak, IEEE, BLOCK_M, BLOCK_K)  # fmt: skip
        else:
            _tile(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                  stride_bn, stride_cm, stride_cn, HAS_BIAS, EVEN_K, IEEE, BLOCK_M, BLOCK_N,
                  BLOCK_K, GROUP_M, ACC_IN, UNROLL)  # fmt: skip
    else:
        _tile(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
              stride_cm, stride_cn, HAS_BIAS, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
              ACC_IN, UNROLL)  # fmt: skip


@jit
def _tile(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    stride_cm, stride_cn, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACC_IN: tl.constexpr, UNROLL: tl.constexpr = 1,
):  # fmt: skip
    """One output tile of ``_matmul_kernel`` (the tile of this program in the grouped order).
    With ACC_IN the product continues from C's fp32 values (C += A @ B, see
    :func:`k_loop_from`), else it starts from zero."""
    row0, col0 = tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    mask_m = rm < M - row0
    mask_n = rn < N - col0
    if ACC_IN:
        c_ptrs = c_ptr + row0 * stride_cm + col0 * stride_cn
        c_ptrs += rm[:, None] * stride_cm + rn[None, :] * stride_cn
        acc = tl.load(c_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = k_loop_from(
        acc, a_ptr + row0 * stride_am, b_ptr + col0 * stride_bn, mask_m, mask_n, K,
        stride_am, stride_ak, stride_bk, stride_bn, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
        False, UNROLL,
    )  # fmt: skip
    store_tile(acc, bias_ptr, c_ptr, row0, col0, mask_m, mask_n, stride_cm, stride_cn,
               HAS_BIAS, BLOCK_M, BLOCK_N)  # fmt: skip


@jit
def row_sums(a_ptr, out_ptr, row0, M, K, stride_am, stride_ak,
             IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``out[m] = sum_k A[m, k]`` for the BLOCK_M rows from ``row0``, as ``A @ ones``: K in
    ascending BLOCK_K tiles, ``tl.dot`` into an fp32 tile from zero (``k_loop_from`` itself,
    with B all ones), so a row's sum does not depend on BLOCK_M, the warps or which launch
    computes it. The 16 columns of the product are equal; their max is that value exactly."""
    rm = tl.arange(0, BLOCK_M)
    mask_m = rm < M - row0
    acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
    acc = k_loop_from(
        acc, a_ptr + row0 * stride_am, a_ptr, mask_m, tl.arange(0, 16) < 16, K, stride_am,
        stride_ak, 0, 0, False, IEEE, BLOCK_M, 16, BLOCK_K, True,
    )  # fmt: skip
    total = tl.max(acc, axis=1)
    tl.store(out_ptr + row0 + rm, total.to(out_ptr.dtype.element_ty), mask=mask_m)


@jit
def _row_sums_kernel(a_ptr, out_ptr, M, K, stride_am, stride_ak,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    row_sums(a_ptr, out_ptr, tl.program_id(0).to(tl.int64) * BLOCK_M, M, K, stride_am,
             stride_ak, IEEE, BLOCK_M, BLOCK_K)  # fmt: skip


@jit
def store_tile(acc, bias_ptr, c_ptr, row0, col0, mask_m, mask_n, stride_cm, stride_cn,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The epilogue of every GEMM: the bias added to the fp32 tile, one rounding to C's dtype,
    a masked store of the tile at (row0, col0)."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + col0 + rn, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    c_ptrs = c_ptr + row0 * stride_cm + col0 * stride_cn
    c_ptrs += rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@jit
def _tma_step(acc, a_desc, b_desc, row0, col0, k0, A_T: tl.constexpr, B_T: tl.constexpr):
    """One BLOCK_K step of the descriptor kernel's chain: ``acc += A[tile, k0:] @ B[k0:, tile]``."""
    if A_T:
        a = a_desc.load([k0, row0]).T
    else:
        a = a_desc.load([row0, k0])
    if B_T:
        b = b_desc.load([col0, k0]).T
    else:
        b = b_desc.load([k0, col0])
    return tl.dot(a, b, acc)


@jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr, UNROLL: tl.constexpr = 1,
):  # fmt: skip
    # ``k_loop``'s reduction (ascending BLOCK_K tiles, tl.dot into one fp32 tile from zero) on
    # tiles brought by descriptors. A is stored [M, K] (or [K, M] when A_T), B [K, N] (or
    # [N, K] when B_T). Program p takes tiles p, p + step, ...: one tile each (step = the tile
    # count, the grid), or persistent over all of them (step = NUM_SMS, the grid); tile ids
    # map to tiles as in ``tile_origin``. A compile-time step lets the flattened persistent
    # loop pipeline across tiles (about 9% at 4096 x 4096 x 14336 on an H200 against a step
    # passed at run time).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_in_group = GROUP_M * num_pid_n
    rn = tl.arange(0, BLOCK_N)
    step = NUM_SMS if PERSISTENT else num_tiles
    for tile in tl.range(tl.program_id(0), num_tiles, step, flatten=PERSISTENT):
        first_m = (tile // num_in_group) * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        row0 = (first_m + (tile % num_in_group) % group_size) * BLOCK_M
        col0 = ((tile % num_in_group) // group_size) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_main = 0
        if UNROLL > 1:
            # UNROLL tiles per iteration, then the rest one at a time (see k_loop_from).
            k_main = (K // (BLOCK_K * UNROLL)) * (BLOCK_K * UNROLL)
            for k0 in range(0, k_main, BLOCK_K * UNROLL):
                for u in tl.static_range(UNROLL):
                    acc = _tma_step(acc, a_desc, b_desc, row0, col0, k0 + u * BLOCK_K, A_T, B_T)
        for k0 in range(k_main, K, BLOCK_K):
            acc = _tma_step(acc, a_desc, b_desc, row0, col0, k0, A_T, B_T)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + col0 + rn, mask=rn < N - col0, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        c_desc.store([row0, col0], acc.to(c_desc.dtype))


def gemm_config(bm, bn, warps, stages, group_m=8, tma=False, persistent=False, unroll=1):
    """One launch config of the GEMM kernels (public: vendor tuning tables, rlk-rocm's, build
    their candidates with it)."""
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "GROUP_M": group_m,
        "num_warps": warps,
        "num_stages": stages,
        "TMA": tma,
        "PERSISTENT": persistent,
        "UNROLL": unroll,
    }


# Candidates. Every one keeps BLOCK_M % 64 == 0 and num_warps in {4, 8} (one MMA kind, see the
# module docstring). Indices are referred to by the choosers below.
_CONFIGS = (
    gemm_config(64, 32, 4, 8),  # 0: decode, N up to ~4k: a program per SM, a deep pipeline on W
    gemm_config(64, 64, 4, 6),  # 1: decode, wider N; M 64-256 at N ~4k
    gemm_config(64, 128, 4, 4),  # 2: decode, large N (lm_head)
    gemm_config(64, 256, 8, 4),  # 3: M ~ 64..128, large N
    gemm_config(128, 128, 8, 4),  # 4: mid M
    gemm_config(128, 256, 8, 3),  # 5: large M (cuBLAS-class tile)
    gemm_config(128, 256, 8, 4),  # 6: large M, deeper pipeline
    gemm_config(256, 128, 8, 3),  # 7: large M, tall tile
    gemm_config(128, 128, 4, 4),  # 8: mid M, fewer warps (fp32 FMA path)
    gemm_config(64, 64, 4, 3),  # 9: fp32 FMA path, small smem
    gemm_config(64, 128, 4, 6),  # 10: M 64-256, N > ~4k
    gemm_config(256, 128, 8, 4),  # 11: large M, tall tile, deeper pipeline
    gemm_config(64, 128, 4, 4, tma=True),  # 12: M 65-256, more 64x128 tiles than SMs
    gemm_config(128, 256, 8, 3, tma=True),  # 13: mid M, descriptors
    gemm_config(128, 256, 8, 3, tma=True, persistent=True),  # 14: large M, persistent
    gemm_config(64, 64, 4, 8, tma=True),  # 15: decode M 17-64, N up to ~8k, descriptors
    gemm_config(64, 128, 4, 6, tma=True),  # 16: decode M 17-64, wider N; M 65-256, descriptors
    gemm_config(64, 64, 4, 6, tma=True),  # 17: M 65-256, N up to ~8k, descriptors
    gemm_config(64, 256, 8, 4, tma=True, persistent=True),  # 18: M ~1k with a short K, persistent
    gemm_config(64, 64, 4, 4, tma=True),  # 19: M 65-256 with a short K, descriptors
    gemm_config(64, 32, 4, 8, unroll=2),  # 20: decode, N up to ~8k, K > 1024: two K tiles a step
    gemm_config(64, 64, 4, 8),  # 21: decode M <= 16, N up to ~8k, a short K
    gemm_config(128, 128, 8, 4, tma=True, persistent=True),  # 22: M ~1k, 128x256 waves ragged
)

_NUM_SMS = 132  # H200; only shapes the choice of tiles, never the bits


def _tiles(M, N, cfg):
    return cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])


def _choose(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    """Config for an [M, N] output reduced over K.

    Up to M = 64 the product streams W from memory (64-row tiles, the fewest wgmma pads).
    Where N is narrower than a 64-wide tile per SM (o_proj and down at 4096), W is streamed by
    64x32 tiles through pointers that load two K tiles per loop step: such a product is bound
    by the loop's per-step latency, not by bytes in flight, so the wider step is what moves W
    faster (0.72 -> 0.93x cuBLAS at 14336 -> 4096, M = 1); but only while those tiles fit one
    wave (a second, nearly empty wave doubles the time: 3584 -> 4608 at M = 64, 144 tiles,
    0.50 -> 0.83x on 64x64 tiles); a short K (<= 1024) keeps one tile a step on 64x64. Wider N:
    up to M = 16 the pointer kernel, the widest N tile that still gives every SM a program,
    with the deepest pipeline that fits shared memory (a descriptor's 64-row box of A, mostly
    out of range there, made it slower); from M = 17 descriptors, 64x128 where N gives at least
    half the SMs a program at that width (4096 -> 14336 at M = 64, 112 tiles: 0.94 -> 1.04x
    against 224 tiles of 64x64), else 64x64. Up to M = 256: 128x256 for N >= 8192 or where it
    fills the GPU; else 64x128 tiles, at 4 stages (two programs per SM) where there are more
    of them than SMs (3584 -> 4608 and 2560 -> 6144 at M = 256: 0.60 -> 0.74x and
    0.68 -> 0.83x), at 6 stages where they give at least half the SMs a program (0.77 -> 0.90x
    at 14336 -> 4096, 0.74 -> 0.81x at 9728 -> 2560, M = 256), else 64x64 (a 4-stage pipeline
    for a short K, <= 1024). Above: 64x128 where 128x256 tiles would leave half the SMs idle
    (4864 -> 896 at M = 1024: 0.34 -> 0.88x), else 128x256 persistent, or 64x256 persistent
    for a short K (<= 1024) until there are four 128x256 tiles per SM; but 128x128 persistent
    where its waves take at most 3/4 of the 128x256 grid's time, counting a 128x128 wave as
    half (3584 -> 4608 at M = 1024: 144 tiles of 128x256 are two waves for 132 SMs, the second
    of 12 tiles; 288 of 128x128 are three half-time waves: 0.63 -> 0.73x cuBLAS on an H100).
    cuBLAS fills the waves with tile widths no power of two gives: Nsight Compute names its
    kernel there nvjet_sm90_tst_144x128 (132 programs of 3 warpgroups in 2-CTA clusters,
    about 256 tiles in 1.94 waves), and at M = 256 nvjet_sm90_tst_80x128 (120 programs in
    8-CTA clusters); Triton's tiles are powers of two. Chosen from
    ``scripts/kernel_sweep.py`` on an H200 (CUDA-graph GPU time of every candidate against
    cuBLAS at the Llama-3-8B, Qwen2-0.5B, Qwen2.5-7B and Qwen3-4B projections).
    """
    if dtype_bytes == 4:
        return 9 if M <= 64 or _tiles(M, N, _CONFIGS[8]) < _NUM_SMS else 8
    if M <= 64:
        if cdiv(N, 64) < _NUM_SMS:
            if K > 1024 and cdiv(N, 32) <= _NUM_SMS:
                return 20
            return 21 if M <= 16 else 15
        if M <= 16:
            return 2 if _tiles(M, N, _CONFIGS[2]) >= _NUM_SMS else 1
        return 16 if 2 * _tiles(M, N, _CONFIGS[16]) >= _NUM_SMS else 15
    if M <= 256:
        if N >= 8192 or _tiles(M, N, _CONFIGS[13]) >= _NUM_SMS:
            return 13
        if K <= 1024:
            return 19
        tiles = _tiles(M, N, _CONFIGS[16])
        if tiles > _NUM_SMS:
            return 12
        return 16 if 2 * tiles >= _NUM_SMS else 17
    if 2 * _tiles(M, N, _CONFIGS[14]) < _NUM_SMS:
        return 16
    if K <= 1024 and _tiles(M, N, _CONFIGS[14]) < 4 * _NUM_SMS:
        return 18
    if 2 * cdiv(_tiles(M, N, _CONFIGS[22]), _NUM_SMS) <= 3 * cdiv(
        _tiles(M, N, _CONFIGS[14]), _NUM_SMS
    ):
        return 22
    return 14


def _choose_dw(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    """Config for dW [N_out, K_in] (here M, N are the output's dims, K the token count)."""
    if dtype_bytes == 4:
        return 8 if _tiles(M, N, _CONFIGS[8]) >= _NUM_SMS else 9
    return 14 if _tiles(M, N, _CONFIGS[14]) >= 4 * _NUM_SMS else 13


TUNING = {
    "linear.fwd": tuning.Rule(configs=_CONFIGS, choose=_choose),
    "linear.bwd_dx": tuning.Rule(configs=_CONFIGS, choose=_choose),
    "linear.bwd_dw": tuning.Rule(configs=_CONFIGS, choose=_choose_dw),
}


def _choose_cpu(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    # The interpreter's cost is per program and per op, not per element: the widest tiles.
    return 3 if M <= 64 else 5


#: Under the Triton interpreter (CPU): the same candidates, the widest tiles chosen.
CPU_TUNING = {key: tuning.Rule(configs=_CONFIGS, choose=_choose_cpu) for key in TUNING}


def _descriptor_layout(t: torch.Tensor) -> tuple[bool, list[int], list[int]] | None:
    """``(transposed, shape, strides)`` of the row-major matrix a descriptor reads for the 2-D
    view ``t`` (``t`` itself, or the storage of a transposed view), or None where a descriptor
    cannot express it (no unit stride; base or row stride not 16-byte aligned)."""
    (r, c), (sr, sc) = t.shape, t.stride()
    e = t.element_size()
    if t.data_ptr() % 16:
        return None
    if sc == 1 and (sr * e) % 16 == 0 and sr >= c:
        return False, [r, c], [sr, 1]
    if sr == 1 and (sc * e) % 16 == 0 and sc >= r:
        return True, [c, r], [sc, 1]
    return None


def _launch_tma(a, b, bias, c, cfg, a_lay, b_lay):
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, R = a.shape
    N = b.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], BLOCK_K[a.dtype]
    a_t, b_t = a_lay[0], b_lay[0]
    a_desc = TensorDescriptor(a, a_lay[1], a_lay[2], [bk, bm] if a_t else [bm, bk])
    b_desc = TensorDescriptor(b, b_lay[1], b_lay[2], [bn, bk] if b_t else [bk, bn])
    c_desc = TensorDescriptor(c, [M, N], [c.stride(0), 1], [bm, bn])
    tiles = cdiv(M, bm) * cdiv(N, bn)
    sms = _sm_count(a.device)
    grid = min(tiles, sms) if cfg["PERSISTENT"] else tiles
    return _matmul_tma_kernel[(grid,)](
        a_desc, b_desc, c_desc, bias if bias is not None else c, M, N, R,
        HAS_BIAS=bias is not None, A_T=a_t, B_T=b_t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"], PERSISTENT=cfg["PERSISTENT"], NUM_SMS=sms,
        UNROLL=cfg.get("UNROLL", 1), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _NUM_SMS  # the interpreter: any grid is correct
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _launch(a, b, bias, c, cfg, descriptors: bool = True, rows=None, accumulate=False):
    """Run a kernel on ``c = a @ b (+ bias)`` with launch config ``cfg``; returns Triton's
    handle of the compiled kernel (the GPU tests read its PTX).

    A config asking for descriptors (``TMA``) gets them for bf16/fp16 operands whose layouts a
    descriptor can express and an output of their width, unless ``descriptors`` is False;
    others run the pointer kernel with the same tiles, which gives the same bits (the same
    ``tl.dot`` chain over the same K tiles). ``rows`` (a tensor [M]) also gets ``a``'s row sums
    (:func:`row_sums`): from extra programs of the pointer kernel's grid, or, after a
    descriptor kernel, from :func:`_row_sums_kernel`."""
    M, R = a.shape
    N = b.shape[1]
    # The descriptor kernel stages C's tile in shared memory for its bulk store: at the input
    # width the configs fit, an fp32 C (fused_logprobs' partials) would not.
    wide_c = c.element_size() != a.element_size()
    tma = descriptors and cfg.get("TMA") and not accumulate
    if (
        tma
        and a.dtype != torch.float32
        and not wide_c
        and c.is_contiguous()
        and c.data_ptr() % 16 == 0
    ):
        a_lay, b_lay = _descriptor_layout(a), _descriptor_layout(b)
        if a_lay is not None and b_lay is not None and (c.stride(0) * c.element_size()) % 16 == 0:
            kernel = _launch_tma(a, b, bias, c, cfg, a_lay, b_lay)
            if rows is not None:
                _row_sums_into(a, rows)
            return kernel
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    extra = dict(ACC_IN=True) if accumulate else {}
    if rows is not None:
        extra.update(rows_ptr=rows, TILES=tiles, ROW_SUMS=True)
    return _matmul_kernel[(tiles + (cdiv(M, cfg["BLOCK_M"]) if rows is not None else 0),)](
        a, b, bias if bias is not None else c, c, M, N, R, *strides,
        **launch_meta(a, R, bias, cfg), UNROLL=cfg.get("UNROLL", 1), **extra,
    )  # fmt: skip


def launch_meta(a: torch.Tensor, R: int, bias, cfg) -> dict:
    """The compile-time arguments and launch options of the pointer kernels (``_matmul_kernel``
    and the tree kernels) for ``a`` reduced over ``R``, under launch config ``cfg``."""
    block_k = BLOCK_K[a.dtype]
    return dict(
        HAS_BIAS=bias is not None,
        EVEN_K=R % block_k == 0,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _matmul(a, b, bias, out_dtype, table, key, rows=None, out=None, accumulate=False):
    """``a [M, R] @ b [R, N] (+ bias)`` for any strides, in ``out_dtype``; with ``rows`` (a
    tensor [M]), ``a``'s row sums into it too (dW's launch giving dbias, ``a`` being dY.T).
    ``out``: an [M, N] tensor of ``out_dtype`` with a unit column stride to write C into (a
    slice of a larger result), in place of a new one; the same bits. ``accumulate``: ``out``
    (fp32, no bias) += the product, continuing its K chain (:func:`k_loop_from`): a product
    split over K at a multiple of ``BLOCK_K`` and accumulated so has the one product's bits."""
    M, R = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device) if out is None else out
    if rows is not None and (M == 0 or N == 0 or R == 0):
        _row_sums_into(a, rows)
        rows = None
    if M == 0 or N == 0:
        return c
    if R == 0:
        if accumulate:
            return c
        return c.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(c))
    cfg = tuning.config(table, key, M=M, N=N, K=R, dtype_bytes=a.element_size())
    # An eager product too small for descriptors' host cost runs the pointer kernel on the
    # same tiles (tuning.HOST_BOUND_FLOPS).
    descriptors = tuning.use_descriptors(cfg, key, 2 * M * N * R, c)
    _launch(a, b, bias, c, cfg, descriptors, rows, accumulate)
    return c


def _row_sums_into(a: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows[m] = sum_k a[m, k]`` (:func:`row_sums`; zeros for an empty K)."""
    M, K = a.shape
    if M == 0:
        return
    if K == 0:
        rows.zero_()
        return
    _row_sums_kernel[(cdiv(M, _ROW_SUMS_BLOCK_M),)](
        a, rows, M, K, a.stride(0), a.stride(1), IEEE=a.dtype == torch.float32,
        BLOCK_M=_ROW_SUMS_BLOCK_M, BLOCK_K=BLOCK_K[a.dtype], num_warps=_ROW_SUMS_WARPS,
    )  # fmt: skip


def _bias_grad(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dbias [N] = the column sums of ``dy [M, N]`` (any strides), in ``dtype``: the row sums
    of ``dy.T`` by :func:`row_sums`, the bits dW's launch gives when it computes dbias too."""
    db = torch.empty(dy.shape[1], dtype=dtype, device=dy.device)
    _row_sums_into(dy.t(), db)
    return db


def linear_forward(x, weight, bias, table):
    """``x [M, K] @ weight[N, K].T + bias[N]`` -> ``[M, N]`` (no autograd)."""
    return _matmul(x, weight.t(), bias, x.dtype, table, "linear.fwd")


def linear_grads(dy, x, weight, has_bias, needs, table):
    """``(dx, dw, dbias)`` of ``linear``, each None unless ``needs`` (three bools) asks."""
    dy = dy.contiguous()
    dx = dw = db = None
    if needs[0]:
        # dX [M, K] = dY [M, N] @ W [N, K]: N reduced in ascending BLOCK_K tiles, like the
        # forward, so row i of dX depends only on row i of dY.
        dx = _matmul(dy, weight, None, x.dtype, table, "linear.bwd_dx")
    need_b = has_bias and needs[2]
    if needs[1]:
        # dW [N, K] = dY.T [N, M] @ X [M, K]: the M rows reduced in ascending BLOCK_K
        # chunks inside one program per [N, K] tile (no split over M, no atomics); dbias,
        # the row sums of dY.T, from the same launch.
        db = torch.empty(dy.shape[1], dtype=weight.dtype, device=dy.device) if need_b else None
        dw = _matmul(dy.t(), x, None, weight.dtype, table, "linear.bwd_dw", rows=db)
    elif need_b:
        db = _bias_grad(dy, weight.dtype)
    return dx, dw, db


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, table):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        return linear_forward(x, weight, bias, table)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (*linear_grads(dy, x, weight, ctx.has_bias, needs, ctx.table), None)


def _split_forward(x, weight, bias=None, *, table):
    return (linear_forward(x, weight, bias, table),), ()


def _split_backward(grads, outs, extras, needs, x, weight, bias=None, *, table):
    return linear_grads(grads[0], x, weight, bias is not None, needs, table)


#: ``linear``'s forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`LinearFunction`.
AUTOGRAD = {"linear": (_split_forward, _split_backward)}


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Batch-invariant ``y = x @ weight.T + bias``.

    Shapes: ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[M, N]`` in x's dtype
    (bf16/fp16/fp32, all the same; fp32 without TF32). Row i of the output depends only on
    row i of x, bitwise, whatever M and whatever tuning config. Differentiable: dX has the same
    numerics, dW and dbias are deterministic (fixed row partition, no atomics).

    Example::

        y = linear(torch.randn(8, 64), torch.randn(32, 64), None, table=default_table())
    """
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return LinearFunction.apply(x, weight, bias, table)
    return linear_forward(x, weight, bias, table)
