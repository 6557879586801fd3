"""The backend plugin interface: what a backend declares, what it loads, and how rlk finds it.

A backend is a distribution with an entry point in the ``rlk`` group naming a module (or object)
that implements the one hook, ``rlk_backends()``, marked with :data:`hookimpl`. The hook returns
:class:`BackendSpec` records: cheap to build, importing nothing heavy (triton, torch_npu). A
spec's ``load()`` does the imports, only once the backend is chosen, and returns a
:class:`BackendImpl`: a callable per op, and the guarantees it claims (:data:`GUARANTEES`).

The :class:`Registry` discovers the plugins and contains them: everything that can go wrong with
one (an entry point that fails to import, a hook that raises or returns garbage, two backends
of one name, a loader that fails) is reported here, naming it, and the others keep working.
Which backend serves a tensor is :mod:`rlk.selection`'s job.

Example (a backend serving CUDA tensors; ``pyproject.toml``:
``[project.entry-points.rlk] mine = "my_backend.plugin"``)::

    from rlk.plugins import BackendImpl, BackendSpec, hookimpl

    def _load() -> BackendImpl:
        from my_backend import kernels  # heavy imports here, not at declaration

        return BackendImpl(ops=kernels.OPS, claims=frozenset({"accuracy", "determinism"}))

    @hookimpl
    def rlk_backends():
        return [BackendSpec("mine", 50, ("cuda",), lambda: (True, ""), _load)]
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pluggy
import torch

from rlk._catalog import DECLARED, declared

__all__ = [
    "GUARANTEES",
    "ORACLE",
    "BackendError",
    "BackendImpl",
    "BackendSpec",
    "Broken",
    "OpAutograd",
    "Registry",
    "hookimpl",
]

#: The pluggy project name, which is also the entry-point group of backend plugins.
PROJECT = "rlk"
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a plugin's ``rlk_backends`` function as the implementation of the hook.
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

#: The float64 oracle (rlk's own plugin, from rlk-reference). No other plugin may declare it.
ORACLE = "reference"


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
        """The required ops (``rlk.OPS``, in its order) this implementation lacks."""
        return [s.name for s in declared() if not s.optional and s.name not in self.ops]


@dataclass(frozen=True)
class BackendSpec:
    """A backend as a plugin declares it. Building one must be cheap and import nothing heavy.

    ``name`` is an identifier (``RLK_BACKEND=<name>``). ``priority``: ``auto`` prefers the
    highest. ``device_types`` are torch device types (``"cuda"``, ``"cpu"``, ``"npu"``) or
    ``"*"`` for any. ``is_available()`` returns ``(ok, reason)``; the reason is shown to users
    when not ok. ``load()`` imports the implementation and returns a :class:`BackendImpl`.
    ``distribution`` defaults to the plugin's entry point's distribution.
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
    choose (see :func:`rlk.selection.auto`).
    """

    name: str
    distribution: str
    reason: str
    priority: int | None = None
    device_types: tuple[str, ...] = ("*",)

    def serves(self, device_type: str) -> bool:
        return "*" in self.device_types or device_type in self.device_types


class Registry:
    """The installed backends, discovered once through the ``rlk`` entry-point group.

    ``own`` is rlk's own plugin (the float64 :data:`ORACLE`), registered first under the name
    ``"rlk"``; ``extra_plugins`` (tests) are registered after the entry points.

    Plugins are contained: one whose entry point fails to import, whose hook raises or
    returns something other than valid :class:`BackendSpec` records, that declares a name
    another plugin declares too, or that declares the name of :data:`ORACLE`, is recorded in
    :attr:`broken` (shown by ``rlk info``, raised as a :class:`BackendError` naming it when
    selected) and every other backend keeps working.
    """

    def __init__(self, extra_plugins: Sequence[object] = (), *, own: object | None = None):
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(_Spec)
        self._specs: dict[str, BackendSpec] = {}
        self._broken: dict[str, Broken] = {}  # backend names that cannot be used
        self._broken_plugins: list[Broken] = []  # plugins that declared nothing usable
        self._dists: dict[int, str] = {}
        if own is not None:
            self._pm.register(own, name="rlk")
            self._dists[id(own)] = "rlk"
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
            spec = replace(spec, distribution=dist)
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
        """The spec of backend ``name``; a :class:`BackendError` saying why where it is broken
        or unknown (with the install that brings a known one)."""
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
        """Load backend ``name`` (once). With ``complete``, a backend missing any op is an
        error."""
        spec = self.spec(name)
        ok, reason = self.status(name)
        if not ok:
            raise BackendError(f"rlk backend {name!r} is installed but not available: {reason}")
        with self._lock:
            impl = self._loaded.get(name)
            if impl is None:
                impl = _checked_load(spec)
                self._loaded[name] = impl
        if complete and impl.missing():
            raise BackendError(
                f"rlk backend {name!r} does not implement {', '.join(impl.missing())}; "
                "it cannot be selected until it serves every op (rlk never falls back to "
                "another backend, since that would break bitwise agreement)."
            )
        return impl


def _checked_load(spec: BackendSpec) -> BackendImpl:
    """``spec.load()``, with everything wrong about what it returns a :class:`BackendError`."""
    name = spec.name
    try:
        impl = spec.load()
    except Exception as e:  # a broken vendor stack is a reason, never a crash
        raise BackendError(f"rlk backend {name!r} failed to load: {e}") from e
    if not isinstance(impl, BackendImpl):
        raise BackendError(f"backend {name!r} loader returned {type(impl).__name__}")
    if not isinstance(impl.ops, Mapping):
        raise BackendError(f"backend {name!r} loader returned ops as a {type(impl.ops).__name__}")
    unknown = set(impl.ops) - set(DECLARED)
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
    return impl


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
