"""Seeded per-row sampling: ``sample`` (temperature, top-k, top-p); argument checks and the
per-row parameters, then the selected backend.
"""

from __future__ import annotations

import math

import torch

from rlk import _validate as chk
from rlk._catalog import Operator, op
from rlk.ops._common import _call

#: The ops declared here (``rlk`` exports them).
__all__ = ["sample"]

#: What a sampling parameter must be: in words, and as a test that works elementwise on a
#: tensor and on a Python number alike. Each test is false for NaN.
_SAMPLE_RULES = {
    "offsets": (">= 0", lambda v: v >= 0),
    "temperature": ("finite and >= 0 (0 = greedy)", lambda v: (v >= 0) & (v < math.inf)),
    "top_k": (">= 0 (0 = off)", lambda v: v >= 0),
    "top_p": ("in (0, 1] (1 = off)", lambda v: (v > 0) & (v <= 1)),
}


def _per_row(
    name: str, value: object, b: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A sampling parameter as a ``[b]`` tensor. A Python number is checked here, on the host,
    always (no device work); a tensor's values only when value checks are on (a device read)."""
    rule, ok = _SAMPLE_RULES.get(name, (None, None))
    if isinstance(value, torch.Tensor):
        want = (torch.int64, torch.int32) if dtype == torch.int64 else chk.FLOAT_DTYPES
        chk.tensor(name, value, dtypes=want, ndim=1)
        chk.shape(name, value, (b,), "one per row of logits")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but logits is on {device}")
        value = value.to(dtype)
        if ok and b and chk.value_checks_enabled(value) and not bool(ok(value).all()):
            raise ValueError(f"{name} must be {rule}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")
    if dtype == torch.int64 and not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if dtype == torch.int64 and not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    if ok and not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value}")
    return torch.full((b,), value, dtype=dtype, device=device)


def _check_scaled(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    """``ValueError`` for rows outside the domain: a finite logit whose ``logit / temperature``
    overflows float32, the dtype the kernels scale in (greedy rows divide nothing)."""
    x = logits.float()
    z = x / torch.where(temperature == 0, 1.0, temperature)[:, None]
    bad = (z.isinf() & x.isfinite()).any(-1).nonzero()[:, 0]
    if bad.numel():
        raise ValueError(
            f"logits / temperature overflows float32 in rows {bad[:8].tolist()}: no token can be "
            "drawn (without value checks: -1)"
        )


@op(
    "sampling",
    out_dtype="int64",
    operator=Operator(
        "Tensor logits, Tensor seeds, Tensor offsets, Tensor temperature, Tensor? top_k, "
        "Tensor? top_p",
        outputs=lambda a: [
            torch.empty(a["logits"].shape[0], dtype=torch.int64, device=a["logits"].device)
        ],
    ),
)
def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Seeded per-row sampling with temperature, top-k and top-p; ``[B, V]`` -> int64 ``[B]``.

    Row ``b`` draws with a counter-based RNG (Philox-4x32-10 keyed by ``seeds[b]``, counter
    ``(vocab index, offsets[b])``), so its token depends only on its logits, seed and offset,
    never on the batch. Method: Gumbel-max over the filtered distribution: scale by
    ``1/temperature``; keep the ``top_k`` largest (ties kept; 0 = off); then keep the tokens with
    probability >= the largest threshold whose kept mass is >= ``top_p`` (1.0 = off); pick
    ``argmax(logit/temperature + gumbel)`` (lowest index on ties). ``temperature == 0`` is greedy.
    Each parameter is a number or a per-row ``[B]`` tensor. Numbers are checked always, on the
    host; tensors' values when value checks are on (on CPU, or with ``RLK_VALIDATE``): NaN, a
    negative ``temperature``/``top_k``/``offsets``, an infinite ``temperature`` and ``top_p``
    outside (0, 1] are errors. Without value checks a row with such a ``temperature``,
    ``top_k`` or ``top_p`` draws no token: ``-1``, as a row with a NaN logit does.
    A row of ``logits`` with a NaN has no token to draw: a ``ValueError`` where value checks
    run, and the token ``-1`` for that row otherwise (every backend; no host synchronisation).
    So is a row outside the domain, one with a finite logit whose ``logit / temperature``
    (temperature > 0, computed in float32) overflows, such as bf16 3e38 at temperature 1e-3.
    The Triton backends add the top-p masses as exact int64 fixed-point sums, so with ``top_p``
    other than the number 1.0 they take vocabularies of up to 2**22 (``ValueError`` above).

    Example::

        tok = rlk.sample(logits, seeds, step_offsets, temperature=0.7, top_p=0.9)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    if chk.value_checks_enabled(logits) and bool(logits.isnan().any()):
        raise ValueError("logits has NaN: no token can be drawn (without value checks: -1)")
    b, vocab = logits.shape
    device = logits.device
    seeds = _per_row("seeds", seeds, b, torch.int64, device)
    offsets = _per_row("offsets", offsets, b, torch.int64, device)
    temperature = _per_row("temperature", temperature, b, torch.float32, device)
    # A filter given as the number that turns it off reaches the backend as None (off for
    # every row), so that a backend can skip it without reading the device.
    off_k = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 0
    off_p = isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 1.0
    top_k = None if off_k else _per_row("top_k", top_k, b, torch.int64, device)
    top_p = None if off_p else _per_row("top_p", top_p, b, torch.float32, device)
    if chk.value_checks_enabled(logits):
        _check_scaled(logits, temperature)
    return _call(
        "sample",
        device,
        logits,
        seeds,
        offsets,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
