"""Build a backend implementation from the rlk_triton kernels and a tuning table.

Vendor packages (rlk-cuda, rlk-rocm) build their backends with :func:`make_impl` on their
tuning table merged over :func:`default_table`, and declare that table under the entry-point
group :data:`TABLES_GROUP` so that the conformance kit runs its configs on any device (the
rocm table on an NVIDIA GPU or under the interpreter). This package imports none of them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

import torch

from rlk.ops import CATALOG
from rlk.plugins import BackendImpl, OpAutograd
from rlk_triton import tuning
from rlk_triton._triton import INTERPRET

#: op -> module of rlk_triton holding its public function (one file per op family, named by
#: the family of the op catalog).
OP_MODULES = {spec.name: spec.family for spec in CATALOG}

#: Entry-point group of the vendor tuning tables: ``name = "module:ATTRIBUTE"``, the attribute a
#: ``{kernel key: tuning.Rule}`` of overrides of :func:`default_table` (rlk-cuda's pyproject.toml
#: declares ``cuda = "rlk_cuda.tables:NVIDIA"``).
TABLES_GROUP = "rlk_triton.tables"

CLAIMS = frozenset(
    {"accuracy", "batch_invariance", "determinism", "tuning_invariance", "path_invariance"}
)


def _modules():
    mods = {}
    for name in sorted(set(OP_MODULES.values())):
        try:
            mods[name] = importlib.import_module(f"rlk_triton.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"rlk_triton.{name}":
                raise
    return mods


def default_table() -> dict[str, tuning.Rule]:
    """The portable table: every kernel's ``TUNING`` rules, as its module declares them.

    Under Triton's interpreter (CPU) a module's ``CPU_TUNING`` rules replace its GPU ones: they
    hold the same candidates (and sometimes more) but choose the widest tiles, since the
    interpreter's cost is per program and per op. Tuning never changes a bit, and the
    conformance kit runs every candidate, so this only changes the speed.
    """
    table: dict[str, tuning.Rule] = {}
    for mod in _modules().values():
        table.update(getattr(mod, "TUNING", {}))
    if INTERPRET:
        for mod in _modules().values():
            table.update(getattr(mod, "CPU_TUNING", {}))
    return table


def vendor_tables() -> dict[str, tuning.TuningTable]:
    """The override tables declared under :data:`TABLES_GROUP` by installed packages, by name.

    Found through their entry points, not through their backends: the rocm table must be
    checkable on an NVIDIA GPU or a CPU, where backend ``rocm`` is not available. A declared
    table that fails to load is an error (its configs would otherwise go unchecked).
    """
    tables = {}
    for ep in sorted(importlib.metadata.entry_points(group=TABLES_GROUP), key=lambda e: e.name):
        try:
            tables[ep.name] = ep.load()
        except Exception as e:
            raise RuntimeError(
                f"rlk_triton: the tuning table {ep.name!r} ({ep.value!r}, declared by "
                f"distribution {ep.dist.name if ep.dist else '?'!r}) failed to load: {e}"
            ) from e
    return tables


def known_tables() -> dict[str, dict[str, tuning.Rule]]:
    """The portable table and every installed vendor table (merged over it), by backend name."""
    base = default_table()
    tables = {"triton": base}
    for name, overrides in vendor_tables().items():
        tables[name] = tuning.merge(base, overrides)
    return tables


def all_op_configs(op: str) -> list[dict]:
    """Config sets covering every candidate of every installed table for ``op``.

    The conformance kit runs them all against one backend's default choice, so the tuning
    invariance check also proves that the cuda and rocm tables give identical bits, on whatever
    device the kit runs (the Triton interpreter on CPU included).
    """
    seen, out = set(), []
    for table in known_tables().values():
        for cfg in tuning.op_configs(table, op):
            key = repr(sorted((k, sorted(v.items())) for k, v in cfg.items()))
            if key not in seen:
                seen.add(key)
                out.append(cfg)
    return out


def _attention_forward(q, k, v, cu_q, cu_k, causal, scale, *, max_seqlen_q=None,
                       max_seqlen_k=None, table):  # fmt: skip
    from rlk_triton import attention_fwd as a

    bounds = None if max_seqlen_q is None else (int(max_seqlen_q), int(max_seqlen_k))
    q, k, v, cu_q, cu_k = (t.contiguous() for t in (q, k, v, cu_q, cu_k))
    o, lse = a._forward(
        q, k, v, cu_q, cu_k, None, None, causal, float(scale), "attention.fwd", table, True, bounds
    )
    return (o,), (lse,)


def _attention_backward(grads, outs, extras, needs, q, k, v, cu_q, cu_k, causal, scale, *,
                        max_seqlen_q=None, max_seqlen_k=None, table):  # fmt: skip
    from rlk_triton import attention_fwd as a
    from rlk_triton.attention_bwd import _backward

    q, k, v, cu_q, cu_k = (t.contiguous() for t in (q, k, v, cu_q, cu_k))
    if max_seqlen_q is None:  # the lengths from the offsets (a host read), as the forward did
        b = cu_q.numel() - 1
        bounds = (a._max_len(cu_q), a._lengths_fit(cu_k, b, k.shape[0], "cu_seqlens_k", "k"))
    else:
        bounds = (int(max_seqlen_q), int(max_seqlen_k))
    do = torch.zeros_like(q) if grads[0] is None else grads[0]
    return _backward(
        do, q, k, v, outs[0], extras[0], cu_q, cu_k, causal, float(scale), table, bounds
    )


#: Forward and backward as two calls of the ops whose modules do not declare them.
_AUTOGRAD = {"attention": (_attention_forward, _attention_backward)}


def make_impl(table: tuning.TuningTable) -> BackendImpl:
    """Every op found in rlk_triton, bound to ``table``; ops not written yet are left out."""
    mods = _modules()
    ops = {}
    for op, modname in OP_MODULES.items():
        fn = getattr(mods.get(modname), op, None)
        if fn is not None:
            ops[op] = functools.partial(fn, table=table)
    # The differentiable ops' forward and backward as two calls (a module's AUTOGRAD), for the
    # torch.compile path (rlk._library), bound to the same table.
    autograd = {
        op: OpAutograd(
            functools.partial(forward, table=table), functools.partial(backward, table=table)
        )
        for source in (*(getattr(mod, "AUTOGRAD", {}) for mod in mods.values()), _AUTOGRAD)
        for op, (forward, backward) in source.items()
        if op in ops
    }
    return BackendImpl(
        ops=ops,
        claims=CLAIMS,
        autograd=autograd,
        tuning_configs=all_op_configs,
        use_config=tuning.force,
    )


def make_vendor_impl(overrides: tuning.TuningTable) -> BackendImpl:
    """A vendor backend: these kernels with ``overrides`` merged over :func:`default_table`
    (what rlk-cuda and rlk-rocm load; they also declare ``overrides`` under
    :data:`TABLES_GROUP`)."""
    return make_impl(tuning.merge(default_table(), overrides))
