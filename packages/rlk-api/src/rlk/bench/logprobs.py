"""``rlk bench`` family ``logprobs``: per-token log-probabilities from logits (``rlk.logprobs``)
and from the last hidden state and the lm_head weight (``rlk.linear_logprobs``), against
Liger-Kernel and ``torch.compile``.

Impls, all on the same random bf16 inputs and int64 targets, computing the fp32 log-probability
of each target (what an RL loss needs per token, not a reduced loss):

- ``rlk``: ``rlk.logprobs(logits, targets)``, ``rlk.linear_logprobs(hidden, weight, targets)``;
- ``liger``: minus Liger-Kernel's per-token cross-entropy (``reduction="none"``):
  ``LigerCrossEntropyFunction`` on the logits, ``LigerFusedLinearCrossEntropyFunction`` on
  hidden and weight (its logits are never materialised whole either);
- ``compile``: ``torch.compile`` of ``log_softmax(logits.float()).gather(targets)``, the logits
  being ``hidden @ weight.T`` rounded to bf16 for ``linear_logprobs`` (rlk's default
  ``logits_dtype``), compiled once per shape, before the timing.

Rows: ``logprobs.fwd`` (inputs not requiring grad), ``logprobs.fwd+bwd`` and
``linear_logprobs.fwd+bwd``: the forward on inputs that require grad, then
``torch.autograd.grad`` with a fixed random per-token upstream gradient, to the logits, or to
hidden and weight (the lm_head is trained). ``logprobs_entropy.fwd`` and ``.fwd+bwd``, at the
first logprobs shape: rlk with ``return_entropy=True`` and the compiled reference with the
entropy ``-sum(p * log p)`` too (each returns log-probability + entropy, so the backward runs
through both), against Liger's cross-entropy, which computes no entropy: what a loss with an
entropy term costs against one without. Each impl is called once before it is timed.

Work: ``logprobs`` is memory-bound, counted in bytes (each pass reads its inputs once and writes
its outputs once; the targets and the ``[T]`` outputs are left out): fwd reads the logits, T*V*e;
bwd reads them again and writes dlogits, 2*T*V*e. ``linear_logprobs`` is compute-bound, counted in
flops: 2*T*H*V for the logits, twice that for dhidden and dweight, 6*T*H*V in all (recomputing
the logits in the backward is not counted).

Memory: the ``linear_logprobs.fwd+bwd`` rows also give ``extra_GiB``, the peak memory one step
allocates beyond its inputs, the gradients of hidden and weight included (the same measure for
every impl).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import rlk
from rlk.bench import timing as _timing
from rlk.bench._peers import Case, compiled, liger, time_op

#: Shapes per op (``quick`` takes the first of each): logprobs ``(T, V)``: Qwen2.5/3 and
#: Llama-3 vocabularies; linear_logprobs ``(T, H, V)``: an 8B-class model (H=4096) at two
#: token counts and Qwen2.5-0.5B (H=896), all with Qwen's vocabulary.
SHAPES: dict[str, list[tuple[int, ...]]] = {
    "logprobs": [(16384, 151936), (8192, 128256)],
    "linear_logprobs": [(8192, 4096, 151936), (16384, 896, 151936), (32768, 4096, 151936)],
}
DTYPE = torch.bfloat16


def _logprobs_ref(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]


def _logprobs_entropy_ref(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    lsm = torch.log_softmax(logits.float(), dim=-1)
    return lsm.gather(1, targets[:, None])[:, 0] - (lsm.exp() * lsm).sum(-1)


def _with_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """rlk's log-probability plus its entropy, one ``[T]`` tensor (so that a backward runs
    through both, as through the reference's sum)."""
    lp, ent = rlk.logprobs(logits, targets, return_entropy=True)
    return lp + ent


def _linear_logprobs_ref(hidden, weight, targets):
    return _logprobs_ref(hidden @ weight.T, targets)  # logits rounded to bf16 first, as in rlk


def _randn(*shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _timing.randn(*shape, dtype=dtype or DTYPE)


def _targets(T: int, V: int) -> torch.Tensor:
    return torch.randint(0, V, (T,), device=_timing.DEVICE, generator=_timing.generator())


def _logprobs(emit, T: int, V: int, entropy: bool = False) -> None:
    logits, targets = _randn(T, V), _targets(T, V)
    if entropy:
        rlk_fn = functools.partial(_with_entropy, logits, targets)
        ref_fn = functools.partial(compiled(_logprobs_entropy_ref), logits, targets)
    else:
        rlk_fn = functools.partial(rlk.logprobs, logits, targets)
        ref_fn = functools.partial(compiled(_logprobs_ref), logits, targets)
    cases: list[Case] = [("rlk", rlk_fn, (logits,)), ("compile", ref_fn, (logits,))]
    F = liger("LigerCrossEntropyFunction")
    if F is not None:
        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction)
        # -> (loss, ...); its per-token loss is -logprob, in the logits' dtype. When the logits
        # require grad, Liger writes dlogits over them during the forward (its backward only
        # scales them by the upstream gradient): it gets its own copy, so the inputs of the
        # other impls stay as drawn; the timed calls keep overwriting that copy, which changes
        # its values but not the work.
        own = logits.clone()
        args = (own, targets, None, -100, 0.0, 0.0, "none")
        cases.append(("liger", lambda: -F.apply(*args)[0], (own,)))
    e = logits.element_size()
    fwd, fwd_bwd = {"nbytes": T * V * e}, {"nbytes": 3 * T * V * e}
    op = "logprobs_entropy" if entropy else "logprobs"
    time_op(emit, op, f"T={T} V={V}", DTYPE, cases, fwd, fwd_bwd)


def _linear_logprobs(emit, T: int, H: int, V: int) -> None:
    hidden, targets = _randn(T, H), _targets(T, V)
    weight = (_randn(V, H, dtype=torch.float32) * H**-0.5).to(DTYPE)  # logits of unit scale
    leaves = (hidden, weight)
    ref = compiled(_linear_logprobs_ref)
    cases: list[Case] = [
        ("rlk", lambda: rlk.linear_logprobs(hidden, weight, targets), leaves),
        ("compile", functools.partial(ref, hidden, weight, targets), leaves),
    ]
    F = liger("LigerFusedLinearCrossEntropyFunction")
    if F is not None:
        # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
        # label_smoothing, reduction) -> (loss, ...), loss fp32. With reduction "none" Liger
        # defers the gradient to the backward, where it recomputes the logits chunk by chunk
        # and scales each row by its upstream gradient, as rlk does.
        args = (hidden, weight, targets, None, None, -100, 0.0, 0.0, "none")
        cases.append(("liger", lambda: -F.apply(*args)[0], leaves))
    fwd_bwd = {"flops": 6 * T * H * V}
    shape = f"T={T} H={H} V={V}"
    time_op(emit, "linear_logprobs", shape, DTYPE, cases, None, fwd_bwd, memory=True)


def run(quick: bool, emit: Callable[[dict], None]) -> None:
    """Emit the rows of every op and shape (only the first shape of each op when ``quick``)."""
    n = 1 if quick else None
    for T, V in SHAPES["logprobs"][:n]:
        _logprobs(emit, T, V)
    for T, V in SHAPES["logprobs"][:1]:
        _logprobs(emit, T, V, entropy=True)
    for T, H, V in SHAPES["linear_logprobs"][:n]:
        _linear_logprobs(emit, T, H, V)
