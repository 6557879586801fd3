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
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

log = logging.getLogger("rlk")

PROJECT = "rlk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Every op a backend must serve. A backend missing one cannot be selected.
OPS: tuple[str, ...] = (
    "linear",
    "rms_norm",
    "silu_and_mul",
    "apply_rotary",
    "attention",
    "paged_attention",
    "logprobs",
    "linear_logprobs",
    "policy_loss",
    "kl_penalty",
    "grpo_advantages",
    "sample",
)

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
class BackendImpl:
    """What a backend's loader returns: a callable for every op, and what it claims.

    ``ops[name]`` is called with validated, normalised arguments in the order of the public
    function's signature (keyword-only arguments passed by keyword). ``delegated`` names ops the
    backend deliberately serves with another implementation, and says which (shown by
    ``rlk info``). ``tuning_configs(op)`` lists every config the backend may pick for ``op``;
    ``use_config(op, config)`` is a context manager forcing one, so the conformance kit can
    prove that tuning never changes bits.
    """

    ops: Mapping[str, Callable[..., Any]]
    claims: frozenset[str]
    delegated: Mapping[str, str] = field(default_factory=dict)
    tuning_configs: Callable[[str], Sequence[Mapping[str, Any]]] | None = None
    use_config: Callable[[str, Mapping[str, Any]], contextlib.AbstractContextManager] | None = None

    def missing(self) -> list[str]:
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


def _validate_spec(spec: object, plugin: str) -> BackendSpec:
    if not isinstance(spec, BackendSpec):
        raise BackendError(f"plugin {plugin!r} returned {type(spec).__name__}, not a BackendSpec")
    if not spec.name or not spec.name.isidentifier():
        raise BackendError(f"plugin {plugin!r} declared an invalid backend name {spec.name!r}")
    return spec


class Registry:
    """The installed backends, discovered once through the ``rlk`` entry-point group."""

    def __init__(self, extra_plugins: Sequence[object] = ()):
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(_Spec)
        from rlk import _builtin

        self._pm.register(_builtin, name="rlk")
        self._pm.load_setuptools_entrypoints(PROJECT)
        for p in extra_plugins:
            self._pm.register(p)
        self._specs: dict[str, BackendSpec] = {}
        dists = {
            id(plugin): getattr(dist, "project_name", None) or dist.metadata["name"]
            for plugin, dist in self._pm.list_plugin_distinfo()
        }
        for impl in self._pm.hook.rlk_backends.get_hookimpls():
            plugin_name = self._pm.get_name(impl.plugin) or "?"
            dist = dists.get(id(impl.plugin), plugin_name)
            for spec in impl.function() or ():
                spec = _validate_spec(spec, plugin_name)
                if spec.distribution == "?":
                    spec = _replace(spec, distribution=dist)
                if spec.name in self._specs:
                    other = self._specs[spec.name]
                    raise BackendError(
                        f"two plugins declare the backend {spec.name!r}: distribution "
                        f"{other.distribution!r} and distribution {spec.distribution!r}. "
                        "Uninstall one of them."
                    )
                self._specs[spec.name] = spec
        self._loaded: dict[str, BackendImpl] = {}
        self._lock = threading.Lock()

    @property
    def specs(self) -> dict[str, BackendSpec]:
        return dict(sorted(self._specs.items(), key=lambda kv: (-kv[1].priority, kv[0])))

    def spec(self, name: str) -> BackendSpec:
        if name not in self._specs:
            installed = ", ".join(self.specs) or "none"
            hint = EXTRAS.get(name)
            how = (
                f' Install it with: pip install "{hint}".'
                if hint
                else ' Vendor backends come with pip install "rlk[cuda]", "rlk[rocm]" or '
                "\"rlk[ascend]\"; any package registering an 'rlk' entry point adds one."
            )
            raise BackendError(
                f"unknown rlk backend {name!r}. Installed backends: {installed}.{how}"
            )
        return self._specs[name]

    def load(self, name: str, *, complete: bool = True) -> BackendImpl:
        """Load backend ``name``. With ``complete``, a backend missing any op is an error."""
        spec = self.spec(name)
        ok, reason = spec.is_available()
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
                unknown = set(impl.ops) - set(OPS)
                if unknown:
                    raise BackendError(f"backend {name!r} provides unknown ops {sorted(unknown)}")
                self._loaded[name] = impl
        if complete and impl.missing():
            raise BackendError(
                f"rlk backend {name!r} does not implement {', '.join(impl.missing())}; "
                "it cannot be selected until it serves every op (rlk never falls back to "
                "another backend, since that would break bitwise agreement)."
            )
        return impl

    def auto(self, device_type: str) -> str:
        """The highest-priority available backend serving ``device_type``."""
        reasons = []
        for name, spec in self.specs.items():
            if not spec.serves(device_type):
                continue
            ok, reason = spec.is_available()
            if ok:
                # A backend that does not serve every op is never picked: rlk does not mix
                # kernels of two backends, so it would fail at its first missing op.
                try:
                    missing = self.load(name, complete=False).missing()
                except BackendError as e:
                    missing, reason = None, str(e)
                if missing == []:
                    return name
                if missing:
                    reason = f"does not implement {', '.join(missing)}"
            reasons.append(f"{name}: {reason}")
        raise BackendError(
            f"no available rlk backend serves device type {device_type!r}"
            + (f" ({'; '.join(reasons)})" if reasons else "")
        )


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
        return _registry


def _requested() -> str:
    name = _override.get()
    if name is None:
        name = os.environ.get("RLK_BACKEND", "auto").strip() or "auto"
    return name


def current_backend(device: Any = None) -> str:
    """Name of the backend that serves ``device`` now (default: cuda if present, else cpu).

    Honours ``rlk.use_backend`` and ``RLK_BACKEND``; ``auto`` picks the highest-priority
    available backend for the device type. Raises :class:`BackendError` with the reason when the
    requested backend is unknown, unavailable, or does not serve that device.
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
    ok, reason = spec.is_available()
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


def backend_impl(device: Any) -> BackendImpl:
    """The complete implementation serving ``device`` (used by every public op)."""
    return registry().load(current_backend(device))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Use backend ``name`` (or ``"auto"``) inside the block, for this thread/task only.

    The name is checked on entry, so a typo fails here and not at the first op::

        with rlk.use_backend("reference"):
            y = rlk.rms_norm(x, w)
    """
    if not isinstance(name, str):
        raise TypeError(f"use_backend: name must be a str, got {type(name).__name__}")
    if name != "auto":
        registry().load(name)
    token = _override.set(name)
    try:
        yield name
    finally:
        _override.reset(token)
