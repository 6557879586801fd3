"""The RL objectives: ``policy_loss``, ``kl_penalty``, ``grpo_advantages``, and their options.

The option tuples (:data:`AGG_MODES`, :data:`REJECT_OPTIONS`, ...) are public: backends encode
them (rlk-triton's ``REJECT_OPTIONS`` bit flags) and the conformance kit draws cases from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlk import _validate as chk
from rlk._catalog import Operator, no_extras, op
from rlk.ops._common import _call, f32

#: The ops declared here (``rlk`` exports them).
__all__ = ["policy_loss", "kl_penalty", "grpo_advantages"]

#: ``policy_loss`` aggregations (see its docstring; docs/objectives.md maps verl's and TRL's).
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "row-mean-token-mean",
    "row-mean-token-sum-norm",
)
RATIO_LEVELS = ("token", "sequence")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
#: verl's rejection-sampling options (``rollout_rs``), in the order they are applied.
REJECT_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
#: verl's KL names -> rlk's.
KL_ALIASES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "kl+": "k1+",
    "k2+": "k2",
    "mse+": "k2",
    "low_var_kl+": "k3+",
}
ADV_ESTIMATORS = (
    "grpo",
    "rloo",
    "reinforce++",
    "reinforce++-baseline",
    "rloo_vectorized",
    "opo",
    "grpo_passk",
)
#: verl's estimator names -> rlk's.
ADV_ALIASES = {
    "reinforce_plus_plus": "reinforce++",
    "reinforce_plus_plus_baseline": "reinforce++-baseline",
    "grpo_vectorized": "grpo",
}
NORM_STD = ("group", "batch", "none")
#: ``policy_loss`` objectives (``loss_mode``): verl 0.9.1's ``policy_loss.loss_mode`` names, which
#: cover TRL 1.16's ``cispo``, ``sapo`` and ``vespo`` loss types (see docs/objectives.md).
LOSS_MODES = (
    "vanilla",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "sapo",
    "dro",
    "gpg",
    "geo_mean",
    "vespo",
)
#: Per loss mode, its ``mode_params`` keys with their defaults (None: required), in the order
#: a backend gets them (verl's and TRL's defaults).
MODE_PARAMS: dict[str, tuple[tuple[str, float | None], ...]] = {
    "sapo": (("tau_pos", 1.0), ("tau_neg", 1.05)),
    "dro": (("beta", None),),
    "vespo": (("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0), ("lambda_neg", 2.0)),
}
_BATCH_WIDE = (
    "a token's term would depend on the other sequences of the batch, which breaks batch "
    "invariance (an output depends only on its own inputs)"
)
#: The peers' settings rlk does not offer, by argument and name: the reason, or the rlk call
#: that gives the same numbers. Passing one raises a ``ValueError`` with this text.
UNOFFERED: dict[str, dict[str, str]] = {
    "loss_mode": {
        "clip_cov": "verl's clip_cov zeroes the gradient of tokens drawn by torch.randperm among "
        "those whose covariance with the batch means of A and log-prob is in range: random, and "
        + _BATCH_WIDE,
        "kl_cov": "verl's kl_cov penalises the batch's top-k tokens by covariance with the batch "
        "means of A and log-prob: " + _BATCH_WIDE,
        "gspo": "verl's gspo is loss_mode='vanilla' with ratio_level='sequence' and "
        "clip_c=math.exp(10)",
        "bypass_mode": "verl's bypass_mode with loss_type reinforce is loss_mode='gpg' with "
        "old_logprobs=logprobs.detach() and rollout_logprobs=rollout_logprobs (its rollout_is and "
        "rollout_rs compare the current policy with the rollout: is_level, is_max, reject); with "
        "loss_type ppo_clip it is loss_mode='vanilla' with old_logprobs=rollout_logprobs and no IS "
        "weights (verl applies none), without rollout_rs (that rejection is not one call)",
    },
    "estimator": {
        "gae": "GAE needs a critic's values per token: rlk.gae_advantages",
        "remax": "ReMax is scores - reward_baselines per response (one subtraction in torch; "
        "the baseline is a greedy rollout's reward)",
        "gpg": "verl's gpg scales by B / (responses with a nonzero score in the batch): "
        + _BATCH_WIDE
        + "; verl's numbers are grpo_advantages(..., norm_std=False) * B / "
        "max(count_nonzero(scores), 1) in torch",
        "gdpo": "GDPO is grpo_advantages per reward dimension, their weighted sum, then "
        "grpo_advantages(total, estimator='reinforce++', mask=mask) (the batch whitening)",
        "optimal_token_baseline": "needs sum(pi^2) over the vocabulary at every token, which "
        "rlk's logprobs do not compute",
        "tir_optimal_token_baseline": "needs sum(pi^2) over the vocabulary at every token, which "
        "rlk's logprobs do not compute",
    },
    "kind": {
        name: "the full KL needs both models' distributions over the vocabulary, not the "
        "log-probabilities of the sampled tokens (verl 0.9.1 raises NotImplementedError too)"
        for name in ("full", "full+")
    },
}


def _refuse(name: str, v: object) -> None:
    """A ``ValueError`` with the reason when ``v`` is a peer's setting rlk does not offer."""
    reason = UNOFFERED[name].get(v) if isinstance(v, str) else None
    if reason is not None:
        raise ValueError(f"{name}={v!r} is not offered: {reason}")


def _mode_params(loss_mode: str, mode_params: object) -> tuple[float, ...]:
    """``mode_params`` (a dict by name) as the floats of :data:`MODE_PARAMS` order."""
    spec = MODE_PARAMS.get(loss_mode, ())
    given = {} if mode_params is None else mode_params
    if not isinstance(given, Mapping):
        raise TypeError(f"mode_params must be a dict, got {type(mode_params).__name__}")
    unknown = [k for k in given if k not in dict(spec)]
    if unknown:
        keys = ", ".join(k for k, _ in spec) or "none"
        raise ValueError(
            f"mode_params has {unknown}, not parameters of loss_mode {loss_mode!r} ({keys})"
        )
    out = []
    for key, default in spec:
        v = given.get(key, default)
        if v is None:
            raise ValueError(f"loss_mode {loss_mode!r} needs mode_params[{key!r}]")
        out.append(chk.positive_float(f"mode_params[{key!r}]", v, allow_zero=key.startswith("k")))
    return tuple(out)


def _check_padded(name: str, t: object, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = chk.tensor(name, t, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if shape is not None:
        chk.shape(name, t, shape, "[B, L] of logprobs")
    return t


def _check_mask(mask: object, shape: tuple[int, ...], of: str = "logprobs") -> torch.Tensor:
    mask = chk.tensor("mask", mask, dtypes=(torch.bool, *chk.FLOAT_DTYPES), ndim=2)
    if of == "logprobs":
        chk.shape("mask", mask, shape, "[B, L] of logprobs")
    elif mask.shape[0] != shape[0]:
        raise ValueError(f"mask must be [N, L] with N = {of} = {shape[0]}, got {tuple(mask.shape)}")
    if (
        mask.dtype != torch.bool
        and chk.value_checks_enabled(mask)
        and not bool(((mask == 0) | (mask == 1)).all())
    ):
        raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
    return mask


def _alias(name: str, v: object, options: tuple[str, ...], aliases: dict[str, str]) -> str:
    """``v`` if it is one of ``options``, its rlk name if it is a peer's alias, else an error."""
    if isinstance(v, str) and v in aliases:
        return aliases[v]
    return chk.choice(name, v, options + tuple(aliases))


def _bound(name: str, v: object) -> float | None:
    return None if v is None else chk.positive_float(name, v)


def _count(name: str, v: object, device: torch.device) -> float | torch.Tensor | None:
    """A positive count or scale: a Python number, or a 0-d tensor on the op's device (so that a
    count summed over ranks on the GPU needs no host sync)."""
    if v is None:
        return None
    if not isinstance(v, torch.Tensor):
        return chk.positive_float(name, v)
    if v.dim() != 0 or v.dtype == torch.bool or v.is_complex():
        raise TypeError(f"{name} must be a number or a 0-d real tensor, got {v.dtype} {v.shape}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device} but logprobs is on {device}")
    if chk.value_checks_enabled(v) and not bool(torch.isfinite(v) & (v > 0)):
        raise ValueError(f"{name} must be finite and > 0, got {float(v)}")
    return v


def _agg_args(
    agg: str,
    num_tokens: object,
    num_seqs: object,
    norm_length: object,
    device: torch.device,
    length: int,
) -> tuple[float | torch.Tensor | None, float | torch.Tensor | None, float | None]:
    """The counts and scale of an aggregation ``agg`` (see :func:`policy_loss`), checked
    against it; ``norm_length`` of a ``-norm`` mode defaults to ``length`` (L)."""
    for name, v, modes in (
        ("num_tokens", num_tokens, ("token-mean",)),
        ("num_seqs", num_seqs, tuple(m for m in AGG_MODES if m.startswith(("seq", "row")))),
        ("norm_length", norm_length, tuple(m for m in AGG_MODES if m.endswith("-norm"))),
    ):
        if v is not None and agg not in modes:
            raise ValueError(f"{name} applies to agg {', '.join(modes)}, not {agg!r}")
    num_tokens = _count("num_tokens", num_tokens, device)
    num_seqs = _count("num_seqs", num_seqs, device)
    if norm_length is not None:
        norm_length = chk.positive_float("norm_length", norm_length)
    elif agg.endswith("-norm"):
        norm_length = float(length)
    return num_tokens, num_seqs, norm_length


def _reject(reject: object) -> dict[str, tuple[float | None, float]] | None:
    """verl's rejection options -> ``{option: (lower, upper)}`` in :data:`REJECT_OPTIONS` order.

    ``*_k1`` options take ``(lower, upper)`` bounds of ``exp(k1)`` (one number ``u`` means
    ``(1/u, u)``); ``*_k2``/``*_k3`` options take one upper bound."""
    if reject is None:
        return None
    if not isinstance(reject, Mapping) or not reject:
        raise TypeError(
            "reject must be a non-empty dict {option: threshold}, got "
            f"{type(reject).__name__}{'' if reject else ' (empty)'}"
        )
    out: dict[str, tuple[float | None, float]] = {}
    for option in REJECT_OPTIONS:
        if option not in reject:
            continue
        spec = reject[option]
        where = f"reject[{option!r}]"
        if option.endswith("k1"):
            if isinstance(spec, tuple | list):
                if len(spec) != 2:
                    raise ValueError(f"{where} must be (lower, upper), got {spec!r}")
                lo, hi = (chk.positive_float(where, s) for s in spec)
                if lo > hi:
                    raise ValueError(f"{where} must have lower <= upper, got {spec!r}")
            else:
                hi = chk.positive_float(where, spec)
                lo = 1.0 / hi
            out[option] = (lo, hi)
        else:
            out[option] = (None, chk.positive_float(where, spec))
    unknown = [k for k in reject if k not in REJECT_OPTIONS]
    if unknown:
        raise ValueError(
            f"reject has unknown options {unknown}; the options are {', '.join(REJECT_OPTIONS)}"
        )
    return out


def policy_metrics(a: Mapping[str, Any]) -> list[str]:
    """The metrics :func:`policy_loss` returns for its operator's arguments ``a``, in their
    order."""
    names = ["clip_fraction", "approx_kl", "ratio_mean", "ratio_max"]
    if a["clip_c"] is not None:
        names.append("dual_clip_fraction")
    if a["rollout_logprobs"] is not None and a["is_level"] is not None:
        names.append("is_weight_mean")
    if a["rollout_logprobs"] is not None and a["reject"]:
        names.append("reject_fraction")
    return names


#: policy_loss's per-sequence statistics of its forward, which its backward reads: floats and
#: integers per sequence (the layout of rlk-triton's kernels).
POLICY_SEQ_STATS = (7, 5)


def seq_counts(t: torch.Tensor) -> torch.Tensor:
    """An empty int32 ``[B, 5]`` of ``t``'s rows: the integer per-sequence statistics of
    policy_loss's and value_loss's forwards, which their backwards read."""
    return torch.empty(t.shape[0], POLICY_SEQ_STATS[1], dtype=torch.int32, device=t.device)


def _policy_extras(a: Mapping[str, Any]) -> list[torch.Tensor]:
    # The per-sequence statistics (fp32 [B, 7], int32 [B, 5]), the gradient's scale (fp32 [1])
    # and the rejection thresholds (fp32, a lower and an upper bound per REJECT_OPTIONS).
    lp = a["logprobs"]
    seqf = f32(lp.shape[0], POLICY_SEQ_STATS[0], like=lp)
    return [seqf, seq_counts(lp), f32(1, like=lp), f32(2 * len(REJECT_OPTIONS), like=lp)]


# policy_loss aggregates over the batch: its gradient is checked for determinism only.
@op(
    "policy_loss",
    grad_args=("logprobs",),
    out_dtype="float32",
    aliases=("tis_cap",),
    operator=Operator(
        "Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, float clip_low, "
        "float clip_high, float? clip_c, str agg, str ratio_level, Tensor? rollout_logprobs, "
        "str? is_level, str is_mode, float? is_min, float? is_max, str is_normalize, "
        "float is_normalize_value, Tensor? is_normalize_tensor, float[] reject, "
        "float? num_tokens, Tensor? num_tokens_tensor, float? num_seqs, Tensor? num_seqs_tensor, "
        "float? norm_length, str loss_mode, float[] mode_params",
        outputs=lambda a: [
            f32(like=a["logprobs"]),
            f32(len(policy_metrics(a)), like=a["logprobs"]),
        ],
        extras=_policy_extras,
        metrics=policy_metrics,
    ),
)
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
    ratio_level: str = "token",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    is_level: str | None = "token",
    is_mode: str = "truncate",
    is_min: float | None = None,
    is_max: float | None = None,
    is_normalize: bool | float | torch.Tensor = False,
    reject: Mapping[str, Any] | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    loss_mode: str = "vanilla",
    mode_params: Mapping[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/GSPO clipped policy-gradient loss, and verl's and TRL's other policy
    objectives (``loss_mode``), on padded ``[B, L]`` tensors.

    Shapes: ``logprobs`` (differentiable), ``old_logprobs``, ``mask`` (bool or 0/1: response
    tokens; another value is a ``ValueError`` where value checks run, and elsewhere counts as a
    token whose log-prob is NaN, so the loss is NaN), ``rollout_logprobs`` ``[B, L]``;
    ``advantages`` ``[B, L]`` or ``[B]`` (one per sequence). Dtypes bf16/fp16/fp32; the loss
    and metrics are 0-d fp32 and every sum runs in fp32 in a fixed order. Only ``logprobs``
    gets a gradient. Mapping of every verl 0.9.1 / TRL 1.16 setting to these arguments:
    ``docs/objectives.md``.

    **Ratio.** ``ratio_level="token"``: ``r = exp(logprobs - old_logprobs)`` per token.
    ``"sequence"`` (GSPO): every token of a sequence takes ``s = exp(mean(logprobs -
    old_logprobs))`` over its tokens, and its gradient is that of ``s * exp(lp - sg(lp))`` (the
    sequence ratio's gradient, spread evenly over the tokens).

    **Per token**, with advantage ``A``: ``pg = max(-A * r, -A * clamp(r, 1 - clip_low, 1 +
    clip_high))``; dual clip (``clip_c > 1``; verl's default ``clip_ratio_c=3.0``, off here by
    default): tokens with ``A < 0`` take ``min(pg, -A * clip_c)``.

    **Objective** ``loss_mode`` (verl's ``policy_loss.loss_mode``; ``x = logprobs -
    old_logprobs``, ``r = exp(x)`` with ``x`` clamped to [-20, 20] where marked *, ``sg`` = no
    gradient; the per-token ``pg`` below replaces the clipped surrogate, then weights,
    rejection and ``agg`` apply as for ``vanilla``):

    - ``vanilla``: the clipped surrogate above;
    - ``cispo``: ``-sg(clamp(r*, 1 - clip_low, 1 + clip_high)) * A * logprobs``
      (``clip_low=1``: no lower bound, TRL's form);
    - ``dppo_tv`` / ``dppo_kl``: ``-A * sg(min(r*, clip_c)) * logprobs`` on the tokens whose
      divergence stays within ``clip_high`` (``A > 0``) or ``clip_low`` (else), 0 on the others:
      ``p - p_old`` (TV) or the binary KL ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old +
      1e-8) / (1 - p + 1e-8))`` (which only trusts a token moving away from the advantage's
      side), ``p = exp(logprobs)``; ``clip_c=None``: no cap; ``dual_clip_fraction`` counts the
      capped tokens;
    - ``sapo``: ``-A * sigmoid(tau (r* - 1)) * 4 / tau``, ``tau = tau_pos`` where ``A > 0`` else
      ``tau_neg`` (``mode_params``, defaults 1.0 and 1.05); with ``ratio_level="sequence"`` the
      sequence ratio (TRL);
    - ``dro``: ``-(A * logprobs - beta / 2 * x^2)`` (``mode_params={"beta": ...}``, required);
    - ``gpg``: ``-A * logprobs``;
    - ``geo_mean`` (GMPO): per sequence ``-mean(A) * exp(mean(x'))`` with ``x'`` = ``x`` clamped
      to ``[-clip_low, clip_high]`` on the side of ``sign(A)`` (``min(x, clamp(x))`` for ``A >
      0``, ``max`` for ``A < 0``, 0 for ``A = 0``), means over the sequence's tokens; every token
      carries its sequence's term, so ``agg="row-mean-token-mean"`` is verl's mean over rows;
    - ``vespo`` (TRL): ``-sg(phi) * A * logprobs``, ``phi = exp(lam + k log w - lam w)`` with
      ``log w`` = the sum of the sequence's ``x*``, clamped to ``[log 1e-8, 20]``, and ``(k,
      lam)`` = ``(k_pos, lambda_pos)`` where ``A >= 0`` else ``(k_neg, lambda_neg)``
      (``mode_params``, defaults 2, 3, 3, 2; ``lam`` at least 1e-4; a non-finite ``phi`` is 0).

    ``clip_c`` applies to ``vanilla`` (dual clip) and ``dppo_*`` (the cap); ``ratio_level=
    "sequence"`` to ``vanilla`` and ``sapo``; ``geo_mean`` and ``vespo`` take no importance
    weights (``is_level=None``; ``reject`` still applies). ``clip_fraction`` counts the tokens
    the mode clips: ``cispo`` the clamped ratios, ``dppo_*`` the untrusted tokens, ``geo_mean``
    the clamped log-ratios, the others none. The ratio metrics report ``r`` (``geo_mean``: the
    sequence's). verl's ``clip_cov``, ``kl_cov``, ``gspo`` and ``bypass_mode`` raise a
    ``ValueError`` with the reason or the call to use (:data:`UNOFFERED`).

    **Importance sampling against the rollout engine** (``rollout_logprobs``; no gradient):
    ``pg *= w`` with ``log w = old_logprobs - rollout_logprobs`` per token (``is_level="token"``)
    or summed over the sequence (``"sequence"``: the product of the token ratios), clamped to
    ``[-20, 20]``; ``is_level=None``: no weights (``rollout_logprobs`` for ``reject`` only).
    ``is_mode="truncate"`` clamps ``w`` to ``[is_min, is_max]``; ``"mask"`` sets ``w = 0``
    outside that range (IcePop / TRL ``*_mask``). ``tis_cap`` is the old name of ``is_max``.
    ``is_normalize=True`` divides ``w`` by its mean over the batch (over tokens, or over
    sequences at sequence level; left alone when that mean is <= 1e-8, as verl); a number or
    0-d tensor divides by that value instead (the mean over the whole batch when the batch is
    split into micro-batches: ``metrics["is_weight_mean"]`` of a call on the whole batch).

    **Rejection** (verl ``rollout_rs``): ``reject={option: threshold}`` removes tokens or whole
    sequences from ``mask`` (and so from every count and metric) where the rollout policy
    strays. Per token ``k1 = rollout - old``, ``k2 = k1^2 / 2``, ``k3 = exp(-k1) - 1 + k1``
    (estimators of KL(rollout || old), log-ratios clamped to ``[-20, 20]``); options
    ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}`` (over the sequence's tokens),
    ``seq_max_k{2,3}``. ``*_k1`` options keep ``lower <= exp(stat) <= upper`` (threshold
    ``(lower, upper)``, or ``u`` for ``(1/u, u)``); the others keep ``stat <= threshold``. A
    token stays if every option keeps it. Statistics use the given ``mask``.

    **Aggregation** ``agg`` of the masked ``pg`` (``n_b`` tokens of sequence ``b``; ``S`` =
    sequences with ``n_b > 0``, or ``num_seqs``; ``R`` = rows ``B``, or ``num_seqs``; ``N`` = all
    tokens, or ``num_tokens``; ``Ln`` = ``norm_length``, default ``L``):

    - ``token-mean``: ``sum / N`` (verl ``token-mean``; TRL ``bnpo``, and ``dapo`` with
      ``num_tokens``);
    - ``token-sum``: ``sum``;
    - ``seq-mean-token-sum``: ``sum_b (sum of b) / S``;
    - ``seq-mean-token-mean``: ``sum_b (mean of b) / S``;
    - ``seq-mean-token-sum-norm``: ``sum / (S * Ln)`` (verl, Dr. GRPO);
    - ``row-mean-token-mean``: ``sum_b (sum of b / max(n_b, 1)) / R`` (TRL ``grpo``: empty rows
      count);
    - ``row-mean-token-sum-norm``: ``sum / (R * Ln)`` (TRL ``dr_grpo`` with ``norm_length =
      max_completion_length``).

    A zero denominator gives a loss of 0. With ``num_tokens``/``num_seqs`` set to the totals of
    the whole batch, the losses of its micro-batches add up to the loss of the whole batch (under
    data parallelism, multiply by the world size if the gradients are averaged over ranks).
    ``num_tokens``/``num_seqs`` are numbers or 0-d tensors on the device.

    Returns ``(loss, metrics)``: 0-d fp32 ``loss``, differentiable with respect to ``logprobs``,
    and 0-d detached fp32 metrics over the tokens kept: ``clip_fraction`` (tokens whose clipped
    term was taken), ``approx_kl`` (mean of ``old - new``), ``ratio_mean``, ``ratio_max``; with
    dual clip ``dual_clip_fraction``; with importance weights ``is_weight_mean`` (mean of the
    bounded weights before ``is_normalize``, over the tokens or sequences of ``mask``); with
    ``reject`` ``reject_fraction`` (tokens of ``mask`` removed).

    Example::

        loss, m = rlk.policy_loss(lp, old_lp, adv, mask, agg="seq-mean-token-mean")
        # verl defaults (vanilla, clip 0.2, dual clip 3.0, token-mean) with token TIS at 2.0:
        loss, m = rlk.policy_loss(lp, old_lp, adv, mask, clip_c=3.0,
                                  rollout_logprobs=rollout_lp, is_max=2.0)
    """
    logprobs = _check_padded("logprobs", logprobs)
    shape = tuple(logprobs.shape)
    old_logprobs = _check_padded("old_logprobs", old_logprobs, shape)
    advantages = chk.tensor("advantages", advantages, dtypes=chk.FLOAT_DTYPES, ndim=(1, 2))
    if advantages.dim() == 1:
        chk.shape("advantages", advantages, shape[:1], "[B] or [B, L] of logprobs")
    else:
        chk.shape("advantages", advantages, shape, "[B] or [B, L] of logprobs")
    mask = _check_mask(mask, shape)
    if rollout_logprobs is not None:
        rollout_logprobs = _check_padded("rollout_logprobs", rollout_logprobs, shape)
    device = chk.same_device(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        rollout_logprobs=rollout_logprobs,
    )
    _refuse("loss_mode", loss_mode)
    loss_mode = chk.choice("loss_mode", loss_mode, LOSS_MODES)
    params = _mode_params(loss_mode, mode_params)
    clip_low = chk.positive_float("clip_low", clip_low, allow_zero=True)
    clip_high = chk.positive_float("clip_high", clip_high, allow_zero=True)
    if loss_mode == "vanilla" and clip_low >= 1:
        raise ValueError(
            f"clip_low must be < 1 (the ratio is clamped at 1 - clip_low), got {clip_low}"
        )
    if loss_mode == "cispo" and clip_low > 1:
        raise ValueError(f"clip_low must be <= 1 for cispo (1: no lower bound), got {clip_low}")
    dppo = loss_mode.startswith("dppo")
    if clip_c is not None:
        if loss_mode != "vanilla" and not dppo:
            raise ValueError(
                f"clip_c applies to loss_mode 'vanilla' (dual clip) and 'dppo_*' (the ratio's "
                f"cap), not {loss_mode!r}"
            )
        clip_c = chk.positive_float("clip_c", clip_c)
        if clip_c <= 1 and not dppo:
            raise ValueError(f"clip_c must be > 1 for dual clip, got {clip_c}")
    agg = chk.choice("agg", agg, AGG_MODES)
    ratio_level = chk.choice("ratio_level", ratio_level, RATIO_LEVELS)
    if ratio_level == "sequence" and loss_mode not in ("vanilla", "sapo"):
        raise ValueError(
            f"ratio_level='sequence' applies to loss_mode 'vanilla' and 'sapo', not "
            f"{loss_mode!r} (its term is not a function of the ratio alone)"
        )
    if loss_mode in ("geo_mean", "vespo") and rollout_logprobs is not None and is_level is not None:
        raise ValueError(
            f"loss_mode {loss_mode!r} takes no importance weights: pass is_level=None (verl's "
            "geo_mean takes their geometric mean, TRL's vespo folds them into w; neither is "
            "offered)"
        )
    if is_level is not None:
        is_level = chk.choice("is_level", is_level, IS_LEVELS)
    is_mode = chk.choice("is_mode", is_mode, IS_MODES)
    if tis_cap is not None:
        if is_max is not None:
            raise ValueError("tis_cap is the old name of is_max: give one of them")
        is_max = tis_cap
    is_min, is_max = _bound("is_min", is_min), _bound("is_max", is_max)
    if is_min is not None and is_max is not None and is_min > is_max:
        raise ValueError(f"is_min must be <= is_max, got {is_min} > {is_max}")
    if not isinstance(is_normalize, bool):
        is_normalize = _count("is_normalize", is_normalize, device)
    reject = _reject(reject)
    if rollout_logprobs is None:
        given = [n for n, v in (("is_min", is_min), ("is_max", is_max), ("reject", reject)) if v]
        if is_normalize is not False:
            given.append("is_normalize")
        if is_level == "sequence" or is_mode != "truncate":
            given.append("is_level/is_mode")
        if given:
            raise ValueError(
                f"{', '.join(given)} need rollout_logprobs (importance sampling / rejection)"
            )
    elif is_level is None and (
        is_min is not None or is_max is not None or is_normalize is not False
    ):
        raise ValueError("is_min/is_max/tis_cap/is_normalize weigh tokens: is_level is None")
    num_tokens, num_seqs, norm_length = _agg_args(
        agg, num_tokens, num_seqs, norm_length, device, shape[1]
    )
    return _call(
        "policy_loss",
        device,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=clip_c,
        agg=agg,
        ratio_level=ratio_level,
        rollout_logprobs=rollout_logprobs,
        is_level=is_level,
        is_mode=is_mode,
        is_min=is_min,
        is_max=is_max,
        is_normalize=is_normalize,
        reject=reject,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
        loss_mode=loss_mode,
        mode_params=params,
    )


@op(
    "kl",
    grad_args=("logprobs",),
    unit_grads=("logprobs",),
    out_dtype="float32",
    operator=Operator(
        "Tensor logprobs, Tensor ref_logprobs, str kind, float? clamp, Tensor? old_logprobs",
        outputs=lambda a: [
            torch.empty(a["logprobs"].shape, dtype=torch.float32, device=a["logprobs"].device)
        ],
        extras=no_extras,
    ),
)
def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k3",
    *,
    clamp: float | None = 10.0,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and a reference, ``[B, L]`` -> fp32 ``[B, L]``.

    With ``d = logprobs - ref_logprobs``: ``k1 = d``; ``abs = |d|``; ``k2 = d^2 / 2``;
    ``k3 = exp(-d) + d - 1`` (the low-variance estimator), clamped to ``[-clamp, clamp]``
    (verl: 10; ``clamp=None``: no clamp, as TRL). The straight-through kinds ``k1+``, ``k3+``,
    ``abs+`` have the value of ``k1``/``k3``/``abs`` and the gradient of ``k2`` (``d``). verl's
    names are accepted: ``kl`` = ``k1``, ``mse`` = ``k2``, ``low_var_kl`` = ``k3``,
    ``low_var_kl+`` = ``k3+``, ``kl+`` = ``k1+``, ``k2+``/``mse+`` = ``k2``.

    ``old_logprobs`` (TRL's ``use_bias_correction_kl``): the estimate is multiplied by the
    token's importance ratio ``exp(logprobs - old_logprobs)``, which is differentiated too.
    Differentiable with respect to ``logprobs``; every element is computed on its own.

    Example::

        kl = rlk.kl_penalty(lp, ref_lp, "low_var_kl")            # verl use_kl_loss default
        kl = rlk.kl_penalty(lp, ref_lp, "k3", clamp=None, old_logprobs=old_lp)   # TRL beta > 0
    """
    logprobs = _check_padded("logprobs", logprobs)
    shape = tuple(logprobs.shape)
    ref_logprobs = _check_padded("ref_logprobs", ref_logprobs, shape)
    _refuse("kind", kind)
    kind = _alias("kind", kind, KL_KINDS, KL_ALIASES)
    if clamp is not None:
        clamp = chk.positive_float("clamp", clamp)
    if old_logprobs is not None:
        old_logprobs = _check_padded("old_logprobs", old_logprobs, shape)
    device = chk.same_device(
        logprobs=logprobs, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs
    )
    return _call(
        "kl_penalty", device, logprobs, ref_logprobs, kind, clamp=clamp, old_logprobs=old_logprobs
    )


@op(
    "advantages",
    out_dtype="float32",
    operator=Operator(
        "Tensor rewards, SymInt? group_size, str norm_std, float eps, Tensor? group_ids, "
        "str estimator, Tensor? mask",
        outputs=lambda a: [f32(a["rewards"].shape[0], like=a["rewards"])],
    ),
)
def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    norm_std: bool | str = True,
    eps: float = 1e-6,
    group_ids: torch.Tensor | None = None,
    estimator: str = "grpo",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outcome-reward advantages, one per response: ``rewards [N]`` -> fp32 ``[N]``.

    Groups (the responses of one prompt) are given by ``group_size`` (contiguous groups of that
    size, at least 2: TRL's ``num_generations``) or by ``group_ids`` (int ``[N]``, any values in
    any order, groups of any size: verl's ``uid`` index). A group's sums run over its members in
    their order in ``rewards``, in a fixed order, so a group's advantages do not depend on the
    rest of the batch (except with ``norm_std="batch"`` and the ``reinforce++`` estimators).

    ``estimator``:

    - ``grpo``: ``(r - mean_g) / (std_g + eps)`` with the unbiased (Bessel) std of the group
      (``norm_std=True`` or ``"group"``); ``r - mean_g`` (``False`` or ``"none"``: Dr. GRPO);
      ``(r - mean_g) / (std_batch + eps)`` (``"batch"``: the unbiased std of all ``N`` rewards,
      TRL ``scale_rewards="batch"``). A group of one has mean 0 and std 1 (verl).
    - ``rloo``: ``r - mean of the other members`` = ``n / (n - 1) * (r - mean_g)``; a group of
      one keeps ``r`` (verl).
    - ``reinforce++-baseline``: ``r - mean_g`` (a group of one: ``r``), then whitened over the
      response tokens of the batch: ``(v - mu) / sqrt(var + 1e-8)`` with the token-weighted
      mean and unbiased variance (each response weighs its ``mask`` token count).
    - ``reinforce++``: ``r`` whitened the same way (no groups; verl's ``gamma = 1``).
    - ``rloo_vectorized``: ``rloo``, but a group of one gets 0 (verl's vectorized form).
    - ``opo``: ``r - sum_g(n_i r_i) / sum_g(n_i)``, the group's mean weighted by the responses'
      ``mask`` token counts ``n_i`` (a group of one: ``r``; a group without tokens: ``r``).
    - ``grpo_passk``: 0 for every member but the group's best, which gets its margin over the
      second best, ``(r_max - r_second) / (std_g + eps)`` (``norm_std="group"``) or ``r_max -
      r_second`` (``"none"``); tied bests get 0 (their margin); a group of one gets 0 (verl
      raises).

    verl's names ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` and
    ``grpo_vectorized`` (= ``grpo``) are accepted; its ``gae``, ``remax``, ``gdpo``, ``gpg``
    and optimal-token-baseline estimators raise a ``ValueError`` with the reason or the rlk
    calls that give them (:data:`UNOFFERED`). ``mask`` (``[N, L]`` bool or 0/1) is required by,
    and only allowed with, the two ``reinforce++`` estimators and ``opo`` (another value: a
    ``ValueError`` where value checks run, and elsewhere the advantages the row weighs are NaN:
    all of them for ``reinforce++``, its group's for ``opo``). ``norm_std``
    and ``eps`` apply to ``grpo`` and (``"group"``/``"none"``) ``grpo_passk`` only. Not
    differentiable.

    Example::

        adv = rlk.grpo_advantages(rewards, group_size=8)                  # TRL: eps=1e-4
        adv = rlk.grpo_advantages(rewards, group_ids=uid, estimator="rloo")   # verl rloo
    """
    rewards = chk.tensor("rewards", rewards, dtypes=chk.FLOAT_DTYPES, ndim=1)
    n = rewards.numel()
    _refuse("estimator", estimator)
    estimator = _alias("estimator", estimator, ADV_ESTIMATORS, ADV_ALIASES)
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (a group needs a baseline), got {group_size}; "
                "groups of one: pass group_ids"
            )
        if n % group_size:
            raise ValueError(f"rewards has {n} entries, not a multiple of group_size={group_size}")
    if group_ids is not None:
        chk.tensor("group_ids", group_ids, dtypes=(torch.int32, torch.int64), ndim=1)
        chk.shape("group_ids", group_ids, (n,), "one per reward")
    grouped = estimator != "reinforce++"
    if grouped and (group_size is None) == (group_ids is None):
        raise ValueError(f"estimator {estimator!r} needs exactly one of group_size and group_ids")
    if not grouped and (group_size is not None or group_ids is not None):
        raise ValueError("estimator 'reinforce++' uses no groups: drop group_size/group_ids")
    if isinstance(norm_std, bool):
        norm_std = "group" if norm_std else "none"
    elif norm_std not in NORM_STD:  # a truthy string such as "False" must not switch it on
        raise TypeError(
            f"norm_std must be a bool or one of {', '.join(map(repr, NORM_STD))}, got {norm_std!r}"
        )
    eps = chk.positive_float("eps", eps)
    if estimator == "grpo_passk" and norm_std == "batch":
        raise ValueError("norm_std='batch' applies to estimator 'grpo', not 'grpo_passk'")
    if estimator.startswith("reinforce++") or estimator == "opo":
        if mask is None:
            raise ValueError(f"estimator {estimator!r} needs mask (the responses' token counts)")
        mask = _check_mask(mask, (n,), of="rewards.numel()")
    elif mask is not None:
        raise ValueError(f"mask applies to the reinforce++ estimators and opo, not {estimator!r}")
    device = chk.same_device(rewards=rewards, group_ids=group_ids, mask=mask)
    return _call(
        "grpo_advantages",
        device,
        rewards,
        group_size,
        norm_std=norm_std,
        eps=eps,
        group_ids=group_ids,
        estimator=estimator,
        mask=mask,
    )
