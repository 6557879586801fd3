"""Mixture-of-experts: the router's softmax / top-k and the experts' SwiGLU MLPs, combined.

Float64 throughout, rounded once at the end: the routing weights to float32, the layer's output
to the input dtype. The backward is autograd through the float64 graph (the expert indices get
no gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["moe_route", "moe_experts"]


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
