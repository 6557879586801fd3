"""Backend plugins: the hook, the records it returns, discovery and selection.

One hook, one job: ``rlk_backends()`` returns :class:`BackendSpec` records. A spec is cheap to
build and never imports heavy modules (triton, torch_npu); its ``load`` does, and only after the
backend has been chosen. Everything that can go wrong with plugins is reported here, in one
place, with an error that says what to do.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pluggy
import torch

log = logging.getLogger("rlk")

PROJECT = "rlk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The guarantees a backend may claim; the conformance kit checks exactly the claimed ones.
GUARANTEES: tuple[str, ...] = (
    "accuracy",
    "batch_invariance",
    "determinism",
    "tuning_invariance",
    "path_invariance",
)

#: Distributions that bring a backend, for the "pip install" hint of an unknown name.
EXTRAS = {"cuda": "rlk[cuda]", "rocm": "rlk[rocm]", "ascend": "rlk[ascend]", "triton": "rlk-triton"}


class BackendError(RuntimeError):
    """A backend cannot be found, loaded or used. The message says why and what to do."""


class _Spec:
    @staticmethod
    def rlk_backends() -> Sequence[BackendSpec]:  # pragma: no cover - signature only
        """Return the backends this plugin provides."""


_Spec.rlk_backends = hookspec(_Spec.rlk_backends)


@dataclass(frozen=True)
class OpAutograd:
    """An op's forward and backward as two calls, for the ``torch.compile`` path (``rlk._library``:
    its custom operator's autograd runs them, so the compiled backward runs the backend's own
    backward kernels on what its forward saved, as its eager ``autograd.Function`` does).

    ``forward(*args, **kwargs)`` takes the op's arguments as ``ops[op]`` does and returns
    ``(outputs, extras)``: the outputs as a tuple (those of ``ops[op]``, contiguous), and the
    tensors the backward needs besides the op's inputs and outputs, exactly as the op's
    catalog entry lists them (``rlk.ops.SPECS[op].operator.extras``: shapes, dtypes).
    ``backward(grads, outputs, extras, needs, *args, **kwargs)`` gets the outputs' gradients
    (None for an output without one), the outputs that the entry's ``saved_outputs`` names
    (None for the others), the extras, and one bool per differentiable argument
    (``rlk._library.GRADS``: the catalog's ``OpSpec.grad_args``, or the operator's ``grads``
    where it has them: apply_rotary's include cos and sin);
    it returns one gradient per differentiable argument, None where not needed.
    """

    forward: Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]
    backward: Callable[..., tuple[Any, ...]]


@dataclass(frozen=True)
class BackendImpl:
    """What a backend's loader returns: a callable for every op, and what it claims.

    ``ops`` holds every op of ``rlk.OPS`` and any of the optional ops (``OPTIONAL_OPS``) the
    backend claims. ``ops[name]`` is called with validated, normalised arguments in the order
    of the public function's signature (keyword-only arguments passed by keyword).
    ``delegated`` names ops the backend deliberately serves with another implementation, and
    says which (shown by ``rlk info``). ``tuning_configs(op)`` lists every config the backend
    may pick for ``op``; ``use_config(op, config)`` is a context manager forcing one, so the
    conformance kit can prove that tuning never changes bits. ``autograd`` gives, per
    differentiable op, its forward and backward as two calls (:class:`OpAutograd`), which the
    ``torch.compile`` path runs; an op without one is differentiated there by running it again
    under autograd in the backward (``rlk._library``).
    """

    ops: Mapping[str, Callable[..., Any]]
    claims: frozenset[str]
    delegated: Mapping[str, str] = field(default_factory=dict)
    autograd: Mapping[str, OpAutograd] = field(default_factory=dict)
    tuning_configs: Callable[[str], Sequence[Mapping[str, Any]]] | None = None
    use_config: Callable[[str, Mapping[str, Any]], contextlib.AbstractContextManager] | None = None

    def missing(self) -> list[str]:
        """The required ops (``rlk.OPS``) this implementation lacks."""
        from rlk.ops import OPS  # (rlk.ops imports this module: its families dispatch here)

        return [op for op in OPS if op not in self.ops]


@dataclass(frozen=True)
class BackendSpec:
    """A backend as a plugin declares it. Building one must be cheap and import nothing heavy.

    ``device_types`` are torch device types (``"cuda"``, ``"cpu"``, ``"npu"``) or ``"*"`` for any.
    ``is_available()`` returns ``(ok, reason)``; the reason is shown to users when not ok.
    ``load()`` imports the implementation and returns a :class:`BackendImpl`.
    """

    name: str
    priority: int
    device_types: tuple[str, ...]
    is_available: Callable[[], tuple[bool, str]]
    load: Callable[[], BackendImpl]
    description: str = ""
    distribution: str = "?"

    def serves(self, device_type: str) -> bool:
        return "*" in self.device_types or device_type in self.device_types


def _spec_problem(spec: BackendSpec) -> str | None:
    """What is wrong with the fields of a spec whose name is valid, or None."""
    p = spec.priority
    if isinstance(p, bool) or not isinstance(p, int):
        return f"its priority must be an int, got {p!r}"
    d = spec.device_types
    if not isinstance(d, tuple) or not d or not all(isinstance(t, str) and t for t in d):
        return f"its device_types must be a non-empty tuple of device type names, got {d!r}"
    for attr in ("is_available", "load"):
        if not callable(getattr(spec, attr)):
            return f"its {attr} must be callable, got {type(getattr(spec, attr)).__name__}"
    return None


@dataclass(frozen=True)
class Broken:
    """A backend, or a whole plugin, that misbehaved before it could be used, and why.

    ``name`` is the backend's name, or the plugin's (its entry point's name) when the plugin
    failed before declaring a valid backend. ``priority`` is None when it could not be read:
    ``auto`` then assumes the broken one might have been preferred on any device and refuses to
    choose (see :meth:`Registry.auto`).
    """

    name: str
    distribution: str
    reason: str
    priority: int | None = None
    device_types: tuple[str, ...] = ("*",)

    def serves(self, device_type: str) -> bool:
        return "*" in self.device_types or device_type in self.device_types


#: The float64 oracle. It claims accuracy only, so ``auto`` picks it only where no other
#: installed backend serves the device type.
ORACLE = "reference"


def _how_to_choose(names: Sequence[str]) -> str:
    return (
        "choose a backend explicitly with RLK_BACKEND=<name> or rlk.use_backend(<name>) "
        f"(installed: {', '.join(names) or 'none'})"
    )


class Registry:
    """The installed backends, discovered once through the ``rlk`` entry-point group.

    Plugins are contained: one whose entry point fails to import, whose hook raises or
    returns something other than valid :class:`BackendSpec` records, that declares a name
    another plugin declares too, or that declares the name of :data:`ORACLE`, is recorded in
    :attr:`broken` (shown by ``rlk info``, raised as a :class:`BackendError` naming it when
    selected) and every other backend keeps working.
    """

    def __init__(self, extra_plugins: Sequence[object] = ()):
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(_Spec)
        self._specs: dict[str, BackendSpec] = {}
        self._broken: dict[str, Broken] = {}  # backend names that cannot be used
        self._broken_plugins: list[Broken] = []  # plugins that declared nothing usable
        self._dists: dict[int, str] = {}
        from rlk import _builtin

        self._pm.register(_builtin, name="rlk")
        self._dists[id(_builtin)] = "rlk"
        self._load_entry_points()
        for p in extra_plugins:
            self._pm.register(p)
        for impl in self._pm.hook.rlk_backends.get_hookimpls():
            plugin = self._pm.get_name(impl.plugin) or "?"
            dist = self._dists.get(id(impl.plugin), plugin)
            try:
                declared = impl.function()
            except Exception as e:
                self._plugin_broken(plugin, dist, f"its rlk_backends() hook raised {_exc(e)}")
                continue
            if declared is None:
                continue
            if not isinstance(declared, (list, tuple)):
                what = type(declared).__name__
                self._plugin_broken(plugin, dist, f"rlk_backends() returned {what}, not a list")
                continue
            for spec in declared:
                self._declare(spec, plugin, dist)
        self._loaded: dict[str, BackendImpl] = {}
        self._lock = threading.Lock()

    def _load_entry_points(self) -> None:
        # pluggy's load_setuptools_entrypoints stops at the first plugin that fails to import;
        # here that plugin is reported and the others still load.
        import importlib.metadata as md

        for ep in md.entry_points(group=PROJECT):
            dist = ep.dist.name if ep.dist is not None else ep.name
            try:
                plugin = ep.load()
                self._pm.register(plugin, name=ep.name)
            except Exception as e:
                why = f"its entry point {ep.value!r} failed: {_exc(e)}"
                self._plugin_broken(ep.name, dist, why)
                continue
            self._dists[id(plugin)] = dist

    def _plugin_broken(self, plugin: str, dist: str, why: str) -> None:
        reason = f"plugin {plugin!r} (distribution {dist!r}) is broken: {why}"
        self._broken_plugins.append(Broken(plugin, dist, reason))

    def _declare(self, spec: object, plugin: str, dist: str) -> None:
        name = getattr(spec, "name", None)
        if not isinstance(spec, BackendSpec):
            why = f"it returned {type(spec).__name__}, not a BackendSpec"
        elif not isinstance(name, str) or not name.isidentifier():
            why = f"it declared an invalid backend name {name!r}"
        elif name == ORACLE and plugin != "rlk":
            # The oracle is what every other backend is checked against: a plugin may not
            # replace it, nor (by a clash of names) disable it.
            why = (
                f"it declares the backend name {ORACLE!r} (distribution {spec.distribution!r}), "
                "which is rlk's float64 oracle"
            )
        else:
            why = None
        if why:
            self._plugin_broken(plugin, dist, why)
            return
        if spec.distribution == "?":
            spec = _replace(spec, distribution=dist)
        problem = _spec_problem(spec)
        if problem:
            why = f"rlk backend {name!r} (distribution {spec.distribution!r}) is broken: {problem}"
            self._broken.setdefault(name, Broken(name, spec.distribution, why))
            self._specs.pop(name, None)
        elif name in self._specs:
            # Two plugins with one name: neither is used, since rlk cannot tell which is meant.
            other = self._specs.pop(name)
            self._broken[name] = Broken(
                name,
                f"{other.distribution}, {spec.distribution}",
                f"two plugins declare the backend {name!r}: distribution {other.distribution!r} "
                f"and distribution {spec.distribution!r}. Uninstall one of them.",
                max(other.priority, spec.priority),
                other.device_types + spec.device_types,
            )
        elif name not in self._broken:  # (a third plugin declaring an ambiguous name)
            self._specs[name] = spec

    @property
    def specs(self) -> dict[str, BackendSpec]:
        """The usable backends' specs, highest priority first."""
        return dict(sorted(self._specs.items(), key=lambda kv: (-kv[1].priority, kv[0])))

    @property
    def broken(self) -> list[Broken]:
        """Backends and plugins that cannot be used, and why (``rlk info`` lists them)."""
        return [*self._broken.values(), *self._broken_plugins]

    def spec(self, name: str) -> BackendSpec:
        if name in self._specs:
            return self._specs[name]
        broken = self._broken.get(name) or next(
            (b for b in self._broken_plugins if b.name == name), None
        )
        if broken is not None:
            raise BackendError(broken.reason)
        installed = ", ".join(self.specs) or "none"
        hint = EXTRAS.get(name)
        how = (
            f' Install it with: pip install "{hint}".'
            if hint
            else ' Vendor backends come with pip install "rlk[cuda]", "rlk[rocm]" or '
            "\"rlk[ascend]\"; any package registering an 'rlk' entry point adds one."
        )
        raise BackendError(f"unknown rlk backend {name!r}. Installed backends: {installed}.{how}")

    def status(self, name: str) -> tuple[bool, str]:
        """``is_available()`` of backend ``name``; a check that raises or returns anything but
        ``(bool, str)`` is a :class:`BackendError` naming the backend."""
        spec = self.spec(name)
        broken = f"rlk backend {name!r} (distribution {spec.distribution!r}) is broken: its"
        try:
            result = spec.is_available()
        except Exception as e:
            raise BackendError(f"{broken} is_available() raised {_exc(e)}") from e
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[0], bool)
            and isinstance(result[1], str)
        ):
            raise BackendError(f"{broken} is_available() returned {result!r}, not (bool, str)")
        return result

    def load(self, name: str, *, complete: bool = True) -> BackendImpl:
        """Load backend ``name``. With ``complete``, a backend missing any op is an error."""
        spec = self.spec(name)
        ok, reason = self.status(name)
        if not ok:
            raise BackendError(f"rlk backend {name!r} is installed but not available: {reason}")
        with self._lock:
            impl = self._loaded.get(name)
            if impl is None:
                try:
                    impl = spec.load()
                except Exception as e:  # a broken vendor stack is a reason, never a crash
                    raise BackendError(f"rlk backend {name!r} failed to load: {e}") from e
                if not isinstance(impl, BackendImpl):
                    raise BackendError(f"backend {name!r} loader returned {type(impl).__name__}")
                if not isinstance(impl.ops, Mapping):
                    what = type(impl.ops).__name__
                    raise BackendError(f"backend {name!r} loader returned ops as a {what}")
                from rlk.ops import SPECS

                unknown = set(impl.ops) - set(SPECS)
                if unknown:
                    raise BackendError(f"backend {name!r} provides unknown ops {sorted(unknown)}")
                bad = [op for op, fn in impl.ops.items() if not callable(fn)]
                if bad:
                    raise BackendError(f"backend {name!r} serves {', '.join(bad)} with no callable")
                bad = [
                    op
                    for op, pair in impl.autograd.items()
                    if op not in impl.ops or not isinstance(pair, OpAutograd)
                ]
                if bad:
                    raise BackendError(
                        f"backend {name!r} gives autograd for {', '.join(map(str, bad))}: each "
                        "entry must be an OpAutograd of an op it serves"
                    )
                if spec.distribution not in _OWN:
                    impl = _checked_results(impl, name, spec.distribution)
                self._loaded[name] = impl
        if complete and impl.missing():
            raise BackendError(
                f"rlk backend {name!r} does not implement {', '.join(impl.missing())}; "
                "it cannot be selected until it serves every op (rlk never falls back to "
                "another backend, since that would break bitwise agreement)."
            )
        return impl

    def auto(self, device_type: str) -> str:
        """The backend ``auto`` selects for ``device_type`` tensors.

        The highest-priority backend serving the device type that is available here and
        implements every op. Backends unavailable on this machine (``is_available`` says why)
        and incomplete ones are passed over. Anything else that fails (a loader, a check, a
        broken plugin) stops the selection with a :class:`BackendError`: moving on to the next
        backend would silently swap the kernels, and so the bits. :data:`ORACLE` (the float64
        reference, which claims accuracy only) is picked only for device types that no other
        installed backend serves.
        """
        candidates: list[tuple[float, str, Broken | None]] = [
            (spec.priority, name, None)
            for name, spec in self._specs.items()
            if name != ORACLE and spec.serves(device_type)
        ]
        candidates += [
            (math.inf if b.priority is None else b.priority, b.name, b)
            for b in self.broken
            if b.serves(device_type)
        ]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        reasons = []
        for _, name, broken in candidates:
            try:
                if broken is not None:
                    raise BackendError(broken.reason)
                ok, reason = self.status(name)
                if ok:
                    missing = self.load(name, complete=False).missing()
            except BackendError as e:
                raise BackendError(
                    f"auto cannot choose a backend for {device_type!r} tensors: "
                    f"{str(e).rstrip('.')}. auto never moves past a backend that failed (the "
                    "next one would silently change the kernels, and the bits): fix it, or "
                    f"{_how_to_choose(list(self.specs))}."
                ) from e
            if not ok:
                reasons.append(f"{name}: {reason}")
            elif missing:  # rlk never mixes the kernels of two backends
                reasons.append(f"{name}: does not implement {', '.join(missing)}")
            else:
                return name
        if not candidates and ORACLE in self._specs:
            return ORACLE
        raise BackendError(
            f"no available rlk backend serves {device_type!r} tensors"
            + (f" ({'; '.join(reasons)})" if reasons else "")
            + (
                f". The float64 {ORACLE!r} backend is not picked automatically for a device "
                "type another installed backend serves"
                if candidates and ORACLE in self._specs
                else ""
            )
            + f"; {_how_to_choose(list(self.specs))}."
        )


#: rlk's own distributions; their ops' results are tested by rlk's suite, not at every call.
_OWN = frozenset({"rlk-reference", "rlk-triton", "rlk-cuda", "rlk-rocm", "rlk-ascend"})


def _is_result(out: object) -> bool:
    """What an op may return: a tensor, or a tuple of tensors, ``None`` and dicts (metrics)."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, tuple) and all(
        o is None or isinstance(o, (torch.Tensor, dict)) for o in out
    )


def _checked_results(impl: BackendImpl, name: str, dist: str) -> BackendImpl:
    """``impl`` whose ops raise a ``TypeError`` naming the backend and the op when they return
    something that is not an op's result (rlk would otherwise fail later, somewhere obscure)."""

    def check(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if not _is_result(out):
                raise TypeError(
                    f"rlk backend {name!r} (distribution {dist!r}): its op {op!r} returned "
                    f"{type(out).__name__}, not a tensor or a tuple of tensors"
                )
            return out

        return checked

    return replace(impl, ops={op: check(op, fn) for op, fn in impl.ops.items()})


def _exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _replace(spec: BackendSpec, **kw: Any) -> BackendSpec:
    from dataclasses import replace

    return replace(spec, **kw)


_registry: Registry | None = None
_registry_lock = threading.Lock()
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlk_backend", default=None)
_announced: set[tuple[str, str]] = set()


def registry() -> Registry:
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def reset_registry(extra_plugins: Sequence[object] = ()) -> Registry:
    """Rediscover plugins (tests register extra ones here). Returns the new registry."""
    global _registry
    with _registry_lock:
        _registry = Registry(extra_plugins)
        _announced.clear()
        _resolved.clear()
        return _registry


def _requested() -> str:
    name = _override.get()
    if name is None:
        name = os.environ.get("RLK_BACKEND", "auto")
    return name.strip() or "auto"


def current_backend(device: Any = None) -> str:
    """Name of the backend that serves ``device`` now (default: cuda if present, else cpu).

    Honours ``rlk.use_backend`` and ``RLK_BACKEND``; ``auto`` picks the highest-priority
    available backend for the device type (:meth:`Registry.auto`: never past one that failed,
    and the reference only where no other backend serves the device). Raises
    :class:`BackendError` with the reason when the requested backend is unknown, unavailable,
    broken, or does not serve that device, or when ``auto`` cannot choose.
    """
    device_type = _device_type(device)
    reg = registry()
    name = _requested()
    if name == "auto":
        name = reg.auto(device_type)
        if (name, device_type) not in _announced:
            _announced.add((name, device_type))
            log.info("rlk: backend %r selected for %s tensors", name, device_type)
        return name
    spec = reg.spec(name)
    ok, reason = reg.status(name)
    if not ok:
        raise BackendError(f"rlk backend {name!r} is installed but not available: {reason}")
    if not spec.serves(device_type):
        raise BackendError(
            f"rlk backend {name!r} does not serve {device_type!r} tensors "
            f"(it serves {', '.join(spec.device_types)})"
        )
    return name


def _device_type(device: Any) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


#: (requested backend, device type) -> the implementation it resolved to, for the current
#: registry. Every op call asks, and walking the plugins (availability checks, ``auto``'s
#: priority order) costs tens of microseconds, more than a decode-size kernel runs. Once a
#: selection has succeeded it stands for the process: the registry is fixed, and a backend that
#: was available stays so. ``reset_registry`` clears it; failures are never cached.
_resolved: dict[tuple[str, str], BackendImpl] = {}


#: ``torch.compiler.is_compiling`` (a name of this module's, which tests can replace).
_compiling = torch.compiler.is_compiling


def backend_impl(device: Any) -> BackendImpl:
    """The complete implementation serving ``device`` (used by every public op).

    While ``torch.compile`` traces, the ops of the catalog are ``torch.ops.rlk``'s operators
    (``rlk._library``), which pick the backend when they run: nothing of a backend is traced
    into the graph, and a backend chosen after compiling serves the next call."""
    if _compiling():
        from rlk._library import traced_impl

        return traced_impl(device)
    return resolved_impl(device)


def resolved_impl(device: Any) -> BackendImpl:
    """The backend implementation selected now for ``device`` (:func:`backend_impl` outside
    ``torch.compile``)."""
    device_type = getattr(device, "type", None) or _device_type(device)
    key = (_requested(), device_type)
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
    device_type = getattr(device, "type", None) or _device_type(device)
    have = claimants(op, device_type)
    raise BackendError(
        f"{caller}: rlk backend {current_backend(device)!r} does not implement the optional op "
        f"{op!r} (rlk does not fall back to another backend's kernel, since that would break "
        f"bitwise agreement). Backends here that implement it for {device_type!r} tensors: "
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
