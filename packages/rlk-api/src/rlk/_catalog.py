"""The op catalog's entry: :class:`OpSpec`, and :func:`op`, which declares a public function as
an op.

An op's catalog entry is its public function, decorated: ``@op("gemm", grad_args=...)`` on
``rlk.ops.dense.linear`` declares the op ``linear`` (its name and backend keywords taken from
the function), so the signature is written once, where it is documented. :mod:`rlk.ops` imports
every family module and assembles :data:`rlk.ops.CATALOG` from what they declared; the op
tables (``rlk.OPS``, ``OPTIONAL_OPS``, the conformance kit's metadata), the exports of ``rlk``,
the float64 backend's ops and the ops of rlk-triton's backends all come from it.

Adding an op (``docs/architecture.md``, "Adding an op"): its decorated public function in its
family's module of ``rlk/ops/``, its float64 oracle in ``rlk_reference``, its kernels in the
file of rlk-triton named by ``family``, and its case builder in ``rlk/testing/cases.py`` (named
after the op).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class OpSpec:
    """One op, as backends receive it (validated, normalised arguments; see ``rlk.ops``).

    ``family``: the op family, which is also the module of rlk-triton holding its kernels,
    launchers, ``autograd.Function`` and the function a backend binds to a tuning table.
    ``kwonly``: arguments a backend receives by keyword (the others come by position, in the
    order of the public signature). ``grad_args``: inputs that get a gradient. ``unit_grads``:
    those of ``grad_args`` that belong to one row / sequence, so must not depend on the batch
    (weight gradients sum over rows and only have to be deterministic). ``out_dtype``: the dtype
    of the outputs, ``"input"`` for the dtype of the first tensor argument, else a torch dtype's
    name (one per output, comma-separated, where they differ). ``optional``: a backend may leave
    the op out and still be selected; rlk then raises :class:`rlk.BackendError` where the op is
    asked for. ``module``: the module of ``rlk`` holding the public function.
    """

    name: str
    family: str
    kwonly: tuple[str, ...] = ()
    grad_args: tuple[str, ...] = ()
    unit_grads: tuple[str, ...] = ()
    out_dtype: str = "input"
    optional: bool = False
    module: str = ""


#: Every op declared by :func:`op`, by name (:mod:`rlk.ops` orders them).
DECLARED: dict[str, OpSpec] = {}


def op(
    family: str,
    *,
    grad_args: tuple[str, ...] = (),
    unit_grads: tuple[str, ...] = (),
    out_dtype: str = "input",
    optional: bool = False,
    kwonly: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
) -> Callable[[F], F]:
    """Declare the decorated public function as the op of its name (an :class:`OpSpec`).

    ``kwonly`` defaults to the function's keyword-only parameters less ``aliases`` (public
    keywords folded into others before the backend call, such as ``policy_loss``'s
    ``tis_cap``); an op whose public function takes other keywords than its backends (the
    tensor-parallel ops of ``rlk.parallel``) gives it. The function is returned unchanged.
    """

    def declare(fn: F) -> F:
        params = inspect.signature(fn).parameters.values()
        kw = kwonly
        if kw is None:
            kw = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in aliases)
        spec = OpSpec(
            fn.__name__, family, kw, grad_args, unit_grads, out_dtype, optional, fn.__module__
        )
        if DECLARED.get(spec.name, spec) != spec:  # (a module imported again declares it again)
            raise ValueError(f"op {spec.name!r} is declared twice, differently")
        DECLARED[spec.name] = spec
        return fn

    return declare
