"""Token log-probabilities: ``logprobs`` (from logits) and ``linear_logprobs`` (fused with the
lm_head). :func:`check_linear_logprobs` is public: ``rlk.parallel`` checks its vocabulary-
parallel variant with it.
"""

from __future__ import annotations

import torch

from rlk import _validate as chk
from rlk._catalog import Operator, op
from rlk.ops._common import _call, f32

#: The ops declared here (``rlk`` exports them).
__all__ = ["logprobs", "linear_logprobs"]


def _check_targets(targets: object, t: int, vocab: int) -> torch.Tensor:
    targets = chk.tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    chk.shape("targets", targets, (t,), "one per row")
    chk.index_range("targets", targets, 0, vocab, f"vocabulary of {vocab}")
    return targets


def _outs(src: str):
    """The outputs of a log-probability op whose rows are argument ``src``'s: the log-probs,
    and the entropies where asked."""
    return lambda a: [f32(a[src].shape[0], like=a[src]) for _ in range(1 + a["return_entropy"])]


def _saved(a):
    # The backward reads the entropy (output 1) where there is one.
    return (1,) if a["return_entropy"] else ()


@op(
    "logprobs",
    grad_args=("logits",),
    unit_grads=("logits",),
    out_dtype="float32",
    operator=Operator(
        "Tensor logits, Tensor targets, float temperature, bool return_entropy",
        outputs=_outs("logits"),
        # each row's log-sum-exp of the logits over the temperature
        extras=lambda a: [f32(a["logits"].shape[0], like=a["logits"])],
        saved_outputs=_saved,
    ),
)
def logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target under ``softmax(logits / temperature)``, and its entropy.

    Shapes: ``logits [T, V]`` (bf16/fp16/fp32), ``targets`` int64 ``[T]`` -> float32 ``[T]``
    (and entropy float32 ``[T]`` with ``return_entropy``). ``logits`` is read once; the
    log-sum-exp runs over the vocabulary in fixed-size chunks in a fixed order.
    Differentiable with respect to ``logits``. A row with a finite logit whose
    ``logit / temperature`` overflows float32 (bf16 3e38 at temperature 1e-3) is outside the
    domain: its log-probability, entropy and gradient are NaN on every backend.

    Example::

        lp = rlk.logprobs(logits, sampled_tokens)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    chk.tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    chk.same_device(logits=logits, targets=targets)
    targets = _check_targets(targets, logits.shape[0], logits.shape[1])
    temperature = chk.positive_float("temperature", temperature)
    return_entropy = chk.flag("return_entropy", return_entropy)
    return _call("logprobs", logits.device, logits, targets, temperature, return_entropy)


def check_linear_logprobs(hidden, weight, targets, bias, temperature, logits_dtype, vocab=None):
    """Validate :func:`linear_logprobs`' arguments (``weight`` may hold a slice of a
    ``vocab``-row lm_head): returns ``(device, targets, temperature, logits_dtype)``."""
    chk.tensor("hidden", hidden, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    chk.tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if bias is not None:
        chk.tensor("bias", bias, dtypes=chk.FLOAT_DTYPES, ndim=1)
    chk.tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    device = chk.same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    chk.same_dtype(hidden=hidden, weight=weight, bias=bias)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocabulary row")
    if bias is not None:
        chk.shape("bias", bias, (weight.shape[0],), "V = weight.shape[0]")
    targets = _check_targets(targets, hidden.shape[0], weight.shape[0] if vocab is None else vocab)
    temperature = chk.positive_float("temperature", temperature)
    if logits_dtype is None:
        logits_dtype = hidden.dtype
    if not isinstance(logits_dtype, torch.dtype) or logits_dtype not in chk.FLOAT_DTYPES:
        raise TypeError(f"logits_dtype must be one of bf16/fp16/fp32, got {logits_dtype!r}")
    return device, targets, temperature, logits_dtype


@op(
    "fused_logprobs",
    grad_args=("hidden", "weight", "bias"),
    unit_grads=("hidden",),
    out_dtype="float32",
    operator=Operator(
        "Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, float temperature, "
        "bool return_entropy, ScalarType logits_dtype",
        outputs=_outs("hidden"),
        extras=lambda a: [f32(a["hidden"].shape[0], like=a["hidden"])],
        saved_outputs=_saved,
    ),
)
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs` of ``linear(hidden, weight, bias)`` without materialising the logits.

    Shapes: ``hidden [T, H]``, ``weight [V, H]``, ``bias [V]``, ``targets`` int64 ``[T]`` ->
    float32 ``[T]`` (and entropy). ``logits_dtype`` (default ``hidden.dtype``, what rollout
    engines materialise) is the dtype each logit is rounded to before the softmax, so that
    ``linear_logprobs(h, W, t) == logprobs(linear(h, W), t)`` bitwise. Extra memory is bounded
    by a chunk, independent of T. Backward gives dHidden, dWeight, dBias deterministically.
    As in :func:`logprobs`, a row with a finite logit whose ``logit / temperature`` overflows
    float32 gives NaN.

    Example::

        lp = rlk.linear_logprobs(h, lm_head.weight, targets)
    """
    device, targets, temperature, logits_dtype = check_linear_logprobs(
        hidden, weight, targets, bias, temperature, logits_dtype
    )
    return_entropy = chk.flag("return_entropy", return_entropy)
    return _call(
        "linear_logprobs",
        device,
        hidden,
        weight,
        targets,
        bias,
        temperature,
        return_entropy,
        logits_dtype,
    )
