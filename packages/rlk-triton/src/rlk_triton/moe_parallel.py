"""Expert parallelism on the MoE kernels: ``rlk.parallel.expert_parallel_moe_experts``.

The experts are sharded over the ranks (rank j holds experts ``j*E_r .. (j+1)*E_r``); each rank
has its own tokens. The numerics are those of :func:`rlk_triton.moe.moe_experts` on one device,
bit for bit, because the work is split where that op keeps per-pair values:

- Forward. A token's (token, rank) pairs go, as rows of x, to the ranks holding their experts
  (an all-to-all). There :func:`rlk_triton.moe._expert_outputs` computes each pair's unweighted
  fp32 expert output ``y`` by the one-device grouped kernels, whose slot bits depend on the
  slot's row and its expert's weights only. The fp32 rows come back (a second all-to-all) and
  the token's rank runs the one-device combine kernel, ``sum_r weights[t, r] * y[t, r]`` in
  ascending rank r: the order is the columns of ``indices``, never the order of arrival.
- Backward. The output's gradient rows and the pairs' weights go to the experts' ranks, which
  run :func:`rlk_triton.moe._experts_backward` on their pairs (``combine=False``: the fp32 dX
  rows per pair) and keep the gradients of their experts; the fp32 dX rows and the pairs'
  d(weights) come back and the token's rank adds dX by the one-device combine. An expert's
  rank orders the pairs it receives by (source rank, token, rank r), so an expert's slots are
  in the order one device gives the ranks' batches concatenated: the weight gradients, summed
  over slots in that order, are that device's shard.

Each call moves, per pair, one row of x's dtype and one fp32 row (and the same again, plus a
weight, in the backward), and one ``world``-int count exchange.
"""

from __future__ import annotations

import torch

from rlk_triton import moe

#: The ops this module holds (the backend binds each to its tuning table).
__all__ = ["expert_parallel_moe_experts"]


class _Plan:
    """How one call deals its pairs out: ``order`` the flat pairs (``t * k + r``) grouped by
    the rank holding their expert, each group in flat order (a stable integer sort);
    ``token`` their tokens; ``send[j]``/``recv[j]`` how many pairs go to / come from rank j;
    ``inv[f]`` the row of flat pair f among the rows that come back (what the combine reads:
    the pair's rank-order position, whatever the arrival). Out-of-range indices on any rank
    are a ``ValueError`` on every rank (signalled through the count exchange, so no rank is
    left waiting in an all-to-all)."""

    def __init__(self, indices: torch.Tensor, per_rank: int, exchange):
        T, k = indices.shape
        world = exchange.world
        flat = indices.reshape(-1).to(torch.int64)
        dest = torch.div(flat, per_rank, rounding_mode="floor")
        bad = (flat < 0) | (dest >= world)
        counts = torch.bincount(torch.where(bad, world, dest), minlength=world + 1).tolist()
        self.send = counts[:world] if counts[world] == 0 else [-1] * world
        self.recv = exchange.counts(self.send, indices.device)
        if -1 in self.send or -1 in self.recv:
            rank = exchange.rank if -1 in self.send else self.recv.index(-1)
            raise ValueError(
                f"indices: an expert id outside [0, {per_rank * world}) on rank {rank} "
                f"(there are {per_rank * world} experts)"
            )
        self.order = torch.sort(dest, stable=True).indices
        self.token = torch.div(self.order, k, rounding_mode="floor")
        self.inv = torch.empty_like(self.order).scatter_(
            0, self.order, torch.arange(T * k, dtype=torch.int64, device=indices.device)
        )
        self.experts = per_rank * world  # the combine's index bound


def _to_experts(plan: _Plan, exchange, t: torch.Tensor) -> torch.Tensor:
    """Rows ``t[f]`` of every pair, sent to the ranks of their experts (rows received)."""
    return exchange.all_to_all(t, plan.send, plan.recv)


def _to_owners(plan: _Plan, exchange, t: torch.Tensor) -> torch.Tensor:
    """Per received pair rows back to the tokens' ranks, in ``plan.order``'s order."""
    return exchange.all_to_all(t, plan.recv, plan.send)


def _forward(x, indices, weights, gate_up, down, exchange, table, keep):
    per_rank = gate_up.shape[0]
    plan = _Plan(indices, per_rank, exchange)
    xp = _to_experts(plan, exchange, x.index_select(0, plan.token))
    expert = _to_experts(plan, exchange, indices.reshape(-1).to(torch.int64)[plan.order])
    local = (expert - exchange.rank * per_rank)[:, None]
    d, gu, h, y = moe._expert_outputs(xp, local, gate_up, down, table, keep)
    y = _to_owners(plan, exchange, y.index_select(0, d.inv))
    out = torch.empty_like(x)
    moe._combine(table, plan, y, indices, weights, out)
    return out, (plan, xp, local, d, gu, h)


class _ExpertParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, weights, gate_up, down, exchange, table):
        out, (plan, xp, local, d, gu, h) = _forward(
            x, indices, weights, gate_up, down, exchange, table, keep=True
        )
        ctx.save_for_backward(indices, weights, gate_up, down, xp, local, gu, h)
        ctx.plan, ctx.dispatch, ctx.exchange, ctx.table = plan, d, exchange, table
        return out

    @staticmethod
    def backward(ctx, dout):
        indices, weights, gate_up, down, xp, local, gu, h = ctx.saved_tensors
        plan, ex, table = ctx.plan, ctx.exchange, ctx.table
        needs = ctx.needs_input_grad
        dout = torch.zeros(indices.shape[0], xp.shape[1], dtype=xp.dtype, device=xp.device) \
            if dout is None else dout.contiguous()  # fmt: skip
        dp = _to_experts(plan, ex, dout.index_select(0, plan.token))
        wp = _to_experts(plan, ex, weights.reshape(-1)[plan.order])[:, None]
        # Every rank computes its pairs' dX rows and d(weights): the tokens' ranks, not this
        # one, know whether they need them, and every rank must take part in the exchange.
        dxs, dwp, dgate_up, ddown = moe._experts_backward(
            dp, xp, local, wp, gate_up, down, gu, h, ctx.dispatch, table,
            (True, True, needs[3], needs[4]), combine=False,
        )  # fmt: skip
        dxs = _to_owners(plan, ex, dxs.index_select(0, ctx.dispatch.inv))
        dw = _to_owners(plan, ex, dwp.reshape(-1)).index_select(0, plan.inv)
        dx = None
        if needs[0]:
            dx = torch.empty(indices.shape[0], xp.shape[1], dtype=xp.dtype, device=xp.device)
            moe._combine(table, plan, dxs, indices, None, dx)
        return dx, None, dw.view(indices.shape), dgate_up, ddown, None, None


def expert_parallel_moe_experts(x, indices, weights, gate_up, down, *, exchange, table):
    """``rlk.moe_experts`` of this rank's tokens with the experts sharded over ``exchange``'s
    ranks (see the module docstring and ``rlk.parallel.expert_parallel_moe_experts``).

    Shapes: ``x [T_r, H]`` (bf16/fp16/fp32), ``indices [T_r, k]`` (int, expert ids in ``[0,
    world * E_r)``), ``weights [T_r, k]`` (float), ``gate_up [E_r, 2I, H]`` and ``down [E_r,
    H, I]``: this rank's experts ``rank*E_r .. (rank+1)*E_r`` -> ``[T_r, H]`` in x's dtype,
    bitwise ``moe_experts`` on one device. Differentiable in ``x``, ``weights``, ``gate_up``
    and ``down``; every rank must run the backward.

    Example (one rank: the exchange of ``rlk.parallel`` with world 1)::

        out = expert_parallel_moe_experts(x, idx, w, gate_up, down,
                                          exchange=rlk.parallel.Exchange(0, 1), table=table)
    """
    x, indices, weights = x.contiguous(), indices.contiguous(), weights.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, gate_up, down)):
        return _ExpertParallelFunction.apply(x, indices, weights, gate_up, down, exchange, table)
    return _forward(x, indices, weights, gate_up, down, exchange, table, keep=False)[0]
