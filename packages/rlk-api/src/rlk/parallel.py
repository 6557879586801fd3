"""Tensor-parallel linears whose bits do not depend on the tensor-parallel degree.

A row-parallel linear (o_proj, down_proj) splits K over the ranks and sums their partials with
an all-reduce, so the order of the K reduction follows the TP degree and the reduction
algorithm of the collective. Here K is reduced by one fixed binary tree over ``leaves`` equal
K-ranges (a constant of the model, not of the parallelism):

- :func:`tree_linear` (one device): each leaf's partial product is computed in fp32 by the
  backend's batch-invariant GEMM, the partials are added as ``((p0+p1)+(p2+p3))+(...)``, the
  bias is added and the result is rounded once to the input dtype.
- :func:`row_parallel_linear` (rank r of t, t a power of two dividing ``leaves``): the rank
  holds the K-range of leaves ``[r*L/t, (r+1)*L/t)``, which is a subtree; it computes that
  subtree's fp32 value, all-gathers the t subtree values and adds them locally by the top of the
  tree (or, with ``RLK_TP_EXCHANGE=halving``, adds them by recursive halving in the tree's
  order). Every rank gets the bits of :func:`tree_linear` on one device.
- :func:`column_parallel_linear`: each rank's N-slice of ``linear`` is already the slice of the
  one-device result (the forward reduces only K, which no rank splits); ``gather_output``
  concatenates the slices. Its backward's dX sums over N, which the ranks split: it uses the
  N-leaf tree, as :func:`column_tree_linear` does on one device.

Use the ``tree`` / ``column_tree`` ops on one device and the ``parallel`` ones under TP with the
same ``leaves``, and the forward and backward bits agree across TP degrees. Only backends built
on rlk_triton's GEMM (triton, cuda, rocm) serve these ops; others raise :class:`BackendError`
(rlk never falls back to another kernel). Cost and limits: docs/design/parallel.md.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from rlk import _validate as chk
from rlk._plugins import BackendError, current_backend

#: Backends whose ``linear`` is rlk_triton's GEMM bound to a tuning table of that name.
TREE_BACKENDS = ("triton", "cuda", "rocm")


@functools.cache
def _table(name: str) -> Any:
    from rlk_triton import backend

    tables = backend.known_tables()
    if name not in tables:
        raise BackendError(f"rlk.parallel: no rlk_triton tuning table for backend {name!r}")
    return tables[name]


def _tree_backend(device: torch.device, op: str) -> Any:
    """The tuning table of the selected backend, which must run rlk_triton's GEMM."""
    name = current_backend(device)
    if name not in TREE_BACKENDS:
        raise BackendError(
            f"rlk.parallel.{op}: backend {name!r} has no tree-ordered GEMM (served by "
            f"{', '.join(TREE_BACKENDS)}); rlk does not fall back to another backend's kernel, "
            "since that would break bitwise agreement"
        )
    return _table(name)


def _leaves(leaves: object) -> int:
    if isinstance(leaves, bool) or not isinstance(leaves, int):
        raise TypeError(f"leaves must be an int, got {type(leaves).__name__}")
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaves must be a power of two >= 1, got {leaves}")
    return leaves


def _check_linear(x, weight, bias, *, bias_n=None):
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, min_ndim=1, nonempty_last=True)
    chk.tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if bias is not None:
        chk.tensor("bias", bias, dtypes=chk.FLOAT_DTYPES, ndim=1)
    device = chk.same_device(x=x, weight=weight, bias=bias)
    chk.same_dtype(x=x, weight=weight, bias=bias)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        chk.shape("bias", bias, (weight.shape[0],), "N = weight.shape[0]")
    return device


def _divides(leaves: int, n: int, what: str) -> None:
    if n % leaves:
        raise ValueError(
            f"leaves = {leaves} must divide {what} = {n} (the leaves are equal ranges)"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _group_info(group) -> tuple[int, int]:
    """(rank, size) in ``group``; one rank when torch.distributed is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _tp_leaves(leaves: int, world: int) -> int:
    """Leaves per rank: the TP size must be a power of two dividing ``leaves``."""
    if world & (world - 1) or leaves % world:
        raise ValueError(
            f"leaves = {leaves} must be a multiple of the tensor-parallel group size {world}, "
            "which must be a power of two"
        )
    return leaves // world


def _all_gather(t: torch.Tensor, world: int, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    if world == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


#: How :func:`_tree_reduce` combines the ranks' fp32 subtree values (``RLK_TP_EXCHANGE``):
#: ``gather`` all-gathers them and adds the top of the tree on every rank; ``halving`` adds
#: them by recursive halving in the tree's order, then all-gathers the finished rows. The bits
#: are the same (both add the same pairs, and an fp32 add of two numbers is correctly rounded
#: and commutative); the bytes differ (docs/design/parallel.md, Communication).
EXCHANGES = ("gather", "halving")


def _exchange() -> str:
    name = os.environ.get("RLK_TP_EXCHANGE", "gather")
    if name not in EXCHANGES:
        raise ValueError(f"RLK_TP_EXCHANGE must be one of {EXCHANGES}, got {name!r}")
    return name


def _halving_owner(rank: int, world: int) -> int:
    """The row block (of ``world``) that ``rank`` holds after recursive halving: at step j it
    keeps the lower half of its blocks if bit j of its rank is 0, else the upper half."""
    lo, size, step = 0, world, 1
    while step < world:
        size //= 2
        lo += size if rank & step else 0
        step *= 2
    return lo


def _sendrecv(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    import torch.distributed as dist

    peer = peer if group is None else dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _tree_reduce(local, world, group, bias, dtype):
    """``finish(top of the tree over the ranks' fp32 subtree values, bias, dtype)`` on every
    rank: the deterministic replacement of an all-reduce. ``local``: this rank's fp32 [M, N],
    a fresh value of the caller's that the halving exchange may sum into in place."""
    import torch.distributed as dist

    from rlk_triton import tree_gemm

    if world == 1 or _exchange() == "gather":
        root = tree_gemm.tree_combine(_all_gather(local, world, group))
        return tree_gemm.finish(root, bias, dtype)
    rank = dist.get_rank(group)
    # Recursive halving: step j pairs rank r with r ^ 2^j, which holds the sibling subtree of
    # level j for the same rows; each keeps half of its rows and adds the peer's values there.
    # After log2(t) steps a rank holds 1/t of the rows summed by the whole tree.
    M, N = local.shape
    rows = -(-M // world)
    if rows * world == M:
        buf = local.contiguous()
    else:
        buf = local.new_zeros(rows * world, N)
        buf[:M] = local
    lo, size, step = 0, world, 1
    while step < world:
        size //= 2
        keep = lo + size if rank & step else lo
        give = lo if rank & step else lo + size
        recv = torch.empty(size * rows, N, dtype=buf.dtype, device=buf.device)
        _sendrecv(buf[give * rows : (give + size) * rows], recv, rank ^ step, group)
        buf[keep * rows : (keep + size) * rows] += recv
        lo, step = keep, step * 2
    mine = tree_gemm.finish(buf[lo * rows : (lo + 1) * rows], bias, dtype)
    # Gather each rank's finished rows straight into the row block it holds.
    out = torch.empty(rows * world, N, dtype=dtype, device=local.device)
    blocks = [_halving_owner(r, world) for r in range(world)]
    dist.all_gather(
        [out[b * rows : (b + 1) * rows] for b in blocks], mine.contiguous(), group=group
    )
    return out[:M]


# --------------------------------------------------------------------------------------------
# One device
# --------------------------------------------------------------------------------------------


def tree_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, leaves: int = 8
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with K reduced by a fixed binary tree of ``leaves`` K-ranges.

    Shapes: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]`` in x's dtype.
    ``leaves``: a power of two dividing K.

    Contract: batch-invariant and tuning-invariant like :func:`rlk.linear` (but not the same
    bits as ``rlk.linear``: the K order differs), and bitwise equal to
    :func:`row_parallel_linear` with the same ``leaves`` on any power-of-two TP group whose
    size divides ``leaves``. Backward: that of ``rlk.linear`` (its dX reduces N, which TP does
    not split, and dW is per element, so both are TP-invariant as they are).

    Example::

        y = rlk.parallel.tree_linear(torch.randn(4, 64), torch.randn(32, 64), leaves=8)
    """
    leaves = _leaves(leaves)
    device = _check_linear(x, weight, bias)
    _divides(leaves, x.shape[-1], "K = x.shape[-1]")
    from rlk_triton import tree_gemm

    table = _tree_backend(device, "tree_linear")
    y = tree_gemm.tree_linear(_rows(x), weight, bias, leaves=leaves, table=table)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def column_tree_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, leaves: int = 8
) -> torch.Tensor:
    """:func:`rlk.linear`'s forward bits; the backward's dX reduces N by a tree of ``leaves``.

    Shapes as ``rlk.linear``; ``leaves``: a power of two dividing N. The one-device twin of
    :func:`column_parallel_linear` (whose ranks split N, so dX = dY @ W is a sum over ranks).
    """
    leaves = _leaves(leaves)
    device = _check_linear(x, weight, bias)
    _divides(leaves, weight.shape[0], "N = weight.shape[0]")
    from rlk_triton import tree_gemm

    table = _tree_backend(device, "column_tree_linear")
    y = tree_gemm.column_tree_linear(_rows(x), weight, bias, leaves=leaves, table=table)
    return y.reshape(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------------------------
# Tensor-parallel (torch.distributed)
# --------------------------------------------------------------------------------------------


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, leaves, world, group, table):
        from rlk_triton import tree_gemm

        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        local = tree_gemm.subtree_sum(x, weight, leaves // world, table=table)
        return _tree_reduce(local, world, group, bias, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from rlk_triton import tree_gemm

        # dY is replicated on the ranks (the output is); dX's K-slice and dW's K-columns need
        # only this rank's W and X, and every rank gets the (identical) full dbias.
        x, weight = ctx.saved_tensors
        return (*tree_gemm.linear_backward(ctx, dy, x, weight), None, None, None, None)


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    leaves: int = 8,
    group: Any = None,
) -> torch.Tensor:
    """Row-parallel ``y = x @ W.T + bias`` with the bits of :func:`tree_linear` on one device.

    Rank r of the group (size t, a power of two dividing ``leaves``) passes its K-shard:
    ``x [..., K/t]`` (columns ``r*K/t .. (r+1)*K/t`` of the full input), ``weight [N, K/t]``
    (the same columns of W) and the full ``bias [N]`` (or None). Every rank returns the full
    ``[..., N]``, bitwise equal to ``tree_linear(x_full, W_full, bias, leaves=leaves)``.
    Without an initialised process group it is ``tree_linear``.

    Communication, instead of an all-reduce: one all-gather of t fp32 ``[M, N]`` tensors, or
    with ``RLK_TP_EXCHANGE=halving`` a recursive-halving exchange of fp32 rows and an
    all-gather of the finished rows (the same bits).
    Backward: local (no communication), as Megatron's row-parallel layer; dX is the K-slice of
    the one-device dX, dW the K-columns of the one-device dW.
    """
    leaves = _leaves(leaves)
    device = _check_linear(x, weight, bias)
    rank, world = _group_info(group)
    per_rank = _tp_leaves(leaves, world)
    _divides(per_rank, x.shape[-1], f"this rank's K-shard x.shape[-1] (leaves / {world} ranks)")
    table = _tree_backend(device, "row_parallel_linear")
    y = _RowParallel.apply(_rows(x), weight, bias, leaves, world, group, table)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, leaves, world, group, table):
        from rlk_triton import gemm

        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.table = table
        ctx.leaves, ctx.world, ctx.group = leaves, world, group
        return gemm.linear_forward(x, weight, bias, table)

    @staticmethod
    def backward(ctx, dy):
        from rlk_triton import gemm, tree_gemm

        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # dX sums over the ranks' N-slices: this rank's subtree of the N-leaf tree, the
            # subtrees gathered and topped by the tree (the deterministic replacement of
            # Megatron's all-reduce of dX).
            local = tree_gemm.tree_matmul(
                dy, weight, ctx.leaves // ctx.world, table=ctx.table, key="linear.bwd_dx"
            )
            dx = _tree_reduce(local, ctx.world, ctx.group, None, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = gemm._matmul(dy.t(), x, None, weight.dtype, ctx.table, "linear.bwd_dw")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = gemm._bias_grad(dy, weight.dtype)
        return dx, dw, db, None, None, None, None


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    leaves: int = 8,
    gather_output: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """Column-parallel ``y = x @ W.T + bias``: this rank's N-slice, or all of it gathered.

    Rank r of the group (size t, a power of two dividing ``leaves``) passes the full
    ``x [..., K]``, its rows ``weight [N/t, K]`` of W (rows ``r*N/t .. (r+1)*N/t``) and the same
    slice of ``bias``. Returns ``[..., N/t]``, bitwise the N-slice of ``rlk.linear`` (and of
    :func:`column_tree_linear`) on one device; with ``gather_output`` every rank returns the
    full ``[..., N]`` (the slices must have equal sizes).

    Backward: dW, dbias local; dX = dY @ W sums over the ranks' N-slices, combined by the
    N-leaf tree of :func:`column_tree_linear` (an all-gather of fp32 ``[M, K]`` subtree values),
    so dX has the one-device bits of ``column_tree_linear`` with the same ``leaves``.
    """
    leaves = _leaves(leaves)
    device = _check_linear(x, weight, bias)
    if not isinstance(gather_output, bool):
        raise TypeError(f"gather_output must be a bool, got {type(gather_output).__name__}")
    rank, world = _group_info(group)
    per_rank = _tp_leaves(leaves, world)
    _divides(per_rank, weight.shape[0], f"this rank's N-shard weight.shape[0] (leaves / {world})")
    table = _tree_backend(device, "column_parallel_linear")
    y = _ColumnParallel.apply(_rows(x), weight, bias, leaves, world, group, table)
    if gather_output:
        y = _GatherColumns.apply(y, rank, world, group)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rank, world, group):
        ctx.rank, ctx.width = rank, y.shape[-1]
        return torch.cat(_all_gather(y, world, group), dim=-1)

    @staticmethod
    def backward(ctx, dy):
        # The gathered output is replicated, so its gradient is too: keep this rank's slice.
        lo = ctx.rank * ctx.width
        return dy[:, lo : lo + ctx.width], None, None, None


# --------------------------------------------------------------------------------------------
# Vocabulary-parallel log-probabilities
# --------------------------------------------------------------------------------------------


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, entropy, logits_dtype, rank,
                world, group, table):  # fmt: skip
        from rlk_triton import fused_logprobs as fl
        from rlk_triton import logprobs as lp_mod

        v_local = weight.shape[0]
        vocab, offset = v_local * world, v_local * rank
        m, s, t, zt = fl.linear_leaf_states(
            hidden, weight, targets, bias, temperature, entropy, logits_dtype, table, vocab, offset
        )
        # Deterministic merge: gather every rank's subtree triple (and its target logit, which
        # only the owner of the target holds), then the top of the leaf tree on every rank.
        triple = torch.stack([m, s, t if entropy else s, zt], 0)
        parts = torch.stack(_all_gather(triple, world, group), 2)  # [4, T, world]
        owner = (targets // v_local).clamp_(0, world - 1)
        zt = parts[3].gather(1, owner[:, None])[:, 0]
        lp, lse, ent = lp_mod.merge_states(
            parts[0].contiguous(),
            parts[1].contiguous(),
            parts[2].contiguous() if entropy else None,
            zt,
            final=True,
        )
        ctx.save_for_backward(hidden, weight, targets, bias, lse, ent)
        ctx.args = (temperature, entropy, logits_dtype, vocab, offset, world, group, table)
        return (lp, ent) if entropy else lp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        from rlk_triton import fused_logprobs as fl

        hidden, weight, targets, bias, lse, ent = ctx.saved_tensors
        temperature, entropy, logits_dtype, vocab, offset, world, group, table = ctx.args
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        if entropy:
            g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        else:
            ent = g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[3]
        dh, dw, db = fl.backward_slices(
            hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype,
            table, need_h, need_w, need_b, vocab, offset,
        )  # fmt: skip
        if need_h:
            # hidden is replicated; its gradient sums over the vocabulary, which the ranks
            # split: this rank's subtree of the leaf tree, the top of the tree after a gather.
            dh = _tree_reduce(dh, world, group, None, hidden.dtype)
        return dh, dw, None, db, None, None, None, None, None, None, None


def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logits_dtype: torch.dtype | None = None,
    *,
    group: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rlk.linear_logprobs` with the lm_head split over the vocabulary, one-device bits.

    Rank r of the group (size t, a power of two dividing ``rlk_triton.logprobs.VOCAB_LEAVES``)
    passes the replicated ``hidden [T, H]`` and ``targets`` int64 ``[T]`` (ids in the whole
    vocabulary of ``V = t * V_r``), its rows ``weight [V_r, H]`` of the lm_head (rows
    ``r*V_r .. (r+1)*V_r``, Megatron's vocabulary-parallel layout; V must be a multiple of
    ``VOCAB_LEAVES``) and the same slice of ``bias``. Every rank returns the float32 ``[T]``
    log-probabilities (and entropy), bitwise equal to ``rlk.linear_logprobs`` of the full
    lm_head on one device. Without an initialised process group it is ``rlk.linear_logprobs``.

    How: the log-sum-exp is a fixed tree over vocabulary leaves; a rank's rows are a subtree,
    so each rank merges its own leaves, the ranks all-gather their ``(max, sum-exp, entropy
    term, target logit)`` (16 bytes per token per rank) and merge the top of the tree. Backward:
    dW, dbias local; dHidden sums over the vocabulary, so each rank's fp32 ``[T, H]`` subtree is
    all-gathered and topped by the same tree (instead of Megatron's all-reduce).

    Example::

        lp = rlk.parallel.vocab_parallel_linear_logprobs(h, lm_head_shard, tokens, group=tp)
    """
    from rlk._ops import check_linear_logprobs

    rank, world = _group_info(group)
    device, targets, temperature, logits_dtype = check_linear_logprobs(
        hidden, weight, targets, bias, temperature, logits_dtype, weight.shape[0] * world
    )
    return_entropy = chk.flag("return_entropy", return_entropy)
    if world > 1:
        from rlk_triton import logprobs as lp_mod

        _tp_leaves(lp_mod.VOCAB_LEAVES, world)
        if (weight.shape[0] * world) % lp_mod.VOCAB_LEAVES:
            raise ValueError(
                f"the vocabulary V = {weight.shape[0] * world} ({world} ranks x "
                f"{weight.shape[0]} rows) must be a multiple of {lp_mod.VOCAB_LEAVES} "
                "(the vocabulary leaves; pad the lm_head as Megatron does)"
            )
    table = _tree_backend(device, "vocab_parallel_linear_logprobs")
    return _VocabParallelLogprobs.apply(
        hidden.contiguous(), weight, targets.contiguous(), bias, temperature,
        return_entropy, logits_dtype, rank, world, group, table,
    )  # fmt: skip


def shard(t: torch.Tensor, dim: int, *, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/``world_size`` of ``t`` along ``dim`` (a contiguous copy).

    Row-parallel: ``shard(x, -1, ...)`` and ``shard(W, 1, ...)``. Column-parallel:
    ``shard(W, 0, ...)`` and ``shard(bias, 0, ...)``.
    """
    size = t.shape[dim]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size = {world_size}), got {rank}")
    if size % world_size:
        raise ValueError(f"world_size = {world_size} must divide t.shape[{dim}] = {size}")
    w = size // world_size
    return t.narrow(dim, rank * w, w).contiguous()


__all__ = [
    "TREE_BACKENDS",
    "column_parallel_linear",
    "column_tree_linear",
    "row_parallel_linear",
    "shard",
    "tree_linear",
    "vocab_parallel_linear_logprobs",
]
