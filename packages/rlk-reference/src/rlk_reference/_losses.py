"""RL objectives on padded ``[B, L]`` tensors: policy_loss, kl_penalty, grpo_advantages."""

from __future__ import annotations

import torch

from rlk_reference._logprobs import result_dtype


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    return torch.where(mask, x, 0.0).sum() / n.clamp(min=1)


def _aggregate(pg: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce masked per-token losses ``pg [B, L]`` (zero where masked out) to a scalar."""
    if agg == "token-mean":
        return pg.sum() / mask.sum().clamp(min=1)
    if agg == "seq-mean-token-sum-norm":
        return pg.sum() / max(pg.shape[1], 1)
    tokens = mask.sum(-1)  # [B]
    per_seq = pg.sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown agg {agg!r}")
    # Sequences without response tokens do not count in the mean over sequences.
    has_tokens = tokens > 0
    return torch.where(has_tokens, per_seq, 0.0).sum() / has_tokens.sum().clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    table=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy loss (see ``rlk.policy_loss``): ``(loss, metrics)``.

    ``logprobs``/``old_logprobs``/``mask`` ``[B, L]``, ``advantages`` ``[B]`` or ``[B, L]``.
    Only ``logprobs`` gets a gradient.
    """
    out_dtype = result_dtype(logprobs)
    mask = mask.bool()
    # Padding may hold anything (even inf); zero it first so that neither the loss nor the
    # gradient can pick up a NaN from a masked-out position.
    lp = torch.where(mask, logprobs.double(), 0.0)
    old = torch.where(mask, old_logprobs.detach().double(), 0.0)
    adv = advantages.detach().double()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = torch.where(mask, adv.expand(mask.shape), 0.0)

    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    metrics = {"clip_fraction": _masked_mean((clipped > unclipped).double(), mask)}
    if clip_c is not None:
        bound = -adv * clip_c
        dual = (adv < 0) & (bound < pg)
        pg = torch.where(dual, bound, pg)
        metrics["dual_clip_fraction"] = _masked_mean(dual.double(), mask)
    if rollout_logprobs is not None:
        rollout = torch.where(mask, rollout_logprobs.detach().double(), 0.0)
        pg = pg * torch.exp(old - rollout).clamp(max=tis_cap)
    pg = torch.where(mask, pg, 0.0)
    loss = _aggregate(pg, mask, agg)

    ratio_d = ratio.detach()
    metrics["approx_kl"] = _masked_mean(old - lp.detach(), mask)
    metrics["ratio_mean"] = _masked_mean(ratio_d, mask)
    metrics["ratio_max"] = (
        torch.where(mask, ratio_d, 0.0).amax() if mask.any() else ratio_d.new_zeros(())
    )
    metrics = {name: value.detach().to(out_dtype) for name, value in metrics.items()}
    return loss.to(out_dtype), metrics


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3", *, table=None
) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` with ``d = logprobs - ref_logprobs``: ``k1 = d``,
    ``abs = |d|``, ``k2 = d^2 / 2``, ``k3 = exp(-d) + d - 1`` clamped to ``[-10, 10]`` (only k3
    is clamped, as in verl's low-variance KL)."""
    d = logprobs.double() - ref_logprobs.double()
    if kind == "k1":
        kl = d
    elif kind == "abs":
        kl = d.abs()
    elif kind == "k2":
        kl = d.square() / 2
    elif kind == "k3":
        kl = (torch.exp(-d) + d - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return kl.to(result_dtype(logprobs))


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, norm_std: bool = True, eps: float = 1e-6, table=None
) -> torch.Tensor:
    """GRPO advantages of ``rewards [N]`` in contiguous groups of ``group_size``:
    ``(r - mean) / (std_unbiased + eps)``, or ``r - mean`` without ``norm_std``."""
    r = rewards.double().reshape(-1, group_size)
    adv = r - r.mean(-1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(-1, correction=1, keepdim=True) + eps)
    return adv.reshape(-1).to(result_dtype(rewards))
