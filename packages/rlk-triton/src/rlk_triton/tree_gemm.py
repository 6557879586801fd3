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

Cost: the partials are fp32 ``[M, N]`` tensors written and read back (at most
``log2(leaves) + 1`` alive at a time); see docs/parallel.md.
"""

from __future__ import annotations

import torch

from rlk_triton import gemm, tuning


def _check_leaves(R: int, leaves: int, dim: str = "K") -> None:
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaves must be a power of two >= 1, got {leaves}")
    if R % leaves:
        raise ValueError(f"leaves = {leaves} must divide {dim} = {R} (the leaves are equal ranges)")


def tree_combine(parts):
    """Sum fp32 tensors (a power-of-two count, in leaf order) by the balanced binary tree.

    Streams: at most ``log2(len) + 1`` partial sums are alive. The left operand of each add is
    reused as its output (adds are correctly rounded, so where the result lives changes nothing).
    """
    stack: list[tuple[int, torch.Tensor]] = []
    for p in parts:
        size = 1
        while stack and stack[-1][0] == size:
            p = stack.pop()[1].add_(p)
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


def tree_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    leaves: int,
    *,
    table: tuning.TuningTable,
    key: str = "linear.fwd",
) -> torch.Tensor:
    """fp32 ``[M, N]``: the tree sum of the ``leaves`` R-leaf partials of ``a [M, R] @ b [R, N]``.

    Any strides. With ``leaves / t`` leaves and a rank's R-shard this is that rank's subtree of
    the ``leaves``-leaf tree of the whole R. ``key`` names the GEMM tuning rule (launch
    parameters only, never the bits).
    """
    _check_leaves(a.shape[1], leaves, "the reduced dimension")
    return tree_combine(_leaf_partials(a, b, leaves, table, key))


def subtree_sum(x, weight, leaves, *, table):
    """fp32 tree sum of ``x [M, K] @ weight[N, K].T`` over ``leaves`` K-leaves."""
    return tree_matmul(x, weight.t(), leaves, table=table, key="linear.fwd")


def finish(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Add the bias to the fp32 root and round once to ``dtype`` (as the GEMM kernel does)."""
    if bias is not None:
        acc = acc.add_(bias.to(torch.float32))
    return acc.to(dtype)


def tree_linear_forward(x, weight, bias, leaves, table):
    return finish(subtree_sum(x, weight, leaves, table=table), bias, x.dtype)


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
            acc = tree_matmul(dy, weight, dx_leaves, table=ctx.table, key="linear.bwd_dx")
            dx = acc.to(x.dtype)
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
