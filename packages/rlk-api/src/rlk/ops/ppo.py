"""PPO's critic side: ``gae_advantages`` (GAE advantages and returns) and ``value_loss`` (the
clipped value loss), on padded ``[B, L]`` response tensors. The policy side is
``rlk.policy_loss``; ``docs/objectives.md`` maps verl's and TRL's settings to these calls.
"""

from __future__ import annotations

import torch

from rlk import _validate as chk
from rlk._catalog import Operator, op
from rlk.ops._common import _call, f32
from rlk.ops.losses import AGG_MODES, _agg_args, _check_mask, seq_counts

#: The ops declared here (``rlk`` exports them).
__all__ = ["gae_advantages", "value_loss"]


def _padded(name: str, t: object, shape: tuple[int, ...] | None, of: str) -> torch.Tensor:
    t = chk.tensor(name, t, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if shape is not None:
        chk.shape(name, t, shape, f"[B, L] of {of}")
    return t


def _mask(mask: object, shape: tuple[int, ...], of: str) -> torch.Tensor:
    mask = chk.tensor("mask", mask, dtypes=(torch.bool, *chk.FLOAT_DTYPES), ndim=2)
    chk.shape("mask", mask, shape, f"[B, L] of {of}")
    return _check_mask(mask, shape)  # its 0/1 check


def _unit(name: str, v: object) -> float:
    v = chk.positive_float(name, v, allow_zero=True)
    if v > 1:
        raise ValueError(f"{name} must be in [0, 1], got {v}")
    return v


# PPO's critic side: GAE (not differentiable) and the clipped value loss, which aggregates over
# the batch (its gradient is checked for determinism only).
@op(
    "ppo",
    out_dtype="float32",
    operator=Operator(
        "Tensor rewards, Tensor values, Tensor mask, float gamma, float lam, bool whiten",
        outputs=lambda a: [
            torch.empty(a["rewards"].shape, dtype=torch.float32, device=a["rewards"].device)
            for _ in range(2)
        ],
    ),
)
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation: ``(advantages, returns)``, as verl's
    ``compute_gae_advantage_return``.

    Shapes: ``rewards`` (per token; an outcome reward sits on a response's last token),
    ``values`` (the critic's, at the rollout), ``mask`` (bool or 0/1: the tokens the policy
    generated; it may have holes, such as a tool's output inside a multi-turn response) are
    ``[B, L]``. Dtypes bf16/fp16/fp32; both outputs are fp32 ``[B, L]``, 0 outside ``mask``.
    Not differentiable. A ``mask`` value other than 0 or 1 is a ``ValueError`` where value
    checks run, and elsewhere a token of NaN reward (NaN advantages, all of them whitened).

    Each row is scanned backwards over its tokens of ``mask`` only (the tokens outside it are
    skipped, as verl skips observation tokens): ``delta = r + gamma * v_next - v`` and ``a =
    delta + gamma * lam * a_next``, where ``v_next`` and ``a_next`` belong to the row's next
    token of ``mask`` (0 past its last); ``returns = a + v``. With ``whiten`` (verl's
    ``masked_whiten``) the advantages become ``(a - mu) / sqrt(var + 1e-8)``, with the mean and
    the unbiased variance over every token of ``mask`` in the batch (variance 0 below two
    tokens, where verl raises).

    Contract: the scan runs in fp32 in that order, one token after the other, so a row's
    returns, and its advantages without ``whiten``, depend on that row only, bitwise, whatever
    the batch; the whitening statistics are sums over the batch in a fixed order
    (deterministic; a statistic of the batch by definition).

    Example::

        adv, ret = rlk.gae_advantages(token_rewards, old_values, mask, gamma=1.0, lam=0.95)
    """
    rewards = _padded("rewards", rewards, None, "rewards")
    shape = tuple(rewards.shape)
    values = _padded("values", values, shape, "rewards")
    mask = _mask(mask, shape, "rewards")
    device = chk.same_device(rewards=rewards, values=values, mask=mask)
    gamma, lam = _unit("gamma", gamma), _unit("lam", lam)
    whiten = chk.flag("whiten", whiten)
    return _call("gae_advantages", device, rewards, values, mask, gamma=gamma, lam=lam,
                 whiten=whiten)  # fmt: skip


@op(
    "ppo",
    grad_args=("values",),
    out_dtype="float32",
    operator=Operator(
        "Tensor values, Tensor old_values, Tensor returns, Tensor mask, float? clip, str agg, "
        "float? num_tokens, Tensor? num_tokens_tensor, float? num_seqs, Tensor? num_seqs_tensor, "
        "float? norm_length",
        outputs=lambda a: [f32(like=a["values"]), f32(1, like=a["values"])],
        # each sequence's integer statistics (int32 [B, 5], the layout of policy_loss's) and
        # the gradient's scale (fp32 [1])
        extras=lambda a: [seq_counts(a["values"]), f32(1, like=a["values"])],
        metrics=lambda a: ["clip_fraction"],
    ),
)
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (verl's ``compute_value_loss``): ``(loss, metrics)``.

    Shapes: ``values`` (the critic's now; differentiable), ``old_values`` (at the rollout),
    ``returns`` (from :func:`gae_advantages`), ``mask`` (bool or 0/1; another value: a
    ``ValueError`` where value checks run, elsewhere a token of NaN value) ``[B, L]``; dtypes
    bf16/fp16/fp32. Per token of ``mask``: ``0.5 * max((v - R)^2, (clamp(v, v_old - clip,
    v_old + clip) - R)^2)`` (verl's ``cliprange_value``, default 0.5), or ``0.5 * (v - R)^2``
    with ``clip=None``; then aggregated as :func:`rlk.policy_loss` aggregates, with the same
    ``agg`` modes, ``num_tokens``, ``num_seqs`` and ``norm_length`` (verl's
    ``loss_agg_mode``, ``batch_num_tokens / dp_size``, ``global_batch_size / dp_size`` and
    ``loss_scale_factor``).

    Returns a 0-d fp32 ``loss``, differentiable with respect to ``values`` only, and
    ``{"clip_fraction"}`` (0-d fp32, detached: the tokens of ``mask`` whose clipped term is the
    larger, verl's ``vf_clipfrac``).

    Contract: every sum runs in fp32 in a fixed order (each sequence's tokens, then the
    sequences), so the loss is deterministic, and its gradient, per token, has no atomics; with
    ``agg="token-sum"`` a row's gradient depends on that row only.

    Example::

        loss, m = rlk.value_loss(critic_values, old_values, returns, mask, clip=0.5)
    """
    values = _padded("values", values, None, "values")
    shape = tuple(values.shape)
    old_values = _padded("old_values", old_values, shape, "values")
    returns = _padded("returns", returns, shape, "values")
    mask = _mask(mask, shape, "values")
    device = chk.same_device(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None:
        clip = chk.positive_float("clip", clip)
    agg = chk.choice("agg", agg, AGG_MODES)
    num_tokens, num_seqs, norm_length = _agg_args(
        agg, num_tokens, num_seqs, norm_length, device, shape[1]
    )
    return _call(
        "value_loss",
        device,
        values,
        old_values,
        returns,
        mask,
        clip=clip,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )
