"""Tree-ordered and tensor-parallel linears, vocabulary-parallel log-probabilities (float64).

The float64 oracle of ``rlk.parallel``'s optional ops. In float64 the order of the reduction
changes nothing the oracle is used for (accuracy), so ``leaves`` sets no order here: one device
is :func:`~rlk_reference.linear`. Under tensor
parallelism ``exchange`` (built by ``rlk.parallel``: ``rank``, ``world``, ``gather(t)``,
``reduce(partial, bias, dtype)``) carries the ranks' float64 partial values; autograd runs
through the float64 graph, with the two exchanges made differentiable below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlk_reference._dense import linear
from rlk_reference._logprobs import result_dtype

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = [
    "tree_linear",
    "column_tree_linear",
    "vocab_parallel_linear_logprobs",
    "expert_parallel_moe_experts",
]


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of the ranks' ``partial`` (replicated result). Backward: the identity,
    since every rank holds the same replicated loss."""

    @staticmethod
    def forward(ctx, partial, exchange):
        return exchange.reduce(partial, None, partial.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SumGradOverRanks(torch.autograd.Function):
    """Forward: the identity on a replicated input. Backward: its gradient summed over the
    ranks (each rank's graph holds its own share of the input's uses)."""

    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.exchange.reduce(g.contiguous(), None, g.dtype), None


class _Gather(torch.autograd.Function):
    """Forward: every rank's ``t`` stacked in rank order. Backward: this rank's slot (the
    gathered values feed the same replicated loss on every rank)."""

    @staticmethod
    def forward(ctx, t, exchange):
        ctx.rank = exchange.rank
        return torch.stack(exchange.gather(t.contiguous()), 0)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank], None


def _finish(y, bias, dtype):
    return (y if bias is None else y + bias.double()).to(dtype)


def tree_linear(x, weight, bias=None, leaves=8, *, exchange=None, table=None):
    """``x [T, K] @ weight[N, K].T + bias [N]`` -> ``[T, N]`` in x's dtype. With ``exchange``,
    ``x`` and ``weight`` are this rank's K-shard and the ranks' float64 products are summed."""
    if exchange is None:
        return linear(x, weight, bias)
    return _finish(_SumOverRanks.apply(x.double() @ weight.double().T, exchange), bias, x.dtype)


def column_tree_linear(x, weight, bias=None, leaves=8, *, exchange=None, table=None):
    """:func:`linear`. With ``exchange``, ``weight`` and ``bias`` are this rank's N-slice and
    the gradient of the replicated ``x`` is summed over the ranks."""
    if exchange is None:
        return linear(x, weight, bias)
    return _finish(_SumGradOverRanks.apply(x.double(), exchange) @ weight.double().T, bias, x.dtype)


def vocab_parallel_linear_logprobs(hidden, weight, targets, bias, temperature, return_entropy,
                                   logits_dtype, *, exchange, table=None):  # fmt: skip
    """``linear_logprobs`` of the full lm_head from this rank's rows ``weight [V_r, H]``
    (rows ``rank*V_r ..``) of it; ``targets`` index the whole vocabulary."""
    v_local = weight.shape[0]
    h = _SumGradOverRanks.apply(hidden.double(), exchange)
    logits = h @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if hidden.dtype != torch.float64:  # rounded as the unfused path materialises them
        logits = logits.to(logits_dtype or hidden.dtype)
    z = logits.double() / temperature
    # This rank's statistics of its rows, gathered; everything after the gather is the same
    # function of the same values on every rank (what _Gather's backward relies on).
    lse_r = torch.logsumexp(z, -1)
    local = targets - exchange.rank * v_local
    mine = (local >= 0) & (local < v_local)  # only the owner of a target holds its logit
    zt = z.gather(-1, local.clamp(0, v_local - 1)[:, None])[:, 0]
    p_r = (z - lse_r[:, None]).exp()  # softmax over this rank's rows
    mean_z = (p_r * torch.where(p_r > 0, z, torch.zeros_like(z))).sum(-1)  # p log p = 0 at p = 0
    stats = _Gather.apply(torch.stack([lse_r, torch.where(mine, zt, 0.0), mean_z]), exchange)
    lse = torch.logsumexp(stats[:, 0], 0)
    lp = stats[:, 1].sum(0) - lse
    out = result_dtype(hidden)
    if not return_entropy:
        return lp.to(out)
    # entropy = lse - E_p[z], and E_p[z] = sum over ranks of exp(lse_r - lse) * E_{p_r}[z].
    entropy = lse - ((stats[:, 0] - lse).exp() * stats[:, 2]).sum(0)
    return lp.to(out), entropy.to(out)


class _AllToAll(torch.autograd.Function):
    """Forward: ``exchange.all_to_all(t, send, recv)``. Backward: the rows' gradients sent
    back the way they came."""

    @staticmethod
    def forward(ctx, t, send, recv, exchange):
        ctx.counts, ctx.exchange = (send, recv), exchange
        return exchange.all_to_all(t, send, recv)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.counts
        return ctx.exchange.all_to_all(g.contiguous(), recv, send), None, None, None


def expert_parallel_moe_experts(x, indices, weights, gate_up, down, *, exchange, table=None):
    """:func:`~rlk_reference.moe_experts` of this rank's tokens ``x [T, H]`` (``indices [T, k]``
    in ``[0, world * E_r)``, ``weights [T, k]``) with this rank's experts ``gate_up [E_r, 2I,
    H]`` / ``down [E_r, H, I]`` (experts ``rank*E_r ..``): each pair's float64 expert output is
    computed on its expert's rank and sent back; a token's terms are added as
    :func:`~rlk_reference.moe_experts` adds them (by ascending expert), rounded once."""
    T, k = indices.shape
    per, inter = gate_up.shape[0], down.shape[2]
    flat = indices.reshape(-1).to(torch.int64)
    dest = torch.div(flat, per, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    send = torch.bincount(dest, minlength=exchange.world).tolist()
    recv = exchange.counts(send, x.device)
    xp = _AllToAll.apply(x.double().index_select(0, order // k), send, recv, exchange)
    expert = exchange.all_to_all(flat[order], send, recv) - exchange.rank * per
    y = xp.new_zeros(xp.shape)
    for e in torch.unique(expert).tolist():
        rows = torch.nonzero(expert == e)[:, 0]
        gu = xp[rows] @ gate_up[e].double().T
        y = y.index_copy(0, rows, (F.silu(gu[:, :inter]) * gu[:, inter:]) @ down[e].double().T)
    y = _AllToAll.apply(y, recv, send, exchange)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=order.device))
    terms = (weights.double().reshape(-1, 1) * y.index_select(0, inv)).view(T, k, -1)
    by_expert = torch.sort(indices, dim=1, stable=True).indices
    out = x.new_zeros(x.shape, dtype=torch.float64)
    for j in range(k):
        out = out + terms[torch.arange(T, device=x.device), by_expert[:, j]]
    return out.to(x.dtype)
