"""Mixture-of-experts: the router's softmax / top-k and the experts' SwiGLU MLPs, combined.

Float64 throughout, rounded once at the end: the routing weights to float32, the layer's output
to the input dtype. The backward is autograd through the float64 graph (the expert indices get
no gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["moe_route", "moe_route_grouped", "moe_experts"]


def route_order(logits: torch.Tensor) -> torch.Tensor:
    """The experts of each row of ``logits [T, E]`` by decreasing logit, int64 ``[T, E]``.

    Ties go to the lower expert index, ``-0.0`` equals ``+0.0``, and NaN ranks above every
    number (a NaN row then has NaN weights, whatever its order)."""
    key = logits.double()
    # torch.sort treats NaN as larger than any number; ``stable`` keeps equal keys (ties, and
    # -0.0 against +0.0) in index order.
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def moe_route(
    logits: torch.Tensor, top_k: int, normalize: bool = False, *, table=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``top_k`` experts of each row of ``logits [T, E]`` and their routing weights.

    Returns ``(weights, indices)``: float32 ``[T, top_k]`` and int64 ``[T, top_k]``, ranked by
    decreasing logit (ties: the lower expert index first). ``weights`` are the softmax over all
    E experts at the chosen ones, or with ``normalize`` the softmax over the chosen k alone
    (Qwen-MoE's ``norm_topk_prob``: the top-k probabilities divided by their sum).
    """
    z = logits.double()
    indices = route_order(logits)[:, :top_k].contiguous()
    m = z.max(dim=-1, keepdim=True).values  # NaN where the row holds one
    e = torch.exp(z - m)
    picked = e.gather(1, indices)
    total = picked.sum(-1, keepdim=True) if normalize else e.sum(-1, keepdim=True)
    return (picked / total).to(torch.float32), indices


def moe_route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    scale: float = 1.0,
    *,
    table=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited sigmoid router over ``logits [T, E]`` with the selection
    ``bias [E]``: ``(weights, indices)``, float32 and int64 ``[T, top_k]`` (see
    :func:`rlk.moe_route_grouped`). ``s = sigmoid(logits)``, ``c = s + bias``; the
    ``topk_group`` groups (``E / n_group`` consecutive experts) of largest top-2 sum of ``c``,
    then the ``top_k`` largest ``c`` among them, ties to the lower index; weights ``s`` there,
    over their sum + 1e-20 with ``normalize``, times ``scale``."""
    T, E = logits.shape
    s = torch.sigmoid(logits.double())
    c = s.detach() + bias.double()
    size = E // n_group
    top2 = c.view(T, n_group, size).gather(2, route_order(c.view(T, n_group, size))[..., :2])
    groups = route_order(top2[..., 0] + top2[..., 1])[:, :topk_group]
    allowed = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device)
    allowed.scatter_(1, groups, True)
    allowed = allowed.repeat_interleave(size, dim=1)
    order = route_order(c)
    # The allowed experts first, each part still by decreasing c (a stable sort of a flag).
    first = torch.sort((~allowed.gather(1, order)).to(torch.int8), dim=1, stable=True).indices
    indices = order.gather(1, first)[:, :top_k].contiguous()
    picked = s.gather(1, indices)
    if normalize:
        picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
    return (picked * scale).to(torch.float32), indices


def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    table=None,
) -> torch.Tensor:
    """``out[t] = sum_r weights[t, r] * expert(indices[t, r], x[t])`` -> ``[T, H]``, x's dtype.

    ``x [T, H]``, ``indices [T, k]`` (int, in ``[0, E)``), ``weights [T, k]``,
    ``gate_up [E, 2I, H]`` (gate rows then up rows, transformers' layout), ``down [E, H, I]``;
    ``expert(e, v) = down[e] @ (silu(g) * u)`` with ``[g; u] = gate_up[e] @ v``."""
    xd = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = down.shape[2]
    for e in torch.unique(indices).tolist():
        tok, rank = torch.nonzero(indices == e, as_tuple=True)
        gu = xd[tok] @ gate_up[e].double().T
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ down[e].double().T
        contrib = weights.double()[tok, rank][:, None] * y
        out = out.index_add(0, tok, contrib)
    return out.to(x.dtype)
