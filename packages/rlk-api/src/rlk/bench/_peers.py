"""Peers of the ``rlk bench`` families: Liger-Kernel's Functions, ``torch.compile`` of eager
code, and the timing of one case (compile and first call outside the timing; a peer that fails
is left out, recorded in the report's ``left_out`` with its error; rlk's own errors
propagate)."""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlk.bench import timing as _timing

#: One case of an op: (impl name, forward without arguments, the tensors it differentiates to).
Case = tuple[str, Callable[[], Any], Sequence[torch.Tensor]]


def _say(msg: str) -> None:
    print(f"rlk bench: {msg}", file=sys.stderr, flush=True)


@functools.cache
def _liger_ops() -> Any:
    try:
        import liger_kernel.ops as ops  # honours LIGER_KERNEL_IMPL, as Liger's own modules do
    except Exception as e:  # not installed, or its import fails on this machine
        _say(f"no liger rows: liger_kernel.ops cannot be imported ({type(e).__name__}: {e})")
        return None
    return ops


def liger(name: str) -> Any:
    """Liger-Kernel's autograd Function ``name``, or None (said once on stderr) if unavailable."""
    ops = _liger_ops()
    if ops is None:
        return None
    fn = getattr(ops, name, None)
    if fn is None:
        _say(f"no liger rows for {name}: this liger_kernel has no such Function")
    return fn


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for one shape: static shapes (no generic dynamic-shape kernels), and
    a fresh dynamo cache so the shapes timed before do not count against the recompile limit."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def fwd_bwd_step(fwd: Callable[[], Any], leaves: Sequence[torch.Tensor]) -> Callable[[], Any]:
    """A step running ``fwd()`` and the gradients of its outputs to ``leaves`` (which from now on
    require grad), with a fixed random upstream gradient drawn on the first, untimed call."""
    for t in leaves:
        t.requires_grad_()
    grads: list[torch.Tensor] = []

    def step() -> Any:
        outs = _outputs(fwd())
        if not grads:
            # empty_like keeps a peer's output layout
            grads.extend(
                torch.empty_like(o).copy_(_timing.randn(*o.shape, dtype=o.dtype)) for o in outs
            )
        return torch.autograd.grad(outs, leaves, grads)

    return step


def measure(
    emit: Callable[[dict], None],
    op: str,
    shape: str,
    dtype: str,
    impl: str,
    fn,
    memory: bool = False,
    **work,
) -> None:
    """Call ``fn`` once (compilation, autotuning), time it and emit its row; ``work`` is
    ``nbytes`` and/or ``flops``; ``memory``: the row also gets ``extra_GiB``
    (:func:`~rlk.bench._timing.extra_memory_gib` of one more call). A peer that fails is left
    out: ``emit`` gets a record with its error under ``left_out`` instead of a row; rlk's own
    errors propagate."""
    if torch.cuda.is_available():
        # What earlier cases left cached (their compiled graphs, outputs, CUDA-graph pools) is
        # given back first: held, it left torch.compile's linear_logprobs at T = 32768 out of
        # memory (18.6 GiB asked with 2.9 free on an H200) once the entropy rows ran before it.
        gc.collect()
        torch.cuda.empty_cache()
    try:
        fn()
        row = _timing.timed(op, shape, dtype, impl, fn, **work)
        gib = _timing.extra_memory_gib(fn) if memory else None
        if gib is not None:
            row["extra_GiB"] = round(gib, 3)
    except Exception as e:
        if impl == "rlk":
            raise
        # Recorded in the report's left_out, so that a missing peer row says why.
        emit(_timing.left_out(op, shape, dtype, impl, e))
        return
    emit(row)


def time_op(
    emit: Callable[[dict], None],
    op: str,
    shape: str,
    dtype: torch.dtype,
    cases: Sequence[Case],
    fwd_work: dict | None,
    fwd_bwd_work: dict | None,
    memory: bool = False,
) -> None:
    """The ``<op>.fwd`` rows of every case, then its ``<op>.fwd+bwd`` rows; ``*_work`` is the
    ``nbytes``/``flops`` of a row, None for no such row; ``memory``: the fwd+bwd rows also give
    the memory a step allocates (``extra_GiB``). Every forward-only row runs before any input
    is made to require grad."""
    dt = _timing.dtype_name(dtype)
    if fwd_work is not None:
        for impl, f, _ in cases:
            measure(emit, f"{op}.fwd", shape, dt, impl, f, **fwd_work)
    if fwd_bwd_work is not None:
        for impl, f, leaves in cases:
            step = fwd_bwd_step(f, leaves)
            measure(emit, f"{op}.fwd+bwd", shape, dt, impl, step, memory, **fwd_bwd_work)
