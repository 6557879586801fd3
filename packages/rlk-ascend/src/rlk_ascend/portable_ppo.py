"""PPO's critic side in the portable backend: ``gae_advantages`` and ``value_loss``, in PyTorch
with the fixed-order sums of :mod:`rlk_ascend.portable`. Semantics: the docstrings of
``rlk.gae_advantages`` and ``rlk.value_loss``.

The GAE scan is elementwise on the ``[B]`` column of each position, from the last position to
the first, so a row's results are computed by the same operations whatever the batch; the
whitening statistics and the value loss's sums go through :func:`fixed_sum`.
"""

from __future__ import annotations

import math

import torch

from rlk_ascend.portable_losses import _div, _masked_mean, _total, aggregate

#: The variance floor of the advantages' whitening (verl's ``masked_whiten``).
WHITEN_EPS = 1e-8


def _nan_where_not_0_or_1(x, mask):
    """``x`` plus NaN where ``mask`` holds a value other than 0 or 1 (reachable where the host
    does not check it): NaN results there, as on the other backends. ``x + nan``: the gradient
    flows."""
    if mask.dtype == torch.bool:
        return x
    return torch.where((mask == 0) | (mask == 1), x, x + math.nan)


def gae_advantages(rewards, values, mask, *, gamma=1.0, lam=1.0, whiten=True, table=None):
    """GAE ``(advantages, returns)``, fp32 ``[B, L]``, 0 outside ``mask``."""
    m = mask.bool()
    r = _nan_where_not_0_or_1(torch.where(m, rewards.float(), 0.0), mask)
    v = torch.where(m, values.float(), 0.0)
    adv = torch.zeros_like(r)
    v_next = r.new_zeros(r.shape[0])
    a_next = r.new_zeros(r.shape[0])
    gamma_lam = float(gamma) * float(lam)  # rounded once, as the other backends do
    for t in reversed(range(r.shape[1])):
        here = m[:, t]
        a_t = r[:, t] + gamma * v_next - v[:, t] + gamma_lam * a_next
        v_next = torch.where(here, v[:, t], v_next)
        a_next = torch.where(here, a_t, a_next)
        adv[:, t] = torch.where(here, a_t, 0.0)
    returns = torch.where(m, adv + v, 0.0)
    if whiten:
        n = m.sum()
        mu = _div(_total(adv), n)
        centred = torch.where(m, adv - mu, 0.0)
        var = torch.where(n >= 2, _div(_total(centred * centred), n - 1), 0.0)
        adv = torch.where(m, centred / torch.sqrt(var + WHITEN_EPS), 0.0)
    return adv, returns


def value_loss(
    values,
    old_values,
    returns,
    mask,
    *,
    clip=0.5,
    agg="token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_length=None,
    table=None,
):
    """The clipped value loss: ``(loss, {"clip_fraction"})``; autograd gives the backward
    (elementwise, then a broadcast of the sums)."""
    m = mask.bool()
    v = _nan_where_not_0_or_1(torch.where(m, values.float(), 0.0), mask)
    old = torch.where(m, old_values.detach().float(), 0.0)
    ret = torch.where(m, returns.detach().float(), 0.0)
    d1 = v - ret
    term = d1 * d1
    clipped = torch.zeros_like(m)
    if clip is not None:
        d2 = torch.max(torch.min(v, old + clip), old - clip) - ret
        l2 = d2 * d2
        clipped = l2 > term
        # The clipped term's gradient where it wins: 0 (v is beyond the clip range).
        term = torch.where(clipped, l2.detach(), term)
    loss = aggregate(0.5 * term, m, agg, num_tokens, num_seqs, norm_length)
    return loss, {"clip_fraction": _masked_mean(clipped.float(), m).detach()}
