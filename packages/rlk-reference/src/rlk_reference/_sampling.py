"""Seeded sampling: temperature, top-k, top-p, then Gumbel-max with Philox uniforms."""

from __future__ import annotations

import math

import torch

from rlk_reference._logprobs import scaled_overflow
from rlk_reference.philox import philox_uniform

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["sample"]


def _first_argmax(x: torch.Tensor) -> int:
    """Index of the maximum of a 1-D tensor, the lowest one among ties."""
    return int((x == x.max()).nonzero()[0, 0])


def keep_mask(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Tokens of one row of scaled logits ``z [V]`` (float64) that survive top-k then top-p."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        kth = torch.topk(z, top_k).values[-1]
        keep = z >= kth  # ties with the k-th value are kept
    if top_p < 1.0:
        z = z.masked_fill(~keep, float("-inf"))
        top = z == math.inf
        # With +inf logits the softmax's limit: their mass shared equally, none elsewhere (the
        # softmax itself would give inf - inf = NaN everywhere).
        p = top.double() / top.sum() if bool(top.any()) else torch.softmax(z, dim=-1)
        desc = p[keep].sort(descending=True).values
        mass = desc.cumsum(0)
        # The largest threshold t whose kept mass sum(p >= t) reaches top_p: the first sorted
        # value where the running sum does (ties with it are kept below by p >= t).
        reached = (mass >= top_p).nonzero()
        t = desc[reached[0, 0]] if reached.numel() else desc[-1]
        keep = keep & (p >= t)
    return keep


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    table=None,
) -> torch.Tensor:
    """``logits [B, V]``, int64 ``seeds``/``offsets [B]``, per-row ``temperature`` (float32,
    0 = greedy), ``top_k`` (int64, 0 = off), ``top_p`` (float32, 1 = off) -> int64 ``[B]``;
    ``top_k`` / ``top_p`` None: off for every row.

    Row ``b``: ``z = logits / temperature``; filter by top-k, then top-p; pick
    ``argmax(z + g)`` over the kept tokens with Gumbel noise ``g = -log(-log(u))`` and ``u`` from
    :func:`rlk_reference.philox.philox_uniform` (lowest index on ties). A row with a NaN logit,
    or an invalid temperature (< 0, infinite, NaN), top-k (< 0) or top-p (outside (0, 1]), or
    (temperature > 0) a finite logit whose ``logit / temperature`` overflows float32
    (:func:`~rlk_reference._logprobs.scaled_overflow`), draws no token: -1.
    """
    with torch.no_grad():
        b, vocab = logits.shape
        u = philox_uniform(seeds, offsets, vocab).double()
        gumbel = -torch.log(-torch.log(u))
        out = torch.empty(b, dtype=torch.int64)
        for row in range(b):
            x = logits[row].double()
            temp = float(temperature[row])
            k = int(top_k[row]) if top_k is not None else 0
            p = float(top_p[row]) if top_p is not None else 1.0
            # Invalid per-row values (reachable with the value checks off) draw no token either.
            if bool(x.isnan().any()) or not (0.0 <= temp < math.inf and k >= 0 and 0.0 < p <= 1.0):
                out[row] = -1
                continue
            if temp == 0.0:
                out[row] = _first_argmax(x)
                continue
            # Outside the domain: the kernels scale in float32, where such a z is infinite.
            if bool(scaled_overflow(logits[row], temperature[row].float()).any()):
                out[row] = -1
                continue
            z = x / temp
            keep = keep_mask(z, k, p)
            score = (z + gumbel[row]).masked_fill(~keep, float("-inf"))
            out[row] = _first_argmax(score)
        return out.to(logits.device)
