"""Tree-ordered GEMM: ``y = x @ W.T + b`` with K reduced by a fixed binary tree over K-leaves.

A row-parallel linear (o_proj, down_proj) splits K over the ranks of a tensor-parallel group and
sums the rank partials, so the order of the K reduction, and the bits, follow the TP degree.
Here the order is fixed by the op's ``leaves`` argument instead:

- K is cut into ``leaves`` equal contiguous ranges (``leaves`` a power of two dividing K).
- Each leaf's partial ``x[:, K_l] @ W[:, K_l].T`` is computed in fp32 by the batch-invariant
  GEMM kernel of :mod:`rlk_triton.gemm` (K in ascending ``BLOCK_K`` tiles inside the leaf, the
  same kernel and tuning keys as ``linear``), with the fp32 output type.
- The leaf partials are combined by the balanced binary tree
  ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))`` of fp32 adds; the bias is added to the
  fp32 root, which is rounded once to the input dtype.

A contiguous, aligned block of ``leaves / t`` leaves is a subtree, so a rank of a TP group of
size ``t`` that holds that K-range computes the very fp32 value of that subtree
(:func:`subtree_sum` with ``leaves / t``), and the ranks' values combined by the top of the tree
give the single-process bits (``rlk.parallel.row_parallel_linear``). The fp32 adds are plain
torch adds: IEEE addition is correctly rounded (and commutative), so any device adds the same
two fp32 numbers to the same bits.

Backward of ``tree_linear`` needs no tree: dX = dY @ W reduces N, which no rank of a
row-parallel layer splits, so each K-column of dX depends on that column of W alone, and
dW = dY.T @ X is per (n, k). Both are the plain batch-invariant GEMM of ``linear``, and a rank's
K-slice of them equals the slice of the single-process gradient. A column-parallel layer splits
N, so its dX is a sum over ranks: ``column_tree_linear`` keeps ``linear``'s forward and reduces
dX's N by the leaf tree (:func:`tree_matmul`).

Two implementations with the same bits:

- fused (what the ops run where :func:`use_fused` says): :func:`_tree_kernel`, one program per output tile
  runs the leaves in sequence, each leaf exactly the K-loop of ``gemm._matmul_kernel`` over its
  K-range (accumulator from zero, ascending ``gemm.BLOCK_K`` tiles, the same ``tl.dot`` form
  and the same masking), and keeps the pending subtree sums of the tree in a binary counter of
  at most ``log2(leaves)`` fp32 tiles (the leaf index is a compile-time constant, so the
  carries are compile-time branches); then bias and one rounding, or the fp32 subtree value a
  TP rank needs. No fp32 ``[M, N]`` partial touches memory. Its flat variant
  :func:`_tree_flat_kernel` (configs with ``"VARIANT": "flat"``) does the same arithmetic in
  one K loop over all leaves (the software pipeline does not restart per leaf) with a runtime
  carry chain, and parks the pending subtrees it does not keep in registers in a per-program
  fp32 scratch (L2-resident), so its tile can be as large as ``linear``'s.
- unfused (the reference, :func:`tree_matmul_unfused`): one ``gemm._matmul`` launch per leaf
  with fp32 output and torch adds of the partials by :func:`tree_combine`.

The fused kernels' launch configs (``TREE_TUNING``) are their own (``_tree_kernel``'s are
smaller than ``linear``'s at many leaves: the pending tiles live in registers); like every rlk
config they set launch parameters only, never a bit. See docs/design/parallel.md for the cost.
"""

from __future__ import annotations

from typing import Any

import torch

# The tree's fp32 combine and the final bias-and-round are rlk.parallel's: its exchange tops the
# same tree over tensor-parallel ranks, so one definition serves both.
from rlk.parallel import finish, tree_combine
from rlk_triton import gemm, tuning
from rlk_triton._triton import INTERPRET, cdiv, jit, tl

#: Leaves the fused kernel unrolls at most (a carry chain of at most 6 levels); more leaves run
#: the unfused path (same bits).
MAX_FUSED_LEAVES = 64


@jit
def _tree_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    WIDTH,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    LEAVES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # C = tree over the LEAVES leaves (each WIDTH wide along the reduced dimension) of the leaf
    # partials A[:, leaf] @ B[leaf, :], each exactly gemm's K-loop on those views (origin in
    # int64, K offsets inside the leaf from 0). Tile order: gemm's.
    row0, col0 = gemm.tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    mask_m = rm < M - row0
    mask_n = rn < N - col0
    for leaf in tl.static_range(LEAVES):
        k_origin = (WIDTH * leaf).to(tl.int64)
        acc = gemm.k_loop(
            a_ptr + row0 * stride_am + k_origin * stride_ak,
            b_ptr + col0 * stride_bn + k_origin * stride_bk,
            mask_m, mask_n, WIDTH, stride_am, stride_ak, stride_bk, stride_bn,
            EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip

        # Binary counter of pending subtrees: slot j holds a finished subtree of 2^j leaves.
        # Leaf `leaf` carries through the slots of its trailing one bits (left operand: the
        # earlier subtree, as tree_combine), then parks in the first free slot. After the
        # last leaf, v is the root. The conditions are compile-time (leaf is a constexpr).
        v = acc
        if leaf % 2 == 0:
            s0 = v
        else:
            v = s0 + v
            if leaf // 2 % 2 == 0:
                s1 = v
            else:
                v = s1 + v
                if leaf // 4 % 2 == 0:
                    s2 = v
                else:
                    v = s2 + v
                    if leaf // 8 % 2 == 0:
                        s3 = v
                    else:
                        v = s3 + v
                        if leaf // 16 % 2 == 0:
                            s4 = v
                        else:
                            v = s4 + v
                            if leaf // 32 % 2 == 0:
                                s5 = v
                            else:
                                v = s5 + v

    gemm.store_tile(v, bias_ptr, c_ptr, row0, col0, mask_m, mask_n, stride_cm, stride_cn,
                HAS_BIAS, BLOCK_M, BLOCK_N)  # fmt: skip


@jit
def _barrier(x, ASM: tl.constexpr):
    """A CTA barrier (with global memory ordering) that returns ``x`` (the carry chain's leaf
    index goes through it, so what depends on it stays below). On CUDA it is PTX ``bar.sync 0``
    with a compiler memory clobber: Triton 3.6 does not software-pipeline a loop that holds
    ``tl.debug_barrier()`` (no cp.async prefetch at all), which would undo the flat kernel's
    point. Elsewhere (ROCm, the interpreter) ``tl.debug_barrier()``."""
    if ASM:
        x = tl.inline_asm_elementwise(
            "bar.sync 0;\n\tmov.b32 $0, $1;", "=r,r,~{memory}", [x], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.debug_barrier()
    return x


@jit
def _halves(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Columns [0, BLOCK_N/2) and [BLOCK_N/2, BLOCK_N) of x: moves values, adds nothing. (The
    # even and odd columns, a plain reshape and split, made ptxas serialize the K loop's wgmma
    # in Triton 3.6: "non wgmma instructions defining accumulator registers".)
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@jit
def _join(lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_M, BLOCK_N))


@jit
def _carry(v, s0, slots, low, LOG2_LEAVES: tl.constexpr, REG_SLOTS: tl.constexpr, SLOT):
    # _tree_kernel's binary counter with a runtime leaf index, for the finished leaf sum v (or
    # one column half of it): leaf + 1 = low * odd with low = 2^t (t = the trailing one bits
    # of the leaf), so the leaf adds the pending slots 0..t-1 (left operand: the earlier
    # subtree, as tree_combine) and parks the sum in slot t; at the last leaf (t =
    # LOG2_LEAVES) v becomes the root. Slot 0 is s0 if REG_SLOTS, slot j >= REG_SLOTS is
    # slots + (j - REG_SLOTS) * SLOT in global memory.
    for j in tl.static_range(LOG2_LEAVES):
        if low > (1 << j):
            if j < REG_SLOTS:
                v = s0 + v
            else:
                v = tl.load(slots + (j - REG_SLOTS) * SLOT) + v
        elif low == (1 << j):
            if j < REG_SLOTS:
                s0 = v
            else:
                tl.store(slots + (j - REG_SLOTS) * SLOT, v)
    return v, s0


@jit
def _tree_flat_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    park_ptr,
    M,
    N,
    WIDTH,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    LEAVES: tl.constexpr,
    LOG2_LEAVES: tl.constexpr,
    REG_SLOTS: tl.constexpr,
    HALVES: tl.constexpr,
    ASM_BARRIER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # _tree_kernel's arithmetic (every leaf exactly gemm.k_loop over its K-range, the same
    # tree of fp32 adds) with the leaves' K-loops flattened into one loop, so the software
    # pipeline runs across leaf boundaries instead of refilling per leaf; the carry chain runs
    # inside the loop at each leaf's last tile, as the epilogue of Triton's persistent matmul
    # does. Pending subtrees below REG_SLOTS stay in registers, the others are parked in this
    # program's fp32 slots of park_ptr, so the leaf tile can be as large as linear's.
    row0, col0 = gemm.tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M - row0
    mask_n = rn < N - col0
    a_tile = a_ptr + row0 * stride_am + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_tile = b_ptr + col0 * stride_bn + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    # This program's parked slots, one contiguous BLOCK_M x BLOCK_N fp32 tile each; with
    # HALVES the chain runs on column halves (half a tile less in registers, and half the
    # shared memory the compiler takes to change the layout of a parked tile, which at 128x256
    # would not fit next to the pipeline's buffers), each stored contiguously.
    SLOT = BLOCK_M * BLOCK_N
    park = park_ptr + tl.program_id(0).to(tl.int64) * ((LOG2_LEAVES - REG_SLOTS) * SLOT)
    if HALVES:
        park += rm[:, None] * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)[None, :]
    else:
        park += rm[:, None] * BLOCK_N + rn[None, :]
    tiles_per_leaf = tl.cdiv(WIDTH, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # slot 0 if REG_SLOTS
    for i in range(0, LEAVES * tiles_per_leaf):
        leaf = i // tiles_per_leaf
        kk = (i - leaf * tiles_per_leaf) * BLOCK_K  # offset inside the leaf, as k_loop's k0
        k = (leaf * WIDTH + kk).to(tl.int64)
        if EVEN_K:
            a = tl.load(a_tile + k * stride_ak, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_tile + k * stride_bk, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = rk < WIDTH - kk
            a = tl.load(a_tile + k * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_tile + k * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

        if kk + BLOCK_K >= WIDTH:
            if REG_SLOTS < LOG2_LEAVES:
                # A parked element may be read back by another thread than the one that wrote it
                # (the store and load layouts are the compiler's, and it does not order global
                # memory between threads): a CTA barrier orders every chain's slot accesses
                # after the previous chain's.
                leaf = _barrier(leaf, ASM_BARRIER)
            low = (leaf + 1) & -(leaf + 1)
            if HALVES:  # every slot parked (REG_SLOTS == 0), so no s0 to pass
                v0, v1 = _halves(acc, BLOCK_M, BLOCK_N)
                v0, _ = _carry(v0, v0, park, low, LOG2_LEAVES, 0, SLOT)
                v1, _ = _carry(v1, v1, park + SLOT // 2, low, LOG2_LEAVES, 0, SLOT)
                v = _join(v0, v1, BLOCK_M, BLOCK_N)
            else:
                v, s0 = _carry(acc, s0, park, low, LOG2_LEAVES, REG_SLOTS, SLOT)
            # The root leaves the loop in acc: the output's addresses and rounding stay out of
            # the loop, where they would hold registers through every K tile.
            if leaf == LEAVES - 1:
                acc = v
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    gemm.store_tile(acc, bias_ptr, c_ptr, row0, col0, mask_m, mask_n, stride_cm, stride_cn,
                HAS_BIAS, BLOCK_M, BLOCK_N)  # fmt: skip


def _tcfg(bm, bn, warps, stages, group_m=8):
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "GROUP_M": group_m,
        "num_warps": warps,
        "num_stages": stages,
    }


def _flat(bm, bn, warps, stages, reg_slots, halves=False, group_m=8):
    """A config of :func:`_tree_flat_kernel`: pending slots below ``reg_slots`` (0 or 1) stay
    in registers, the others are parked in global fp32 scratch; ``halves`` (with
    ``reg_slots = 0``) runs the carry chain on column halves."""
    return {
        **_tcfg(bm, bn, warps, stages, group_m),
        "VARIANT": "flat",
        "REG_SLOTS": reg_slots,
        "HALVES": halves,
    }


#: Fused-kernel candidates (launch parameters only). Like gemm's: BLOCK_M % 64 == 0 and
#: num_warps in {4, 8}, so tl.dot is wgmma on Hopper for every one. A _tree_kernel program
#: holds 1 + log2(leaves) fp32 tiles (the leaf accumulator and the pending subtrees), i.e.
#: (1 + log2(leaves)) * BLOCK_M * BLOCK_N / (32 * num_warps) registers a thread; a flat one
#: holds 1 + REG_SLOTS and parks the rest. A config fits a leaf count when those tiles take at
#: most _TILE_REGS registers (:func:`_fits_tree`); the rules launch only configs that fit.
#: "VARIANT", "REG_SLOTS" and "HALVES" choose the kernel and where pending sums live, never an
#: add: every entry gives the same bits.
TREE_CONFIGS = (
    _tcfg(64, 32, 4, 6),  # 0: decode, small N; 8 leaves without spills (221 regs on sm_90)
    _tcfg(64, 64, 4, 4),  # 1: decode
    _tcfg(128, 64, 8, 4),  # 2: 4 leaves (200 regs)
    _tcfg(64, 128, 8, 4),  # 3: 4 leaves, wide N (195 regs)
    _tcfg(128, 128, 8, 4),  # 4: 2 leaves (172 regs)
    _tcfg(128, 256, 8, 3),  # 5: 1 leaf (linear's large-M tile)
    _tcfg(64, 64, 4, 3),  # 6: fp32 (FMA path), small smem
    _tcfg(128, 32, 8, 4),  # 7: many leaves, M >= 128
    # The flat kernel (sm_90, Triton 3.6, ptxas, 8 leaves): registers / spill stores / smem.
    _flat(128, 256, 8, 3, 0, halves=True),  # 8: linear's large-M tile (255 / 56 B / 208 KiB)
    _flat(128, 128, 8, 4, 1),  # 9: acc + slot 0 in registers (255 / 116 B / 192 KiB)
    _flat(128, 128, 8, 3, 0),  # 10: every pending sum parked (233 / 0 / 160 KiB)
    _flat(128, 128, 8, 4, 0),  # 11: every pending sum parked (235 / 0 / 192 KiB)
    _flat(128, 256, 8, 2, 0, halves=True),  # 12: shallower pipeline (255 / 64 B / 160 KiB)
)

#: Flat configs _choose_tree picks at >= 4 leaves: the 128x256 tile where its grid fills the
#: GPU, else the 128x128 one where its grid nearly does. H200, 8 leaves, ratio to linear:
#: Llama-3-8B down M=4096 0.76 (128x256) vs 0.65 (128x128); Llama-3-8B o M=2048 0.51 both;
#: Qwen2 down M=2048 (64 tiles of 128x256) 0.30 vs 0.49 (H200, bench_tree_gemm.py).
_FLAT_WIDE = 8
_FLAT_LARGE = 9

#: First candidate (index into TREE_CONFIGS) by log2(leaves): the largest tile whose live fp32
#: tiles compile without register spills on sm_90 (Triton 3.6, ptxas -v), except 8 leaves,
#: where 64x128/8 warps (448 B of spills) timed fastest on the H200 at M >= 512.
_START = {0: 5, 1: 4, 2: 2, 3: 3}
_ORDER = (5, 4, 2, 3, 1, 0)


#: Registers a thread may give to the live fp32 tiles, of the 255 an NVIDIA thread has (the
#: rest hold the operand pipeline and addresses): the largest tiles _choose_tree picks take
#: 128 (128x256 at 1 leaf, 128x128 at 2, 64x128 at 8), and 128x128 / 8 warps at 4 leaves (192)
#: fails ptxas's register allocation for sm_100 (Triton 3.9, ``rlk aot``).
_TILE_REGS = 128


def _fits_tree(cfg: tuning.Config, leaves: int = 1, **_: int) -> bool:
    """Whether the fused kernel can launch ``cfg`` at ``leaves`` leaves: its live fp32 tiles
    (see TREE_CONFIGS) take at most :data:`_TILE_REGS` registers a thread."""
    pending = leaves.bit_length() - 1
    if cfg.get("VARIANT") == "flat":
        pending = min(cfg["REG_SLOTS"], pending)
    per_tile = cfg["BLOCK_M"] * cfg["BLOCK_N"] // (32 * cfg["num_warps"])
    return (1 + pending) * per_tile <= _TILE_REGS


def _choose_tree(M: int, N: int, K: int, leaves: int = 1, dtype_bytes: int = 2) -> int:
    """Fused-kernel config: from 4 leaves on, the flat kernel's 128x256 tile where its grid
    fills the GPU, else its 128x128 tile where that grid nearly does; otherwise the largest
    _tree_kernel tile whose live fp32 tiles (the leaf accumulator and log2(leaves) pending
    subtrees) fit the registers (:func:`_fits_tree`), stepping down while the grid is short of
    one program per SM. fp32: 64x64 up to 8 leaves, 64x32 beyond (the FMA path)."""
    if dtype_bytes == 4:
        return 6 if _fits_tree(TREE_CONFIGS[6], leaves) else 0
    if leaves >= 4 and gemm._tiles(M, N, TREE_CONFIGS[_FLAT_WIDE]) >= gemm._NUM_SMS:
        return _FLAT_WIDE
    # 3/4 of the SMs: one wave of 128x128 tiles against two of the unrolled kernel's smaller
    # ones (a guess; the H200 runs measured grids of 128 tiles and more).
    if leaves >= 4 and 4 * gemm._tiles(M, N, TREE_CONFIGS[_FLAT_LARGE]) >= 3 * gemm._NUM_SMS:
        return _FLAT_LARGE
    start = _START.get(leaves.bit_length() - 1, 0)
    for i in _ORDER[_ORDER.index(start) :]:
        if gemm._tiles(M, N, TREE_CONFIGS[i]) >= gemm._NUM_SMS:
            return i
    return 0


def use_fused(leaves: int) -> bool:
    """Whether the fused kernel serves ``leaves`` leaves (both paths have the same bits).

    Up to MAX_FUSED_LEAVES it does: on the H200 it was faster than the per-leaf GEMMs at every
    shape measured on an H200 (2 and 8 leaves; Llama-3-8B down_proj at 8 leaves, M=4096: 0.76x
    ``linear`` against 0.68x, with the flat kernel's 128x256 tile). An earlier rule sent
    large-output, long-leaf shapes to the per-leaf GEMMs, when the fused kernel kept its pending
    sums in registers and so had only small tiles.
    """
    return leaves <= MAX_FUSED_LEAVES


TREE_TUNING = {
    "tree_linear.fwd": tuning.Rule(configs=TREE_CONFIGS, choose=_choose_tree, fits=_fits_tree),
    "tree_linear.bwd_dx": tuning.Rule(configs=TREE_CONFIGS, choose=_choose_tree, fits=_fits_tree),
}

#: GEMM tuning key of the unfused path -> key of the fused kernel's rule.
_TREE_KEY = {"linear.fwd": "tree_linear.fwd", "linear.bwd_dx": "tree_linear.bwd_dx"}


def _tree_launch(a, b, bias, c, leaves, cfg):
    """Run the fused kernel on ``c = tree(a @ b) (+ bias)`` with launch config ``cfg``; returns
    Triton's handle of the compiled kernel."""
    M, R = a.shape
    N = b.shape[1]
    width = R // leaves
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    # The arguments both kernels take: sizes and strides, then the compile-time parameters.
    sizes = (M, N, width, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
             c.stride(1))  # fmt: skip
    meta = dict(LEAVES=leaves, **gemm.launch_meta(a, width, bias, cfg))
    bias = bias if bias is not None else c
    # The flat loop runs LEAVES * cdiv(width, BLOCK_K) tiles and writes C at the last one: with
    # empty leaves it would write nothing, so they take _tree_kernel (the same zeros and bias).
    if cfg.get("VARIANT") != "flat" or width == 0:
        return _tree_kernel[grid](a, b, bias, c, *sizes, **meta)
    log2_leaves = leaves.bit_length() - 1
    reg_slots = min(cfg["REG_SLOTS"], log2_leaves)
    halves = cfg.get("HALVES", False)
    if reg_slots not in (0, 1) or (halves and cfg["REG_SLOTS"]):
        raise ValueError(f"REG_SLOTS must be 0, or 1 without HALVES: {cfg}")
    # Every parked slot is written before it is read (by its own program), so no memset.
    parked = grid[0] * (log2_leaves - reg_slots) * cfg["BLOCK_M"] * cfg["BLOCK_N"]
    park = torch.empty(parked, dtype=torch.float32, device=a.device) if parked else c
    return _tree_flat_kernel[grid](
        a, b, bias, c, park, *sizes, **meta, LOG2_LEAVES=log2_leaves, REG_SLOTS=reg_slots,
        HALVES=halves, ASM_BARRIER=a.is_cuda and torch.version.hip is None and not INTERPRET,
    )  # fmt: skip


def tree_config(table, key, M, N, R, leaves, dtype_bytes):
    """The fused kernel's launch config: a forced one for its key, else the table's rule for
    it (a vendor table may override ``tree_linear.*``), else ``TREE_TUNING``'s."""
    tkey = _TREE_KEY.get(key, key)
    rules = {tkey: table.get(tkey) or TREE_TUNING[tkey]}
    return tuning.config(rules, tkey, M=M, N=N, K=R, leaves=leaves, dtype_bytes=dtype_bytes)


def _fused(a, b, bias, leaves, out_dtype, table, key, cfg=None):
    """``tree(a [M, R] @ b [R, N]) (+ bias)`` in ``out_dtype`` by the fused kernel."""
    M, R = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if cfg is None:
        cfg = tree_config(table, key, M, N, R, leaves, a.element_size())
    _tree_launch(a, b, bias, c, leaves, cfg)
    return c


def _check_leaves(R: int, leaves: int, dim: str = "K") -> None:
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaves must be a power of two >= 1, got {leaves}")
    if R % leaves:
        raise ValueError(f"leaves = {leaves} must divide {dim} = {R} (the leaves are equal ranges)")


def _leaf_partials(a, b, leaves, table, key):
    width = a.shape[1] // leaves
    for leaf in range(leaves):
        r0 = leaf * width
        # Strided views: the GEMM kernel reads any strides, so a leaf of the full operands gives
        # the same tiles (and bits) as a rank's contiguous shard of them.
        yield gemm._matmul(
            a[:, r0 : r0 + width], b[r0 : r0 + width], None, torch.float32, table, key
        )


def tree_matmul_unfused(
    a: torch.Tensor,
    b: torch.Tensor,
    leaves: int,
    *,
    table: tuning.TuningTable,
    key: str = "linear.fwd",
) -> torch.Tensor:
    """The reference of :func:`tree_matmul`: one fp32 ``gemm._matmul`` per leaf, torch adds."""
    _check_leaves(a.shape[1], leaves, "the reduced dimension")
    return tree_combine(_leaf_partials(a, b, leaves, table, key))


def tree_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    leaves: int,
    *,
    table: tuning.TuningTable,
    key: str = "linear.fwd",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[M, N]``: the tree sum of the ``leaves`` R-leaf partials of ``a [M, R] @ b [R, N]``.

    fp32 unless ``out_dtype`` (the fp32 root rounded once). Any strides. With
    ``leaves / t`` leaves and a rank's R-shard this is that rank's subtree of the ``leaves``-leaf
    tree of the whole R. ``key`` names the tuning rule (launch parameters only, never the bits).
    The fused kernel; bitwise equal to :func:`tree_matmul_unfused`.
    """
    _check_leaves(a.shape[1], leaves, "the reduced dimension")
    if not use_fused(leaves):
        return tree_matmul_unfused(a, b, leaves, table=table, key=key).to(out_dtype)
    return _fused(a, b, None, leaves, out_dtype, table, key)


def subtree_sum(x, weight, leaves, *, table):
    """fp32 tree sum of ``x [M, K] @ weight[N, K].T`` over ``leaves`` K-leaves."""
    return tree_matmul(x, weight.t(), leaves, table=table, key="linear.fwd")


def tree_linear_forward_unfused(x, weight, bias, leaves, table):
    """The reference of :func:`tree_linear_forward` (per-leaf GEMMs, torch adds)."""
    return finish(tree_matmul_unfused(x, weight.t(), leaves, table=table), bias, x.dtype)


def tree_linear_forward(x, weight, bias, leaves, table):
    if not use_fused(leaves):
        return tree_linear_forward_unfused(x, weight, bias, leaves, table)
    return _fused(x, weight.t(), bias, leaves, x.dtype, table, "linear.fwd")


def linear_backward(ctx, dy, x, weight, dx_leaves=None, exchange=None):
    """dX, dW, dbias of ``y = x @ W.T + b`` with the batch-invariant GEMM of ``linear``.

    With ``dx_leaves``, dX = dY @ W reduces N by the binary tree of that many N-leaves (the
    backward of a column-parallel layer, whose ranks split N); otherwise in ascending order.
    With ``exchange`` too, ``weight`` is this rank's N-slice: its fp32 subtree of dX is topped
    by ``exchange.reduce`` over the ranks' subtrees (the deterministic replacement of
    Megatron's all-reduce of dX).
    """
    dy = dy.contiguous()
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        if dx_leaves is None:
            dx = gemm._matmul(dy, weight, None, x.dtype, ctx.table, "linear.bwd_dx")
        elif exchange is None:
            dx = tree_matmul(
                dy, weight, dx_leaves, table=ctx.table, key="linear.bwd_dx", out_dtype=x.dtype
            )
        else:
            local = tree_matmul(dy, weight, dx_leaves, table=ctx.table, key="linear.bwd_dx")
            dx = exchange.reduce(local, None, x.dtype)
    if ctx.needs_input_grad[1]:
        dw = gemm._matmul(dy.t(), x, None, weight.dtype, ctx.table, "linear.bwd_dw")
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = gemm._bias_grad(dy, weight.dtype)
    return dx, dw, db


def _forward(x, weight, bias, leaves, table, exchange):
    """tree_linear's forward; with ``exchange``, this rank's fp32 subtree (its K-shard) topped
    over the ranks by ``exchange.reduce``, which adds the bias and rounds once."""
    if exchange is None:
        return tree_linear_forward(x, weight, bias, leaves, table)
    return exchange.reduce(subtree_sum(x, weight, leaves, table=table), bias, x.dtype)


class TreeLinearFunction(torch.autograd.Function):
    """Forward: K by the leaf tree (row-parallel layers). Backward: that of ``linear``, local
    under tensor parallelism (dX's K-slice and dW's K-columns need only this rank's shard)."""

    @staticmethod
    def forward(ctx, x, weight, bias, leaves, table, exchange):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        return _forward(x, weight, bias, leaves, table, exchange)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return (*linear_backward(ctx, dy, x, weight), None, None, None)


class ColumnTreeLinearFunction(torch.autograd.Function):
    """Forward: that of ``linear``. Backward: dX reduces N by the leaf tree (column layers)."""

    @staticmethod
    def forward(ctx, x, weight, bias, leaves, table, exchange):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        ctx.leaves, ctx.exchange = leaves, exchange
        return gemm.linear_forward(x, weight, bias, table)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grads = linear_backward(ctx, dy, x, weight, ctx.leaves, ctx.exchange)
        return (*grads, None, None, None)


def _needs_grad(*ts):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def tree_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    leaves: int = 8,
    *,
    exchange: Any = None,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with K reduced by a fixed binary tree of ``leaves`` leaves.

    Shapes: ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[M, N]`` in x's dtype.
    ``leaves`` is a power of two dividing K. Row i depends only on row i of x (batch-invariant,
    tuning-invariant); the bits equal those of a row-parallel linear over any power-of-two TP
    degree dividing ``leaves``. Differentiable (the backward of ``linear``).

    Tensor parallelism (``rlk.parallel.row_parallel_linear``): ``x``, ``weight`` are this
    rank's K-shard and ``leaves`` its share of the leaves (a subtree); ``exchange.reduce(fp32
    subtree, bias, dtype)`` returns the top of the tree over the ranks, bias added, rounded.

    Example::

        y = tree_linear(torch.randn(4, 64), torch.randn(32, 64), leaves=8, table=default_table())
    """
    _check_leaves(x.shape[1], leaves)
    if _needs_grad(x, weight, bias):
        return TreeLinearFunction.apply(x, weight, bias, leaves, table, exchange)
    return _forward(x, weight, bias, leaves, table, exchange)


def column_tree_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    leaves: int = 8,
    *,
    exchange: Any = None,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """``linear`` (the same forward bits) whose dX reduces N by a tree of ``leaves`` N-leaves.

    The single-device twin of a column-parallel layer: its ranks split N, so the backward's
    dX = dY @ W is a sum over ranks; with the tree it has the same bits for any power-of-two
    TP degree dividing ``leaves``. ``leaves`` must divide N. With ``exchange``
    (``rlk.parallel.column_parallel_linear``), ``weight`` and ``bias`` are this rank's N-slice,
    ``leaves`` its share, and ``exchange.reduce`` tops dX's tree over the ranks.
    """
    _check_leaves(weight.shape[0], leaves, "N")
    if _needs_grad(x, weight, bias):
        return ColumnTreeLinearFunction.apply(x, weight, bias, leaves, table, exchange)
    return gemm.linear_forward(x, weight, bias, table)
