"""rlk's ops as ``torch.library`` custom operators, namespace ``rlk``: what ``torch.compile``
sees.

Each public op is one operator, ``torch.ops.rlk.<op>``, with a fake implementation (the
shapes and dtypes of its outputs, so that FakeTensor, ``torch.compile`` and ``torch.export``
need no kernel) and, where it has a gradient, autograd through
``torch.library.register_autograd`` whose backward is a second operator,
``torch.ops.rlk.<op>_backward``. Dynamo treats both as opaque: no graph break, nothing of
rlk's dispatch traced.

While ``torch.compile`` traces (``torch.compiler.is_compiling()``) a public function runs its
argument checks (at trace time) and calls the operator; eagerly it calls the backend directly,
as it always did, so eager bits and host cost are unchanged. The operators' implementations
pick the backend when they run (``RLK_BACKEND``, ``rlk.use_backend``), exactly as an eager call
does: nothing of the backend is in the graph. (CUDA graphs, ``mode="reduce-overhead"``, replay
the kernels recorded, so there the backend of the recording stands until the graph is
recorded again.)

**Forward and backward.** A backend's :class:`rlk.BackendImpl` may give, per op, an
:class:`rlk.plugins.OpAutograd`: a forward that returns the outputs and the tensors its
backward needs besides the op's inputs and outputs (:data:`EXTRAS`), and that backward. The
Triton backends do, with the kernels of their ``autograd.Function`` (the same launches, so the
same bits, and nothing recomputed). A backend without one (the float64 reference, Ascend's
portable code) runs its own op in the forward, returns the extras filled with NaN (or the
lowest integer), and in the backward runs its own op again under autograd and differentiates
it: its own bits, at the cost of a second forward. A backward runs the backend selected when
it runs; keep a forward and its backward under one selection.

**Value checks.** Under ``torch.compile`` the checks that read tensor values (index ranges,
offsets; always on for CPU tensors eagerly) are not run: a host read would break the graph.
The type, dtype, shape and device checks run when the graph is traced.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlk import selection
from rlk._catalog import Operator
from rlk.ops import CATALOG, REJECT_OPTIONS, SPECS
from rlk.plugins import BackendImpl
from rlk.selection import resolved_impl

LIB = "rlk"

#: Per op with an operator (every required op, and the optional ones that declare one: their
#: forward raises rlk.BackendError where the selected backend lacks them), its operator as its
#: catalog entry declares it (``rlk._catalog.Operator``); the tables below are views of these.
OPERATORS: dict[str, Operator] = {s.name: s.operator for s in CATALOG if s.operator is not None}

#: The operators' schemas (their arguments; every forward returns ``Tensor[]``: the outputs,
#: then the extras).
SCHEMAS: dict[str, str] = {op: o.schema for op, o in OPERATORS.items()}

#: Per op, the outputs' shapes and dtypes as empty tensors, from the arguments by name (the
#: fake implementation; a backend's outputs must match them, strides included: contiguous).
OUTPUTS = {op: o.outputs for op, o in OPERATORS.items()}

#: Per differentiable op whose backend may give an :class:`rlk.OpAutograd` pair, the tensors
#: its backward needs besides the op's inputs and outputs, as that pair's forward returns them.
EXTRAS = {op: o.extras for op, o in OPERATORS.items() if o.extras is not None}

#: The outputs a differentiable op's backward reads (indices into its outputs): the others
#: are not kept for it.
SAVED_OUTPUTS = {op: o.saved_outputs for op, o in OPERATORS.items()}

#: Per differentiable op, the arguments its backward operator differentiates.
GRADS: dict[str, tuple[str, ...]] = {
    op: o.grads or SPECS[op].grad_args
    for op, o in OPERATORS.items()
    if o.grads or SPECS[op].grad_args
}

#: Ops whose backward operator returns its gradients as one flat tensor, back to back (the
#: autograd formula takes views of it).
PACKED_GRADS = frozenset(op for op, o in OPERATORS.items() if o.packed_grads)

#: Gradients that are another argument's (the backward returns one tensor for both).
SAME_GRAD = {op: dict(o.same_grad) for op, o in OPERATORS.items() if o.same_grad}

#: Arguments a backend call leaves out when they are None.
OMITTED_IF_NONE = {op: o.omitted_if_none for op, o in OPERATORS.items() if o.omitted_if_none}

#: Per op returning ``(loss, metrics)``: the names of its metrics for its operator arguments.
METRICS = {op: o.metrics for op, o in OPERATORS.items() if o.metrics is not None}

#: The keywords that take several kinds of value, and the operator arguments that follow each
#: to carry them (see :func:`_encode`).
SPLIT = {
    "is_normalize": ("is_normalize_value", "is_normalize_tensor"),
    "num_tokens": ("num_tokens_tensor",),
    "num_seqs": ("num_seqs_tensor",),
}


def _encoded(op: str) -> bool:
    """Whether the op's keywords are encoded as operator arguments (:func:`_encode`): it has a
    keyword of :data:`SPLIT`."""
    return any(k in SPLIT for k in SPECS[op].kwonly)


def _arg_kinds(op: str) -> tuple[tuple[str, str], ...]:
    """The operator's arguments (its schema's names) with how the backend gets each:
    ``"pos"`` by position, ``"kw"`` by keyword (the catalog's ``kwonly``), ``"pos?"`` / ``"kw?"``
    the same, left out when None (:data:`OMITTED_IF_NONE`)."""
    names = tuple(arg.split()[-1] for arg in SCHEMAS[op].split(","))
    kwonly = [*SPECS[op].kwonly]
    for name, extra in SPLIT.items() if _encoded(op) else ():
        if name in kwonly:
            kwonly[kwonly.index(name) + 1 : kwonly.index(name) + 1] = extra
    if names[len(names) - len(kwonly) :] != tuple(kwonly):
        raise RuntimeError(f"rlk::{op}'s schema ends in {names}, not the catalog's {kwonly}")
    omitted = OMITTED_IF_NONE.get(op, ())
    return tuple(
        (n, ("kw" if n in kwonly else "pos") + ("?" if n in omitted else "")) for n in names
    )


#: Per op: the backend's arguments in order, each ``(name, kind)`` (:func:`_arg_kinds`).
ARGS: dict[str, tuple[tuple[str, str], ...]] = {op: _arg_kinds(op) for op in SCHEMAS}

#: The ops of :func:`_encoded`, and the number of their leading positional tensors.
ENCODED = {op: sum(k == "pos" for _, k in ARGS[op]) for op in SCHEMAS if _encoded(op)}


def _names(op: str) -> tuple[str, ...]:
    return tuple(n for n, _ in ARGS[op])


def _encode(op: str, a: dict[str, Any]) -> None:
    """An op's keywords (as a backend gets them) as operator arguments, in place: a
    number-or-tensor count as two arguments; policy_loss's ``is_normalize`` as a kind and a
    value, ``reject`` as ``[lower, upper]`` per option of ``REJECT_OPTIONS`` (NaN: no bound;
    empty: no rejection), ``mode_params`` padded with zeros to four floats."""
    for n in ("num_tokens", "num_seqs"):
        v = a[n]
        a[n], a[f"{n}_tensor"] = (None, v) if isinstance(v, torch.Tensor) else (v, None)
    if "is_normalize" not in a:
        return
    norm = a["is_normalize"]
    a["is_normalize_value"], a["is_normalize_tensor"] = 0.0, None
    if isinstance(norm, bool):
        a["is_normalize"] = "mean" if norm else "off"
    elif isinstance(norm, torch.Tensor):
        a["is_normalize"], a["is_normalize_tensor"] = "tensor", norm
    else:
        a["is_normalize"], a["is_normalize_value"] = "value", float(norm)
    reject = a["reject"]
    flat: list[float] = []
    if reject:
        for option in REJECT_OPTIONS:
            lo, hi = reject.get(option, (math.nan, math.nan))
            flat += [math.nan if lo is None else lo, hi]
    a["reject"] = flat
    # Four floats, always: an empty list argument breaks the custom op's autograd structure.
    a["mode_params"] = [float(v) for v in a["mode_params"]] + [0.0] * (4 - len(a["mode_params"]))


def _decode(op: str, a: dict[str, Any]) -> None:
    """The inverse of :func:`_encode`, in place."""
    for n in ("num_tokens", "num_seqs"):
        t = a.pop(f"{n}_tensor")
        if t is not None:
            a[n] = t
    if "is_normalize" not in a:
        return
    kind = a.pop("is_normalize")
    value, tensor = a.pop("is_normalize_value"), a.pop("is_normalize_tensor")
    a["is_normalize"] = {"off": False, "mean": True, "value": value, "tensor": tensor}[kind]
    flat, reject = a["reject"], {}
    for i, option in enumerate(REJECT_OPTIONS if flat else ()):
        lo, hi = flat[2 * i], flat[2 * i + 1]
        if not math.isnan(hi):
            reject[option] = (None if math.isnan(lo) else lo, hi)
    a["reject"] = reject or None
    a["mode_params"] = tuple(a["mode_params"])


def n_outputs(op: str, a: Mapping[str, Any]) -> int:
    """How many outputs the operator returns before its extras (counted from the op's
    ``outputs``, which makes empty tensors: this runs while tracing, not per eager call)."""
    return len(OUTPUTS[op](a))


def backend_call(op: str, values: tuple) -> tuple[tuple, dict[str, Any]]:
    """The backend's ``(args, kwargs)`` from the operator's arguments, in the catalog's way."""
    args, kwargs = [], {}
    if op in ENCODED:
        a = dict(zip(_names(op), values))
        _decode(op, a)
        return tuple(a.pop(n) for n in _names(op)[: ENCODED[op]]), a
    for (name, kind), v in zip(ARGS[op], values):
        if kind == "pos" or (kind == "pos?" and v is not None):
            args.append(v)
        elif kind == "kw" or (kind == "kw?" and v is not None):
            kwargs[name] = v
    return tuple(args), kwargs


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _poison(t: torch.Tensor) -> torch.Tensor:
    """An extra a backend without :class:`OpAutograd` does not compute: NaN (or the lowest
    integer), so that a backward of another backend reading it cannot pass for right."""
    fill = math.nan if t.dtype.is_floating_point else torch.iinfo(t.dtype).min
    return torch.full(t.shape, fill, dtype=t.dtype, device=t.device)


def _forward_impl(op: str) -> Callable[..., list[torch.Tensor]]:
    names = _names(op)
    extras_of = EXTRAS.get(op)

    def impl(*values: Any) -> list[torch.Tensor]:
        args, kwargs = backend_call(op, values)
        impl_ = resolved_impl(values[0].device)
        if op not in impl_.ops:  # an optional op: a BackendError naming the backends that have it
            selection.optional_op(values[0].device, op, f"rlk.{op}")
        split = impl_.autograd.get(op) if extras_of is not None else None
        if split is not None:
            outs, extras = split.forward(*args, **kwargs)
            return [*outs, *extras]
        outs = _as_tuple(op_outputs(op, impl_.ops[op](*args, **kwargs)))
        if extras_of is None:
            return list(outs)
        extras = [_poison(t) for t in extras_of(dict(zip(names, values)))]
        return [*outs, *extras]

    return impl


def _fake_impl(op: str) -> Callable[..., list[torch.Tensor]]:
    names = _names(op)
    extras_of = EXTRAS.get(op, lambda a: [])

    def fake(*values: Any) -> list[torch.Tensor]:
        a = dict(zip(names, values))
        return [*OUTPUTS[op](a), *extras_of(a)]

    return fake


_AUTOCAST = [k for n, k in torch._C.DispatchKey.__members__.items() if n.startswith("Autocast")]


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd inside an operator's implementation, which runs below autograd (its dispatch
    keys excluded): the recomputing backward of a backend without :class:`OpAutograd` needs
    them back. Autocast stays off, as it is for the operator."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    keep = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for key in _AUTOCAST:
        if excluded.has(key):
            keep = keep.add(key)
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, keep), torch.enable_grad():
        yield


def _recompute_grads(impl_, op: str, grads, needs, args, kwargs) -> tuple:
    """The backend's own op run again under autograd, differentiated: ``needs``' gradients."""
    names = [n for n, k in ARGS[op] if k in ("pos", "pos?")]
    args = list(args)
    leaves = {}
    for want, name in zip(needs, GRADS[op]):
        holder, key = (args, names.index(name)) if name in names else (kwargs, name)
        if want:
            holder[key] = leaves[name] = holder[key].detach().requires_grad_()
    with _autograd_inside_op():
        outs = _as_tuple(op_outputs(op, impl_.ops[op](*args, **kwargs)))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad(
            [o for o, _ in pairs], list(leaves.values()), [g for _, g in pairs], allow_unused=True
        )
    got = dict(zip(leaves, got))
    return tuple(
        (torch.zeros_like(leaves[n]) if got[n] is None else got[n]) if n in leaves else None
        for n in GRADS[op]
    )


def op_outputs(op: str, out: Any) -> Any:
    """A backend's outputs as the operator returns them: the metrics of an op of
    :data:`METRICS` as one tensor (the operator's outputs may not alias one another, and a
    backend's metrics may be views of one buffer)."""
    if op not in METRICS:
        return out
    loss, metrics = out
    return loss, torch.stack([m.reshape(()).float() for m in metrics.values()])


def _distinct_grads(op: str) -> tuple[str, ...]:
    same = SAME_GRAD.get(op, {})
    return tuple(n for n in GRADS[op] if n not in same)


def _backward_impl(op: str) -> Callable[..., list[torch.Tensor]]:
    distinct = _distinct_grads(op)

    def impl(grads, outs, extras, *rest) -> list[torch.Tensor]:
        *values, needs = rest
        args, kwargs = backend_call(op, tuple(values))
        impl_ = resolved_impl(values[0].device)
        split = impl_.autograd.get(op)
        if split is not None:
            got = split.backward(tuple(grads), tuple(outs), tuple(extras), tuple(needs), *args,
                                 **kwargs)  # fmt: skip
        else:
            got = _recompute_grads(impl_, op, tuple(grads), tuple(needs), args, kwargs)
        by_name = dict(zip(GRADS[op], got))
        out = [by_name[n] for n, want in zip(GRADS[op], needs) if want and n in distinct]
        return [_flat(out)] if op in PACKED_GRADS else _unaliased(out, values)

    return impl


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    """``grads`` back to back in one 1-D tensor: their own buffer where they are consecutive
    contiguous views of one (no copy), else a concatenation."""
    base = grads[0]._base if grads else None
    offset = 0
    for g in grads:
        if g._base is not base or not g.is_contiguous() or g.storage_offset() != offset:
            base = None
            break
        offset += g.numel()
    if base is not None and base.dim() == 1 and base.numel() == offset:
        return base
    return torch.cat([g.reshape(-1) for g in grads]) if grads else torch.empty(0)


def _unaliased(grads: list[torch.Tensor], values) -> list[torch.Tensor]:
    """``grads``, with a copy of any that shares memory with an argument or an earlier one (an
    operator's outputs may alias neither)."""
    seen = {v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)}
    out = []
    for g in grads:
        ptr = g.untyped_storage().data_ptr()
        if ptr in seen and g.numel():
            g = g.clone()
            ptr = g.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(g)
    return out


def _backward_fake(op: str) -> Callable[..., list[torch.Tensor]]:
    names = _names(op)
    distinct = _distinct_grads(op)

    def fake(grads, outs, extras, *rest) -> list[torch.Tensor]:
        *values, needs = rest
        a = dict(zip(names, values))
        want = [a[n] for n, w in zip(GRADS[op], needs) if w and n in distinct]
        if op in PACKED_GRADS:
            numel = sum(t.numel() for t in want)
            return [torch.empty(numel, dtype=want[0].dtype, device=want[0].device)]
        return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in want]

    return fake


def _setup_context(op: str) -> Callable[..., None]:
    names = _names(op)

    def setup_context(ctx, inputs, output) -> None:
        a = dict(zip(names, inputs))
        n = n_outputs(op, a)
        keep = SAVED_OUTPUTS.get(op, lambda a: ())(a)
        tensors = [v if isinstance(v, torch.Tensor) else None for v in inputs]
        ctx.slots = [i for i, t in enumerate(tensors) if t is not None]
        ctx.plain = [None if isinstance(v, torch.Tensor) else v for v in inputs]
        ctx.n_outs, ctx.keep = n, keep
        ctx.save_for_backward(
            *(tensors[i] for i in ctx.slots), *(output[i] for i in keep), *output[n:]
        )

    return setup_context


def _backward(op: str) -> Callable[..., tuple]:
    names = _names(op)
    position = {n: i for i, n in enumerate(names)}
    distinct = _distinct_grads(op)
    backward_op = getattr(getattr(torch.ops, LIB), f"{op}_backward")

    def backward(ctx, grads):
        saved = ctx.saved_tensors
        values = list(ctx.plain)
        for j, i in enumerate(ctx.slots):
            values[i] = saved[j]
        rest = saved[len(ctx.slots) :]
        outs: list[torch.Tensor | None] = [None] * ctx.n_outs
        for j, i in enumerate(ctx.keep):
            outs[i] = rest[j]
        extras = list(rest[len(ctx.keep) :])
        needs = [bool(ctx.needs_input_grad[position[n]]) for n in GRADS[op]]
        for n, src in SAME_GRAD.get(op, {}).items():
            if needs[GRADS[op].index(n)] and values[position[n]] is not None:
                needs[GRADS[op].index(src)] = True
        got = backward_op(list(grads[: ctx.n_outs]), outs, extras, *values, needs)
        if op in PACKED_GRADS:
            got = _unflat(got[0], [values[position[n]] for n, w in zip(GRADS[op], needs) if w])
        got = iter(got)
        by_name = {n: next(got) for n, want in zip(GRADS[op], needs) if want and n in distinct}
        for n, src in SAME_GRAD.get(op, {}).items():
            by_name[n] = by_name.get(src) if values[position[n]] is not None else None
        result = [None] * len(names)
        for n, g in by_name.items():
            if ctx.needs_input_grad[position[n]]:
                result[position[n]] = g
        return tuple(result)

    return backward


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _define() -> None:
    for op, args in SCHEMAS.items():
        qualname = f"{LIB}::{op}"
        torch.library.custom_op(
            qualname, _forward_impl(op), mutates_args=(), schema=f"({args}) -> Tensor[]"
        )
        torch.library.register_fake(qualname, _fake_impl(op))
        if op not in GRADS:
            continue
        back = f"{LIB}::{op}_backward"
        torch.library.custom_op(
            back,
            _backward_impl(op),
            mutates_args=(),
            schema=f"(Tensor?[] grads, Tensor?[] outs, Tensor[] extras, {args}, bool[] needs) "
            "-> Tensor[]",
        )
        torch.library.register_fake(back, _backward_fake(op))
        torch.library.register_autograd(qualname, _backward(op), setup_context=_setup_context(op))


_define()


class _TracedOps(Mapping):
    """The ops a public function finds while ``torch.compile`` traces: each op of
    :data:`SCHEMAS` as its operator; any other (the optional ops) as the selected backend's."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def __getitem__(self, op: str) -> Callable[..., Any]:
        if op in SCHEMAS:
            return lambda *args, **kwargs: call(op, args, kwargs)
        return resolved_impl(self.device).ops[op]

    def __iter__(self):
        return iter(SCHEMAS)

    def __len__(self) -> int:
        return len(SCHEMAS)


def traced_impl(device: Any) -> BackendImpl:
    """What ``rlk.selection.backend_impl`` returns while ``torch.compile`` traces."""
    return BackendImpl(ops=_TracedOps(device), claims=frozenset())


selection._serve_traced(traced_impl)


def operator_args(op: str, args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
    """``torch.ops.rlk.<op>``'s arguments for a backend call's ``(args, kwargs)``."""
    positional = [n for n, k in ARGS[op] if k in ("pos", "pos?")]
    a = dict(zip(positional, args))
    a.update(kwargs)
    if op in ENCODED:
        _encode(op, a)
    return [a.get(n) for n in _names(op)]


def call(op: str, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """``torch.ops.rlk.<op>`` on a backend call's ``(args, kwargs)`` (what the public function
    passes a backend), returning what the backend returns."""
    values = operator_args(op, args, kwargs)
    outs = getattr(getattr(torch.ops, LIB), op)(*values)
    a = dict(zip(_names(op), values))
    if op in METRICS:
        return outs[0], {n: outs[1][i] for i, n in enumerate(METRICS[op](a))}
    n = n_outputs(op, a)
    return outs[0] if n == 1 else tuple(outs[:n])
