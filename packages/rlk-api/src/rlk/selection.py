"""Backend selection: which installed backend serves a tensor's device, and its implementation.

The request is ``rlk.use_backend(name)`` inside a block, else the environment variable
``RLK_BACKEND``, else ``auto``. ``auto`` picks, per device type, the highest-priority backend
that is available there and implements every op (:func:`auto`), never moving past one that
failed. Every public op asks :func:`backend_impl` for the implementation serving its tensors'
device; a selection that succeeded is remembered for the process (:func:`reset_registry`
forgets it).

The backends themselves are found by :class:`rlk.plugins.Registry`; this module holds the one
registry of the process (:func:`registry`, with rlk's own plugin, the float64 oracle).

Example::

    import rlk
    from rlk import selection

    selection.current_backend("cpu")        # "triton" where rlk-triton is installed
    with rlk.use_backend("reference"):
        selection.backend_impl(x.device)    # the float64 oracle's BackendImpl
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rlk import _builtin
from rlk.plugins import ORACLE, BackendError, BackendImpl, Broken, Registry

__all__ = [
    "auto",
    "backend_impl",
    "claimants",
    "current_backend",
    "device_type",
    "optional_op",
    "registry",
    "requested",
    "reset_registry",
    "resolved_impl",
    "use_backend",
]

log = logging.getLogger("rlk")

_registry: Registry | None = None
_registry_lock = threading.Lock()
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlk_backend", default=None)
_announced: set[tuple[str, str]] = set()


def registry() -> Registry:
    """The process's registry of installed backends (discovered at the first call)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = Registry(own=_builtin)
        return _registry


def reset_registry(extra_plugins: Sequence[object] = ()) -> Registry:
    """Rediscover plugins (tests register extra ones here) and forget every selection. Returns
    the new registry."""
    global _registry
    with _registry_lock:
        _registry = Registry(extra_plugins, own=_builtin)
        _announced.clear()
        _resolved.clear()
        return _registry


def requested() -> str:
    """The backend asked for now: ``use_backend``'s, else ``RLK_BACKEND``, else ``"auto"``."""
    name = _override.get()
    if name is None:
        name = os.environ.get("RLK_BACKEND", "auto")
    return name.strip() or "auto"


def device_type(device: Any = None) -> str:
    """``device``'s torch device type; for None, ``"cuda"`` if a GPU is present, else ``"cpu"``."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _how_to_choose(names: Sequence[str]) -> str:
    return (
        "choose a backend explicitly with RLK_BACKEND=<name> or rlk.use_backend(<name>) "
        f"(installed: {', '.join(names) or 'none'})"
    )


def auto(reg: Registry, device_type: str) -> str:
    """The backend ``auto`` selects for ``device_type`` tensors among ``reg``'s.

    The highest-priority backend serving the device type that is available here and
    implements every op. Backends unavailable on this machine (``is_available`` says why)
    and incomplete ones are passed over. Anything else that fails (a loader, a check, a
    broken plugin) stops the selection with a :class:`BackendError`: moving on to the next
    backend would silently swap the kernels, and so the bits. :data:`rlk.plugins.ORACLE` (the
    float64 reference, which claims accuracy only) is picked only for device types that no
    other installed backend serves.
    """
    candidates: list[tuple[float, str, Broken | None]] = [
        (spec.priority, name, None)
        for name, spec in reg.specs.items()
        if name != ORACLE and spec.serves(device_type)
    ]
    candidates += [
        (math.inf if b.priority is None else b.priority, b.name, b)
        for b in reg.broken
        if b.serves(device_type)
    ]
    candidates.sort(key=lambda c: (-c[0], c[1]))
    reasons = []
    for _, name, broken in candidates:
        try:
            if broken is not None:
                raise BackendError(broken.reason)
            ok, reason = reg.status(name)
            if ok:
                missing = reg.load(name, complete=False).missing()
        except BackendError as e:
            raise BackendError(
                f"auto cannot choose a backend for {device_type!r} tensors: "
                f"{str(e).rstrip('.')}. auto never moves past a backend that failed (the "
                "next one would silently change the kernels, and the bits): fix it, or "
                f"{_how_to_choose(list(reg.specs))}."
            ) from e
        if not ok:
            reasons.append(f"{name}: {reason}")
        elif missing:  # rlk never mixes the kernels of two backends
            reasons.append(f"{name}: does not implement {', '.join(missing)}")
        else:
            return name
    oracle = ORACLE in reg.specs
    if not candidates and oracle:
        return ORACLE
    raise BackendError(
        f"no available rlk backend serves {device_type!r} tensors"
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + (
            f". The float64 {ORACLE!r} backend is not picked automatically for a device "
            "type another installed backend serves"
            if candidates and oracle
            else ""
        )
        + f"; {_how_to_choose(list(reg.specs))}."
    )


def current_backend(device: Any = None) -> str:
    """Name of the backend that serves ``device`` now (default: cuda if present, else cpu).

    Honours ``rlk.use_backend`` and ``RLK_BACKEND``; ``auto`` picks the highest-priority
    available backend for the device type (:func:`auto`: never past one that failed, and the
    reference only where no other backend serves the device). Raises :class:`BackendError`
    with the reason when the requested backend is unknown, unavailable, broken, or does not
    serve that device, or when ``auto`` cannot choose.
    """
    kind = device_type(device)
    reg = registry()
    name = requested()
    if name == "auto":
        name = auto(reg, kind)
        if (name, kind) not in _announced:
            _announced.add((name, kind))
            log.info("rlk: backend %r selected for %s tensors", name, kind)
        return name
    spec = reg.spec(name)
    ok, reason = reg.status(name)
    if not ok:
        raise BackendError(f"rlk backend {name!r} is installed but not available: {reason}")
    if not spec.serves(kind):
        raise BackendError(
            f"rlk backend {name!r} does not serve {kind!r} tensors "
            f"(it serves {', '.join(spec.device_types)})"
        )
    return name


#: (requested backend, device type) -> the implementation it resolved to, for the current
#: registry. Every op call asks, and walking the plugins (availability checks, ``auto``'s
#: priority order) costs tens of microseconds, more than a decode-size kernel runs. Once a
#: selection has succeeded it stands for the process: the registry is fixed, and a backend that
#: was available stays so. ``reset_registry`` clears it; failures are never cached.
_resolved: dict[tuple[str, str], BackendImpl] = {}


#: ``torch.compiler.is_compiling`` (a name of this module's, which tests can replace).
_compiling = torch.compiler.is_compiling

#: What :func:`backend_impl` returns while ``torch.compile`` traces: the ops as ``torch.ops.rlk``'s
#: operators. ``rlk._library`` sets it when it defines them (``rlk`` imports it with the ops),
#: since it sits above the ops whose catalog it is built from.
_traced_impl: Callable[[Any], BackendImpl] | None = None


def _serve_traced(fn: Callable[[Any], BackendImpl]) -> None:
    """Make ``fn(device)`` the implementation :func:`backend_impl` returns while tracing."""
    global _traced_impl
    _traced_impl = fn


def backend_impl(device: Any) -> BackendImpl:
    """The complete implementation serving ``device`` (used by every public op).

    While ``torch.compile`` traces, the ops of the catalog are ``torch.ops.rlk``'s operators
    (``rlk._library``), which pick the backend when they run: nothing of a backend is traced
    into the graph, and a backend chosen after compiling serves the next call."""
    if _compiling():
        if _traced_impl is None:  # (only while rlk itself is being imported)
            raise RuntimeError("rlk's torch.library operators are not defined yet")
        return _traced_impl(device)
    return resolved_impl(device)


def resolved_impl(device: Any) -> BackendImpl:
    """The backend implementation selected now for ``device`` (:func:`backend_impl` outside
    ``torch.compile``)."""
    kind = getattr(device, "type", None) or device_type(device)
    key = (requested(), kind)
    impl = _resolved.get(key)
    if impl is None:
        impl = registry().load(current_backend(device))
        _resolved[key] = impl
    return impl


def claimants(op: str, device_type: str) -> list[str]:
    """The installed backends available for ``device_type`` tensors that implement ``op``.

    Loads every such backend (for error messages and ``rlk.parallel.TREE_BACKENDS``, not for
    dispatch); one that fails to load is left out, as ``rlk info`` reports it.
    """
    reg = registry()
    names = []
    for name, spec in reg.specs.items():
        try:
            ok = spec.serves(device_type) and reg.status(name)[0]
            if ok and op in reg.load(name, complete=False).ops:
                names.append(name)
        except BackendError:
            continue
    return names


def optional_op(device: Any, op: str, caller: str) -> Callable[..., Any]:
    """The selected backend's implementation of the optional op ``op`` for ``device``.

    Raises :class:`BackendError` naming the backend, the op and ``caller`` (the public function
    that needs it) where the backend does not implement it: rlk never runs another backend's
    kernel in its place, which would change the bits.
    """
    fn = backend_impl(device).ops.get(op)
    if fn is not None:
        return fn
    kind = getattr(device, "type", None) or device_type(device)
    have = claimants(op, kind)
    raise BackendError(
        f"{caller}: rlk backend {current_backend(device)!r} does not implement the optional op "
        f"{op!r} (rlk does not fall back to another backend's kernel, since that would break "
        f"bitwise agreement). Backends here that implement it for {kind!r} tensors: "
        f"{', '.join(have) or 'none'}; choose one with RLK_BACKEND=<name> or "
        "rlk.use_backend(<name>)."
    )


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Use backend ``name`` (or ``"auto"``; ``""`` means auto, as in ``RLK_BACKEND``) inside the
    block, for this thread/task only.

    The name is checked on entry, so a typo fails here and not at the first op::

        with rlk.use_backend("reference"):
            y = rlk.rms_norm(x, w)
    """
    if not isinstance(name, str):
        raise TypeError(f"use_backend: name must be a str, got {type(name).__name__}")
    name = name.strip() or "auto"  # as RLK_BACKEND: an empty name means auto
    if name != "auto":
        registry().load(name)
    token = _override.set(name)
    try:
        yield name
    finally:
        _override.reset(token)
