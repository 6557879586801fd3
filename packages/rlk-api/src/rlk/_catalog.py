"""The op catalog's entry: :class:`OpSpec`, and :func:`op`, which declares a public function as
an op.

An op's catalog entry is its public function, decorated: ``@op("gemm", grad_args=...)`` on
``rlk.ops.dense.linear`` declares the op ``linear`` (its name and backend keywords taken from
the function), so the signature is written once, where it is documented. :mod:`rlk.ops` imports
the declaring modules (:data:`MODULES`) and takes :data:`rlk.ops.CATALOG` from :func:`declared`;
the op tables (``rlk.OPS``, ``OPTIONAL_OPS``, the conformance kit's metadata), the exports of
``rlk``, the float64 backend's ops and the ops of rlk-triton's backends all come from it.

A required op is also one ``torch.library`` operator for ``torch.compile``, ``torch.ops.rlk.<op>``
(:mod:`rlk._library` defines them): the decorator's :class:`Operator` describes it (schema,
output shapes and what its backward needs), beside the function.

Adding an op (``docs/architecture.md``, "Adding an op"): its decorated public function in its
family's module of ``rlk/ops/``, its float64 oracle in ``rlk_reference``, its kernels in the
file of rlk-triton named by ``family``, and its case builder in ``rlk/testing/cases.py`` (named
after the op).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: A function of the operator's arguments by name (a dict) giving tensors or names.
ArgsFn = Callable[[dict[str, Any]], Any]


def no_extras(a: dict[str, Any]) -> list:
    """:attr:`Operator.extras` of an op whose backward needs nothing besides its inputs and
    outputs."""
    return []


def no_saved_outputs(a: dict[str, Any]) -> tuple[int, ...]:
    """:attr:`Operator.saved_outputs` of an op whose backward reads none of its outputs."""
    return ()


@dataclass(frozen=True)
class Operator:
    """A required op as the ``torch.library`` operator ``torch.ops.rlk.<op>`` (what
    ``torch.compile`` sees; :mod:`rlk._library` defines it from this).

    ``schema``: the backend's arguments in order with their operator types, ending in the
    op's keywords (``"Tensor x, Tensor weight, Tensor? bias"``); every forward returns
    ``Tensor[]``, the outputs then the extras. Keywords that take a number or a tensor
    (``num_tokens``, ``num_seqs``, ``is_normalize``) are followed by the arguments that carry
    the tensor (``rlk._library.SPLIT``). The types are not derived from the public signature:
    a backend receives normalised values of other types (``scale`` resolved to a float,
    ``sample``'s parameters as tensors).

    ``outputs``: the outputs' shapes and dtypes as empty contiguous tensors, from the
    arguments by name (the fake implementation; a backend's outputs must match them).

    ``extras``: for a differentiable op whose backend may give an :class:`rlk.OpAutograd`
    pair, the tensors its backward needs besides the op's inputs and outputs, as empty
    tensors (:func:`no_extras`: none). None: the compiled backward runs the backend's op again
    under autograd. ``saved_outputs``: the indices of the outputs that backward reads.

    ``grads``: the arguments the operator's backward differentiates, when they are more than
    the catalog's ``grad_args``. ``omitted_if_none``: arguments a backend call leaves out when
    they are None. ``packed_grads``: the backward returns its gradients back to back in one
    flat tensor (they are views of one buffer, which an operator's outputs may not be).
    ``same_grad``: ``(argument, other)`` pairs whose gradients are one tensor (they enter
    only through their sum). ``metrics``: for an op returning ``(loss, metrics)``, the names
    of its metrics for the arguments (the operator returns them stacked in one tensor).
    """

    schema: str
    outputs: ArgsFn
    extras: ArgsFn | None = None
    saved_outputs: ArgsFn = no_saved_outputs
    grads: tuple[str, ...] = ()
    omitted_if_none: tuple[str, ...] = ()
    packed_grads: bool = False
    same_grad: tuple[tuple[str, str], ...] = ()
    metrics: ArgsFn | None = None


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
    asked for. ``module``: the module of ``rlk`` holding the public function. ``operator``:
    the op's custom operator (:class:`Operator`): every required op has one; an optional op
    without one is traced into the backend's call.
    """

    name: str
    family: str
    kwonly: tuple[str, ...] = ()
    grad_args: tuple[str, ...] = ()
    unit_grads: tuple[str, ...] = ()
    out_dtype: str = "input"
    optional: bool = False
    module: str = ""
    operator: Operator | None = field(default=None, compare=False)


#: Every op declared by :func:`op`, by name (:func:`declared` orders them).
DECLARED: dict[str, OpSpec] = {}

#: The op families, each a module of :mod:`rlk.ops` holding its ops' public functions, in the
#: order of ``rlk.OPS``.
FAMILIES = ("dense", "attention", "logprobs", "losses", "ppo", "sampling", "moe")

#: The modules that declare ops as they are imported: the families, then ``rlk.parallel`` (the
#: tensor-parallel ops). :mod:`rlk.ops` imports them all, so once ``rlk`` is imported every op
#: is declared.
MODULES = (*(f"rlk.ops.{f}" for f in FAMILIES), "rlk.parallel")


def declared() -> tuple[OpSpec, ...]:
    """Every declared op: the required ones in the order of ``rlk.OPS``, then the optional ones
    (each group in the order of :data:`MODULES`, then of the definitions in the module).

    This is :data:`rlk.ops.CATALOG`; the plugin interface (:mod:`rlk.plugins`), which sits below
    the ops, reads it here when a backend is loaded, by which time ``rlk`` has imported them.
    """
    return tuple(sorted(DECLARED.values(), key=lambda s: (s.optional, MODULES.index(s.module))))


def op(
    family: str,
    *,
    grad_args: tuple[str, ...] = (),
    unit_grads: tuple[str, ...] = (),
    out_dtype: str = "input",
    optional: bool = False,
    kwonly: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    operator: Operator | None = None,
) -> Callable[[F], F]:
    """Declare the decorated public function as the op of its name (an :class:`OpSpec`).

    ``kwonly`` defaults to the function's keyword-only parameters less ``aliases`` (public
    keywords folded into others before the backend call, such as ``policy_loss``'s
    ``tis_cap``); an op whose public function takes other keywords than its backends (the
    tensor-parallel ops of ``rlk.parallel``) gives it. A required op gives its ``operator``.
    The function is returned unchanged.
    """

    def declare(fn: F) -> F:
        if operator is None and not optional:
            raise ValueError(f"the required op {fn.__name__!r} needs its operator (an Operator)")
        params = inspect.signature(fn).parameters.values()
        kw = kwonly
        if kw is None:
            kw = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in aliases)
        spec = OpSpec(
            fn.__name__,
            family,
            kw,
            grad_args,
            unit_grads,
            out_dtype,
            optional,
            fn.__module__,
            operator,
        )
        if DECLARED.get(spec.name, spec) != spec:  # (a module imported again declares it again)
            raise ValueError(f"op {spec.name!r} is declared twice, differently")
        DECLARED[spec.name] = spec
        return fn

    return declare
