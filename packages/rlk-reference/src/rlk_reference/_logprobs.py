"""Log-probabilities and entropy of targets under softmax(logits / temperature)."""

from __future__ import annotations

import math

import torch

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["logprobs", "linear_logprobs"]


def result_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 results, except float64 inputs, which give exact float64 results."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def scaled_overflow(logits: torch.Tensor, temperature) -> torch.Tensor:
    """Where ``logits / temperature``, computed in float32 as the kernels scale, is infinite
    while the logit itself is finite (bool, ``logits``' shape): outside the ops' domain.

    ``temperature``: a number, or a float32 tensor that broadcasts against ``logits`` (> 0). The
    division is tensor by tensor, so it is correctly rounded on every device (a CUDA tensor
    divided by a Python number is multiplied by the reciprocal instead)."""
    x = logits.float()
    t = torch.as_tensor(temperature, dtype=torch.float32, device=x.device)
    return torch.isfinite(x) & torch.isinf(x / t)


def _logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # Shifted by the row's max before the division: logits near the float range at a small
    # temperature make z itself huge (3e35 / 1e-3), and z_target - logsumexp(z) would then lose
    # every digit of the answer to cancellation. The shift leaves the value unchanged. A row
    # whose max is inf or NaN is not shifted (inf - inf would turn it NaN): it keeps the
    # special-value results of the unshifted formula.
    x = logits.double()
    m = x.amax(-1, keepdim=True).detach()  # (no gradient: the value is shift-invariant)
    z = (x - torch.where(torch.isfinite(m), m, torch.zeros_like(m))) / temperature
    # A finite logit whose z overflows float32 (bf16 3e38 at temperature 1e-3) is outside the
    # domain: it counts as a NaN logit, so its row's results and gradient are NaN, as in the
    # kernels, which scale in float32. ``z + nan``: the gradient flows (as NaN).
    z = z + torch.where(scaled_overflow(logits, temperature), math.nan, 0.0)
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets.long()[:, None])[:, 0] - lse
    if not return_entropy:
        return lp.to(out_dtype)
    # -sum p log p, with p log p = 0 where p = 0 (a -inf logit), not 0 * -inf = NaN
    log_p = z - lse[:, None]
    p = log_p.exp()
    safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p))  # keeps the gradient finite
    entropy = -(p * safe_log_p).sum(-1)
    return lp.to(out_dtype), entropy.to(out_dtype)


def logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    table=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, V]``, int64 ``targets [T]`` -> float32 ``[T]`` log-probabilities
    ``z[target] - logsumexp(z)`` with ``z = logits / temperature``; with ``return_entropy`` also
    the entropy ``-sum(p * log p)`` of ``p = softmax(z)`` (terms with ``p = 0`` count 0). A row
    with a finite logit whose ``logit / temperature`` overflows float32
    (:func:`scaled_overflow`) gives NaN."""
    return _logprobs(logits, targets, temperature, return_entropy, result_dtype(logits))


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logits_dtype: torch.dtype | None = None,
    *,
    table=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs` of ``hidden [T, H] @ weight [V, H].T + bias [V]``.

    The logits are computed in float64 and rounded to ``logits_dtype`` (default hidden's dtype),
    as the unfused path would materialise them; float64 ``hidden`` skips the rounding (exact
    oracle).
    """
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if hidden.dtype != torch.float64:
        logits = logits.to(logits_dtype or hidden.dtype)
    return _logprobs(logits, targets, temperature, return_entropy, result_dtype(hidden))
