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
  TP rank needs. No fp32 ``[M, N]`` partial touches memory.
- unfused (the reference, :func:`tree_matmul_unfused`): one ``gemm._matmul`` launch per leaf
  with fp32 output and torch adds of the partials by :func:`tree_combine`.

The fused kernel's launch configs (``TREE_TUNING``) are smaller than ``linear``'s at many
leaves (the pending tiles live in registers); like every rlk config they set launch
parameters only, never a bit. See docs/parallel.md for the cost.
"""

from __future__ import annotations

import torch

from rlk_triton import gemm, tuning
from rlk_triton._triton import jit, tl, triton

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

    if HAS_BIAS:
        bias = tl.load(bias_ptr + col0 + rn, mask=mask_n, other=0.0).to(tl.float32)
        v = v + bias[None, :]
    c_ptrs = c_ptr + row0 * stride_cm + col0 * stride_cn
    c_ptrs += rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, v.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tcfg(bm, bn, warps, stages, group_m=8):
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "GROUP_M": group_m,
        "num_warps": warps,
        "num_stages": stages,
    }


#: Fused-kernel candidates (launch parameters only). Like gemm's: BLOCK_M % 64 == 0 and
#: num_warps in {4, 8}, so tl.dot is wgmma on Hopper for every one. A program holds
#: 1 + log2(leaves) fp32 tiles (the leaf accumulator and the pending subtrees), i.e.
#: (1 + log2(leaves)) * BLOCK_M * BLOCK_N / (32 * num_warps) registers a thread.
TREE_CONFIGS = (
    _tcfg(64, 32, 4, 6),  # 0: decode, small N; 8 leaves without spills (221 regs on sm_90)
    _tcfg(64, 64, 4, 4),  # 1: decode
    _tcfg(128, 64, 8, 4),  # 2: 4 leaves (200 regs)
    _tcfg(64, 128, 8, 4),  # 3: 4 leaves, wide N (195 regs)
    _tcfg(128, 128, 8, 4),  # 4: 2 leaves (172 regs)
    _tcfg(128, 256, 8, 3),  # 5: 1 leaf (linear's large-M tile)
    _tcfg(64, 64, 4, 3),  # 6: fp32 (FMA path), small smem
    _tcfg(128, 32, 8, 4),  # 7: many leaves, M >= 128
)

#: First candidate (index into TREE_CONFIGS) by log2(leaves): the largest tile whose live fp32
#: tiles compile without register spills on sm_90 (Triton 3.6, ptxas -v), except 8 leaves,
#: where 64x128/8 warps (448 B of spills) timed fastest on the H200 at M >= 512.
_START = {0: 5, 1: 4, 2: 2, 3: 3}
_ORDER = (5, 4, 2, 3, 1, 0)


def _choose_tree(M: int, N: int, K: int, leaves: int = 1, dtype_bytes: int = 2) -> int:
    """Fused-kernel config: the largest tile whose live fp32 tiles (the leaf accumulator and
    log2(leaves) pending subtrees) fit the registers, stepping down while the grid is short
    of one program per SM."""
    if dtype_bytes == 4:
        return 6
    start = _START.get(leaves.bit_length() - 1, 0)
    for i in _ORDER[_ORDER.index(start) :]:
        if gemm._tiles(M, N, TREE_CONFIGS[i]) >= gemm._NUM_SMS:
            return i
    return 0


def use_fused(M: int, N: int, R: int, leaves: int) -> bool:
    """Whether the fused kernel serves this shape (both paths have the same bits).

    The fused kernel's tiles are small at many leaves (the pending subtrees live in
    registers), so where the output is large and each leaf long the per-leaf GEMMs with
    ``linear``'s large tiles were faster on the H200 in spite of their fp32 traffic (Llama-3-8B
    down_proj, 8 leaves, M >= 2048); elsewhere the fused kernel was faster.
    """
    if leaves > MAX_FUSED_LEAVES:
        return False
    return not (M * N >= 2048 * 4096 and R // leaves >= 1024)


TREE_TUNING = {
    "tree_linear.fwd": tuning.Rule(configs=TREE_CONFIGS, choose=_choose_tree),
    "tree_linear.bwd_dx": tuning.Rule(configs=TREE_CONFIGS, choose=_choose_tree),
}

#: GEMM tuning key of the unfused path -> key of the fused kernel's rule.
_TREE_KEY = {"linear.fwd": "tree_linear.fwd", "linear.bwd_dx": "tree_linear.bwd_dx"}


def _tree_launch(a, b, bias, c, leaves, cfg):
    """Run the fused kernel on ``c = tree(a @ b) (+ bias)`` with launch config ``cfg``; returns
    Triton's handle of the compiled kernel."""
    M, R = a.shape
    N = b.shape[1]
    width = R // leaves
    block_k = gemm.BLOCK_K[a.dtype]
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    return _tree_kernel[grid](
        a,
        b,
        bias if bias is not None else c,
        c,
        M,
        N,
        width,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        LEAVES=leaves,
        HAS_BIAS=bias is not None,
        EVEN_K=width % block_k == 0,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


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


def tree_combine(parts):
    """Sum fp32 tensors (a power-of-two count, in leaf order) by the balanced binary tree.

    Streams: at most ``log2(len) + 1`` partial sums are alive. The left operand of each add is
    reused as its output (adds are correctly rounded, so where the result lives changes nothing).
    A part may be ``None``: an empty leaf, the exact identity (``None`` if every part is).
    """
    stack: list[tuple[int, torch.Tensor | None]] = []
    for p in parts:
        size = 1
        while stack and stack[-1][0] == size:
            left = stack.pop()[1]
            p = left if p is None else (p if left is None else left.add_(p))
            size *= 2
        stack.append((size, p))
    if len(stack) != 1:
        raise ValueError(f"tree_combine needs a power-of-two number of parts, got {stack}")
    return stack[0][1]


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
    if not use_fused(a.shape[0], b.shape[1], a.shape[1], leaves):
        return tree_matmul_unfused(a, b, leaves, table=table, key=key).to(out_dtype)
    return _fused(a, b, None, leaves, out_dtype, table, key)


def subtree_sum(x, weight, leaves, *, table):
    """fp32 tree sum of ``x [M, K] @ weight[N, K].T`` over ``leaves`` K-leaves."""
    return tree_matmul(x, weight.t(), leaves, table=table, key="linear.fwd")


def finish(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Add the bias to the fp32 root and round once to ``dtype`` (as the GEMM kernel does)."""
    if bias is not None:
        acc = acc.add_(bias.to(torch.float32))
    return acc.to(dtype)


def tree_linear_forward_unfused(x, weight, bias, leaves, table):
    """The reference of :func:`tree_linear_forward` (per-leaf GEMMs, torch adds)."""
    return finish(tree_matmul_unfused(x, weight.t(), leaves, table=table), bias, x.dtype)


def tree_linear_forward(x, weight, bias, leaves, table):
    if not use_fused(x.shape[0], weight.shape[0], x.shape[1], leaves):
        return tree_linear_forward_unfused(x, weight, bias, leaves, table)
    return _fused(x, weight.t(), bias, leaves, x.dtype, table, "linear.fwd")


def linear_backward(ctx, dy, x, weight, dx_leaves=None):
    """dX, dW, dbias of ``y = x @ W.T + b`` with the batch-invariant GEMM of ``linear``.

    With ``dx_leaves``, dX = dY @ W reduces N by the binary tree of that many N-leaves (the
    backward of a column-parallel layer, whose ranks split N); otherwise in ascending order.
    """
    dy = dy.contiguous()
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        if dx_leaves is None:
            dx = gemm._matmul(dy, weight, None, x.dtype, ctx.table, "linear.bwd_dx")
        else:
            dx = tree_matmul(
                dy, weight, dx_leaves, table=ctx.table, key="linear.bwd_dx", out_dtype=x.dtype
            )
    if ctx.needs_input_grad[1]:
        dw = gemm._matmul(dy.t(), x, None, weight.dtype, ctx.table, "linear.bwd_dw")
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = gemm._bias_grad(dy, weight.dtype)
    return dx, dw, db


class TreeLinearFunction(torch.autograd.Function):
    """Forward: K by the leaf tree (row-parallel layers). Backward: that of ``linear``."""

    @staticmethod
    def forward(ctx, x, weight, bias, leaves, table):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        return tree_linear_forward(x, weight, bias, leaves, table)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return (*linear_backward(ctx, dy, x, weight), None, None)


class ColumnTreeLinearFunction(torch.autograd.Function):
    """Forward: that of ``linear``. Backward: dX reduces N by the leaf tree (column layers)."""

    @staticmethod
    def forward(ctx, x, weight, bias, leaves, table):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        ctx.leaves = leaves
        return gemm.linear_forward(x, weight, bias, table)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return (*linear_backward(ctx, dy, x, weight, dx_leaves=ctx.leaves), None, None)


def _needs_grad(*ts):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def tree_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    leaves: int = 8,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with K reduced by a fixed binary tree of ``leaves`` leaves.

    Shapes: ``x [M, K]``, ``weight [N, K]``, ``bias [N]`` or None -> ``[M, N]`` in x's dtype.
    ``leaves`` is a power of two dividing K. Row i depends only on row i of x (batch-invariant,
    tuning-invariant); the bits equal those of a row-parallel linear over any power-of-two TP
    degree dividing ``leaves``. Differentiable (the backward of ``linear``).

    Example::

        y = tree_linear(torch.randn(4, 64), torch.randn(32, 64), leaves=8, table=default_table())
    """
    _check_leaves(x.shape[1], leaves)
    if _needs_grad(x, weight, bias):
        return TreeLinearFunction.apply(x, weight, bias, leaves, table)
    return tree_linear_forward(x, weight, bias, leaves, table)


def column_tree_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    leaves: int = 8,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """``linear`` (the same forward bits) whose dX reduces N by a tree of ``leaves`` N-leaves.

    The single-device twin of a column-parallel layer: its ranks split N, so the backward's
    dX = dY @ W is a sum over ranks; with the tree it has the same bits for any power-of-two
    TP degree dividing ``leaves``. ``leaves`` must divide N.
    """
    _check_leaves(weight.shape[0], leaves, "N")
    if _needs_grad(x, weight, bias):
        return ColumnTreeLinearFunction.apply(x, weight, bias, leaves, table)
    return gemm.linear_forward(x, weight, bias, table)
