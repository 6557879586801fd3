"""PPO's critic side on padded ``[B, L]`` tensors: gae_advantages, value_loss.

The float64 oracle of ``rlk.gae_advantages`` and ``rlk.value_loss``: the arguments arrive
validated and normalised by ``rlk`` (the semantics are in those docstrings), and autograd gives
the backward.
"""

from __future__ import annotations

import math

import torch

from rlk_reference._logprobs import result_dtype
from rlk_reference._losses import _aggregate, _div, _masked_mean

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["gae_advantages", "value_loss"]

#: The variance floor of the advantages' whitening (verl's ``masked_whiten``).
WHITEN_EPS = 1e-8


def _nan_where_not_0_or_1(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` plus NaN where ``mask`` holds a value other than 0 or 1 (reachable without the
    host's value checks: a GPU without RLK_VALIDATE), so the results are NaN there, as in the
    kernels, never those of a mask of 1. ``x + nan``: a gradient still flows."""
    if mask.dtype == torch.bool:
        return x
    return torch.where((mask == 0) | (mask == 1), x, x + math.nan)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    table=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE ``(advantages, returns)``, each ``[B, L]`` (semantics: ``rlk.gae_advantages``).

    Backward over each row: on a token of ``mask``, ``delta = r + gamma * v_next - v`` and
    ``a = delta + gamma * lam * a_next``, where ``v_next``/``a_next`` are those of the row's
    next token of ``mask`` (0 past the last): tokens outside ``mask`` are skipped. ``returns =
    a + v``; with ``whiten`` the advantages are ``(a - mu) / sqrt(var + 1e-8)`` with the mean
    and unbiased variance over all tokens of ``mask`` (variance 0 below two tokens). Both
    outputs are 0 outside ``mask``.

    Example::

        adv, ret = gae_advantages(token_rewards, values, mask, gamma=1.0, lam=0.95)
    """
    m = mask.bool()
    r = _nan_where_not_0_or_1(torch.where(m, rewards.double(), 0.0), mask)
    v = torch.where(m, values.double(), 0.0)
    a = torch.zeros_like(r)
    v_next = r.new_zeros(r.shape[0])
    a_next = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        here = m[:, t]
        a_t = r[:, t] + gamma * v_next - v[:, t] + gamma * lam * a_next
        v_next = torch.where(here, v[:, t], v_next)
        a_next = torch.where(here, a_t, a_next)
        a[:, t] = torch.where(here, a_t, 0.0)
    returns = torch.where(m, a + v, 0.0)
    if whiten:
        n = m.sum()
        mu = _div(a.sum(), n)
        centred = torch.where(m, a - mu, 0.0)
        var = _div(centred.square().sum(), n - 1) if n >= 2 else 0.0 * mu
        a = torch.where(m, centred / torch.sqrt(var + WHITEN_EPS), 0.0)
    out = result_dtype(rewards)
    return a.to(out), returns.to(out)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    table=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (semantics: ``rlk.value_loss``): ``(loss, metrics)``.

    Per token ``0.5 * max((v - R)^2, (clamp(v, v_old - clip, v_old + clip) - R)^2)``
    (``clip=None``: ``0.5 * (v - R)^2``), aggregated as ``policy_loss``'s ``agg``. Only
    ``values`` gets a gradient; ``metrics["clip_fraction"]``: tokens whose clipped term is the
    larger.

    Example::

        loss, m = value_loss(v, old_v, returns, mask, clip=0.5)
    """
    out = result_dtype(values)
    m = mask.bool()
    v = _nan_where_not_0_or_1(torch.where(m, values.double(), 0.0), mask)
    old = torch.where(m, old_values.detach().double(), 0.0)
    ret = torch.where(m, returns.detach().double(), 0.0)
    unclipped = (v - ret).square()
    if clip is None:
        term, was_clipped = unclipped, torch.zeros_like(m)
    else:
        vc = torch.max(torch.min(v, old + clip), old - clip)
        clipped = (vc - ret).square()
        term, was_clipped = torch.maximum(unclipped, clipped), clipped > unclipped
    term = torch.where(m, 0.5 * term, 0.0)
    loss = _aggregate(term, m, agg, num_tokens, num_seqs, norm_length)
    metrics = {"clip_fraction": _masked_mean(was_clipped.double(), m).to(out)}
    return loss.to(out), metrics
