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
same ``leaves``, and the forward and backward bits agree across TP degrees.

Where the code is: this module checks the arguments, owns the process groups and the
communication (:class:`Exchange`), and dispatches to the selected backend's optional ops
``tree_linear``, ``column_tree_linear`` and ``vocab_parallel_linear_logprobs`` (see
``rlk/_catalog.py``), which hold the kernels and the ``autograd.Function``s (rlk-triton:
``tree_gemm.py``, ``vocab_parallel.py``; the float64 reference has them too). A backend
without them raises :class:`BackendError` naming the backends that have them (rlk never falls
back to another kernel). Cost and limits: docs/design/parallel.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from rlk import _validate as chk
from rlk import selection
from rlk._catalog import op
from rlk.ops.dense import check_linear
from rlk.ops.logprobs import check_linear_logprobs
from rlk.ops.moe import check_experts


def __getattr__(name: str) -> Any:
    # TREE_BACKENDS (kept for callers of the earlier constant) is asked of the installed
    # backends, loading them, when it is read; it is not in __all__ for that reason.
    if name == "TREE_BACKENDS":
        return tree_backends()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tree_backends(device: Any = None) -> tuple[str, ...]:
    """The installed backends available for ``device`` (default: cuda if present, else cpu)
    that implement the tree-ordered linears (also readable as ``TREE_BACKENDS``)."""
    return tuple(selection.claimants("tree_linear", selection.device_type(device)))


def _leaves(leaves: object) -> int:
    if isinstance(leaves, bool) or not isinstance(leaves, int):
        raise TypeError(f"leaves must be an int, got {type(leaves).__name__}")
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"leaves must be a power of two, got {leaves}")
    return leaves


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


def check_leaves(leaves: object, world: int = 1) -> int:
    """The K-leaves rule of the tree-ordered linears, for callers outside rlk (a model patch,
    a command's arguments): ``leaves`` must be an int power of two and a tensor-parallel
    size ``world`` a power of two dividing it. Returns the leaves per rank, ``leaves //
    world``; raises ``TypeError``/``ValueError`` naming ``leaves`` otherwise.

    Example::

        check_leaves(8, world=2)   # 4
        check_leaves(6)            # ValueError: leaves must be a power of two, got 6
    """
    return _tp_leaves(_leaves(leaves), world)


def group_info(group: Any = None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (default: the world); ``(0, 1)`` when
    torch.distributed is not initialised (a ``ValueError`` if ``group`` is given then)."""
    return _group_info(group)


def gather_columns(y: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The ranks' column blocks ``y [..., n]`` of ``group`` concatenated in rank order:
    ``[..., n * size]`` (an all-gather; an exact copy, so any order of arrival gives the same
    bits). Differentiable: the gradient keeps this rank's block of the (replicated) output's
    gradient, as :func:`column_parallel_linear`'s ``gather_output`` does.

    Example::

        logits = gather_columns(rlk.linear(h, lm_head_shard))   # [T, V] on every rank
    """
    rank, world = _group_info(group)
    out = _GatherColumns.apply(_rows(y), rank, world, group)
    return out.reshape(*y.shape[:-1], out.shape[-1])


def _all_gather(t: torch.Tensor, world: int, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    if world == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


#: Vocabulary leaves of ``linear_logprobs``' fixed tree (a power of two), part of the numerics
#: every backend serving ``vocab_parallel_linear_logprobs`` keeps: a vocabulary-parallel group
#: may have any power-of-two size up to this, over a vocabulary that is a multiple of it. Each
#: leaf costs a row a column tree and the fused backward a dh GEMM, so it is no larger than the
#: TP degrees served (32 leaves made rlk-triton's forward 2.6x and linear_logprobs'
#: forward+backward 1.6x slower on an H200 than one leaf).
VOCAB_LEAVES = 8


def vocab_splits(vocab: int, world: int) -> bool:
    """Whether :func:`vocab_parallel_linear_logprobs` takes a ``vocab``-row lm_head split over
    ``world`` ranks: a power-of-two group dividing the leaves, a vocabulary that is a multiple
    of them."""
    return vocab % VOCAB_LEAVES == 0 and VOCAB_LEAVES % world == 0 and not world & (world - 1)


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


def tree_combine(parts):
    """Sum tensors (a power-of-two count, in leaf order) by the balanced binary tree.

    ``((p0 + p1) + (p2 + p3)) + ...``: the order of the tree-ordered ops, shared by the ranks'
    exchange here and the backends' per-leaf paths. Streams: at most ``log2(len) + 1`` partial
    sums are alive. The left operand of each add is reused as its output (adds are correctly
    rounded, so where the result lives changes nothing). A part may be ``None``: an empty leaf,
    the exact identity (``None`` if every part is).
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


def finish(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Add the bias to the fp32 root and round once to ``dtype`` (as the GEMM kernel does)."""
    if bias is not None:
        acc = acc.add_(bias.to(torch.float32))
    return acc.to(dtype)


def _tree_reduce(local, world, group, bias, dtype):
    """``finish(top of the tree over the ranks' subtree values, bias, dtype)`` on every rank:
    the deterministic replacement of an all-reduce. ``local``: this rank's fp32 [M, N] (float64
    from the reference backend), a fresh value of the caller's that the halving exchange may
    sum into in place."""
    import torch.distributed as dist

    if world == 1 or _exchange() == "gather":
        return finish(tree_combine(_all_gather(local, world, group)), bias, dtype)
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
    mine = finish(buf[lo * rows : (lo + 1) * rows], bias, dtype)
    # Gather each rank's finished rows straight into the row block it holds.
    out = torch.empty(rows * world, N, dtype=dtype, device=local.device)
    blocks = [_halving_owner(r, world) for r in range(world)]
    dist.all_gather(
        [out[b * rows : (b + 1) * rows] for b in blocks], mine.contiguous(), group=group
    )
    return out[:M]


@dataclass(frozen=True)
class Exchange:
    """What a backend's tensor-parallel op gets to combine the ranks' values (rank ``rank`` of
    ``world`` in ``group``). The backend computes; this moves data and adds the tree's top.

    - ``gather(t)``: every rank's ``t`` (same shape and dtype on all), in rank order.
    - ``reduce(partial, bias, dtype)``: the top of the tree over the ranks' subtree values
      ``partial`` ([M, N], fp32, or float64 from the reference backend; this rank's fresh
      tensor, which may be summed into), plus ``bias``, rounded once to ``dtype``; the same
      result on every rank (``RLK_TP_EXCHANGE`` picks how: :data:`EXCHANGES`).
    - ``counts(send, device)``: ``send[j]`` is how many rows this rank sends rank j; returns
      how many each rank sends this one (a list of ``world`` ints, read on the host; exchanged
      as a tensor on ``device``, the device of the data that follows).
    - ``all_to_all(t, send, recv)``: the rows of ``t [M, ...]`` dealt out in order, ``send[0]``
      rows to rank 0, the next ``send[1]`` to rank 1, ...; returns the rows received,
      ``recv[j]`` from rank j, in rank order (exact copies: the bits never depend on which
      message arrives first). Expert parallelism moves tokens and expert outputs with it.
    """

    rank: int
    world: int
    group: Any = None

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return _all_gather(t, self.world, self.group)

    def reduce(self, partial: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        return _tree_reduce(partial, self.world, self.group, bias, dtype)

    def counts(self, send: list[int], device: Any = None) -> list[int]:
        if self.world == 1:
            return list(send)
        import torch.distributed as dist

        # On ``device``: NCCL moves only tensors of the rank's GPU (gloo, CPU ones).
        mine = torch.tensor(send, dtype=torch.int64, device=device)
        out = torch.empty_like(mine)
        dist.all_to_all_single(out, mine, group=self.group)
        return out.tolist()

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        t = t.contiguous()
        if self.world == 1:
            return t
        import torch.distributed as dist

        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t, recv, send, group=self.group)
        return out


def _exchange_of(group) -> Exchange | None:
    """The exchange of ``group``; None on one rank (the ops then run their one-device path,
    which has the same bits)."""
    rank, world = _group_info(group)
    return None if world == 1 else Exchange(rank, world, group)


def _op(device: torch.device, op: str, caller: str):
    return selection.optional_op(device, op, f"rlk.parallel.{caller}")


# --------------------------------------------------------------------------------------------
# One device
# --------------------------------------------------------------------------------------------


# The tree-ordered linears: K (tree_linear) or dX's N (column_tree_linear) reduced by a fixed
# tree of leaves; the backend's ``exchange`` tops the tree over tensor-parallel ranks.
_TREE_OP = op(
    "tree_gemm",
    kwonly=("exchange",),
    grad_args=("x", "weight", "bias"),
    unit_grads=("x",),
    optional=True,
)


@_TREE_OP
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
    device = check_linear(x, weight, bias)
    _divides(leaves, x.shape[-1], "K = x.shape[-1]")
    fn = _op(device, "tree_linear", "tree_linear")
    y = fn(_rows(x), weight, bias, leaves, exchange=None)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@_TREE_OP
def column_tree_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, leaves: int = 8
) -> torch.Tensor:
    """:func:`rlk.linear`'s forward bits; the backward's dX reduces N by a tree of ``leaves``.

    Shapes as ``rlk.linear``; ``leaves``: a power of two dividing N. The one-device twin of
    :func:`column_parallel_linear` (whose ranks split N, so dX = dY @ W is a sum over ranks).

    Example::

        y = rlk.parallel.column_tree_linear(torch.randn(4, 64), torch.randn(32, 64), leaves=8)
    """
    leaves = _leaves(leaves)
    device = check_linear(x, weight, bias)
    _divides(leaves, weight.shape[0], "N = weight.shape[0]")
    fn = _op(device, "column_tree_linear", "column_tree_linear")
    y = fn(_rows(x), weight, bias, leaves, exchange=None)
    return y.reshape(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------------------------
# Tensor-parallel (torch.distributed)
# --------------------------------------------------------------------------------------------


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

    Example::

        y = rlk.parallel.row_parallel_linear(x_shard, o_proj_shard, leaves=8, group=tp)
    """
    leaves = _leaves(leaves)
    device = check_linear(x, weight, bias)
    _, world = _group_info(group)
    per_rank = _tp_leaves(leaves, world)
    _divides(per_rank, x.shape[-1], f"this rank's K-shard x.shape[-1] (leaves / {world} ranks)")
    fn = _op(device, "tree_linear", "row_parallel_linear")
    y = fn(_rows(x), weight, bias, per_rank, exchange=_exchange_of(group))
    return y.reshape(*x.shape[:-1], weight.shape[0])


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

    Example::

        y = rlk.parallel.column_parallel_linear(x, gate_up_shard, leaves=8, group=tp)
    """
    leaves = _leaves(leaves)
    device = check_linear(x, weight, bias)
    if not isinstance(gather_output, bool):
        raise TypeError(f"gather_output must be a bool, got {type(gather_output).__name__}")
    rank, world = _group_info(group)
    per_rank = _tp_leaves(leaves, world)
    _divides(per_rank, weight.shape[0], f"this rank's N-shard weight.shape[0] (leaves / {world})")
    fn = _op(device, "column_tree_linear", "column_parallel_linear")
    y = fn(_rows(x), weight, bias, per_rank, exchange=_exchange_of(group))
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


@op(
    "vocab_parallel",
    kwonly=("exchange",),
    grad_args=("hidden", "weight", "bias"),
    out_dtype="float32",
    optional=True,
)
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

    Rank r of the group (size t) passes the replicated ``hidden [T, H]`` and ``targets`` int64
    ``[T]`` (ids in the whole vocabulary of ``V = t * V_r``), its rows ``weight [V_r, H]`` of the
    lm_head (rows ``r*V_r .. (r+1)*V_r``, Megatron's vocabulary-parallel layout) and the same
    slice of ``bias``. Every rank returns the float32 ``[T]`` log-probabilities (and entropy),
    bitwise equal to ``rlk.linear_logprobs`` of the full lm_head on one device. Without an
    initialised process group it is ``rlk.linear_logprobs``. The backend may restrict the
    split: rlk-triton's kernels need t a power of two dividing their vocabulary leaves
    (:data:`VOCAB_LEAVES`, defined here) and V a multiple of them (a ``ValueError`` says so).

    How: the log-sum-exp is a fixed tree over vocabulary leaves; a rank's rows are a subtree,
    so each rank merges its own leaves, the ranks all-gather their ``(max, sum-exp, entropy
    term, target logit)`` (16 bytes per token per rank) and merge the top of the tree. Backward:
    dW, dbias local; dHidden sums over the vocabulary, so each rank's fp32 ``[T, H]`` subtree is
    all-gathered and topped by the same tree (instead of Megatron's all-reduce).

    Example::

        lp = rlk.parallel.vocab_parallel_linear_logprobs(h, lm_head_shard, tokens, group=tp)
    """
    _, world = _group_info(group)
    device, targets, temperature, logits_dtype = check_linear_logprobs(
        hidden, weight, targets, bias, temperature, logits_dtype, weight.shape[0] * world
    )
    return_entropy = chk.flag("return_entropy", return_entropy)
    args = (hidden, weight, targets, bias, temperature, return_entropy, logits_dtype)
    exchange = _exchange_of(group)
    if exchange is None:  # one rank holds the whole lm_head
        return selection.backend_impl(device).ops["linear_logprobs"](*args)
    fn = _op(device, "vocab_parallel_linear_logprobs", "vocab_parallel_linear_logprobs")
    return fn(hidden.contiguous(), weight, targets.contiguous(), *args[3:], exchange=exchange)


# --------------------------------------------------------------------------------------------
# Expert parallelism
# --------------------------------------------------------------------------------------------


@op(
    "moe_parallel",
    kwonly=("exchange",),
    grad_args=("x", "weights", "gate_up", "down"),
    unit_grads=("x", "weights"),
    optional=True,
)
def expert_parallel_moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    group: Any = None,
) -> torch.Tensor:
    """:func:`rlk.moe_experts` with the experts sharded over the ranks of ``group``, each
    token's output and gradients bitwise those of one rank holding every expert.

    Rank r of the group (size t) passes its own tokens ``x [T_r, H]`` with their ``indices
    [T_r, k]`` (expert ids in the whole ``[0, E)``) and ``weights [T_r, k]``, and its experts:
    ``gate_up [E/t, 2I, H]`` and ``down [E/t, H, I]`` are experts ``r*E/t .. (r+1)*E/t`` of the
    full ``[E, 2I, H]`` / ``[E, H, I]`` (:func:`shard` along dim 0). Returns ``[T_r, H]`` in
    x's dtype. Without an initialised process group (t = 1) it runs the same code path, and
    returns ``rlk.moe_experts``' bits.

    How: each (token, rank) pair's row goes to the rank holding its expert (an all-to-all);
    that rank computes the pair's unweighted fp32 expert output exactly as ``moe_experts``
    holds it before its combine (the same grouped kernels: a slot's bits depend on its row and
    its expert's weights only); a second all-to-all returns the fp32 rows, and the token's own
    rank adds ``weights[t, r] * y[t, r]`` in ascending rank r with ``moe_experts``' combine,
    never in arrival order. Cost: per pair, one row of x's dtype out and one fp32 row back.

    Contract: every token's output, d(x) and d(weights) equal ``moe_experts`` on one device,
    bitwise, whatever t and whichever ranks the other tokens are on. The gradients of
    ``gate_up`` and ``down`` sum over the tokens that chose each expert, in token order: they
    equal the shard of one device's gradients when that device's batch is the ranks' batches
    concatenated in rank order. Every rank of the group must make the call (with T_r = 0 if it
    has no tokens), and, for a backward, run it. Backward: two more all-to-alls (the output's
    gradient rows out, fp32 d(x) rows and d(weights) back).

    Example::

        out = rlk.parallel.expert_parallel_moe_experts(
            x, indices, weights, shard(gate_up, 0, rank=r, world_size=t),
            shard(down, 0, rank=r, world_size=t), group=ep)
    """
    rank, world = _group_info(group)
    sharded = isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3
    check_experts(x, indices, weights, gate_up, down, gate_up.shape[0] * world if sharded else None)
    fn = _op(x.device, "expert_parallel_moe_experts", "expert_parallel_moe_experts")
    return fn(x.contiguous(), indices.contiguous(), weights.contiguous(), gate_up, down,
              exchange=Exchange(rank, world, group))  # fmt: skip


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
    "EXCHANGES",
    "Exchange",
    "check_leaves",
    "column_parallel_linear",
    "column_tree_linear",
    "expert_parallel_moe_experts",
    "gather_columns",
    "group_info",
    "row_parallel_linear",
    "shard",
    "tree_backends",
    "tree_linear",
    "vocab_parallel_linear_logprobs",
]
