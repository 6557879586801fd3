"""Tuning tables: which launch config each kernel uses for a shape.

A table maps a kernel key (``"rms_norm.fwd"``) to a :class:`Rule`: the candidate configs and a
chooser that picks one by shape. Backends differ only by their tables (NVIDIA, AMD, generic);
the numerics contract says no config may change a bit, and the conformance kit runs every
candidate to prove it. Configs hold launch parameters only (block sizes, warps, stages); the
reduction order is fixed by constants of the kernel, never by a config. A rule may say which
candidates a shape can launch at all (:attr:`Rule.fits`: a tile whose live registers grow with
the shape); its chooser returns only those, and a forced one that does not fit is not launched.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

Config = Mapping[str, Any]


def _first(**shape: int) -> int:
    return 0


def _always(config: Config, **shape: int) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """Candidate configs of one kernel, a chooser returning an index into them for a shape,
    and ``fits(config, **shape)``: whether ``config`` can launch at that shape (default:
    always). The chooser must return a config that fits (:func:`config` checks)."""

    configs: tuple[Config, ...]
    choose: Callable[..., int] = _first
    fits: Callable[..., bool] = _always


TuningTable = Mapping[str, Rule]


def preferring(rule: Rule, config: Config) -> Rule:
    """``rule``'s candidates plus ``config``, always choosing ``config``: a table that wants one
    extra launch config (the CPU tables' widest tiles) while every candidate stays checked."""
    configs = (*rule.configs, config)
    last = len(configs) - 1
    return Rule(configs=configs, choose=lambda **_: last, fits=rule.fits)


_forced: contextvars.ContextVar[Mapping[str, Config] | None] = contextvars.ContextVar(
    "rlk_triton_forced", default=None
)


def merge(base: TuningTable, overrides: TuningTable) -> dict[str, Rule]:
    unknown = set(overrides) - set(base)
    if unknown:
        raise KeyError(f"tuning overrides for unknown kernels: {sorted(unknown)}")
    return {**base, **overrides}


def config(table: TuningTable, key: str, **shape: int) -> Config:
    """The config kernel ``key`` runs with for ``shape``: a forced one that fits the shape
    (:attr:`Rule.fits`), else the rule's choice. A forced config that does not fit (one the
    chooser would never give this shape: the GPU could not compile it) yields to the choice,
    which by the contract has the same bits."""
    rule = table[key]
    forced = (_forced.get() or {}).get(key)
    if forced is not None and rule.fits(forced, **shape):
        return forced
    chosen = rule.configs[rule.choose(**shape)]
    if not rule.fits(chosen, **shape):
        raise RuntimeError(f"tuning rule {key!r} chose {dict(chosen)}, which does not fit {shape}")
    return chosen


def is_forced(key: str) -> bool:
    """Whether kernel ``key`` runs a config forced by :func:`force` in this context."""
    return (_forced.get() or {}).get(key) is not None


def launches_on_amd() -> bool:
    """Whether kernels launch on an AMD GPU: torch is a ROCm build (``torch.version.hip``;
    ``rlk aot`` sets it to record launches as on an AMD GPU). For the few launch options
    Triton's AMD backend needs otherwise (their launchers say why), never for a bit."""
    import torch

    return torch.version.hip is not None


#: Called eagerly (not under CUDA graph capture), a kernel call of fewer FLOPs than this runs
#: through pointers even where its config asks for tensor descriptors (``TMA``). Such a call
#: takes under about 100 us on an H200, and an eager step of them (training, an eager rollout)
#: waits on the host, for whom encoding tensor maps costs 25-55 us per launch
#: (scripts/host_overhead.py). A captured graph pays that cost once, so there the config's
#: choice stands; a forced config (the conformance kit, the tests) is always launched as it
#: is. Either way the kernel reads the same values: the same bits.
HOST_BOUND_FLOPS = 2**36


def use_descriptors(cfg: Config, key: str, flops: int, device_tensor) -> bool:
    """Whether kernel ``key`` launched with ``cfg`` reads through tensor descriptors: the
    config asks for them (``TMA``) and the call is worth their host cost (see
    :data:`HOST_BOUND_FLOPS`)."""
    import torch

    return bool(cfg.get("TMA")) and (
        flops >= HOST_BOUND_FLOPS
        or is_forced(key)
        or (device_tensor.is_cuda and torch.cuda.is_current_stream_capturing())
    )


#: Ops built from other ops' kernels: their tuning is the tuning of those kernels.
COMPOSED = {"linear_logprobs": ("linear", "logprobs")}


def _owners(op: str) -> tuple[str, ...]:
    return COMPOSED.get(op, (op,))


def op_configs(table: TuningTable, op: str) -> list[dict[str, Config]]:
    """Config sets covering every candidate of every kernel of ``op`` (keys ``op.*``)."""
    keys = sorted(k for k in table if k.split(".")[0] in _owners(op))
    if not keys:
        return []
    n = max(len(table[k].configs) for k in keys)
    cycles = {k: itertools.cycle(table[k].configs) for k in keys}
    return [{k: next(cycles[k]) for k in keys} for _ in range(n)]


@contextlib.contextmanager
def force(op: str, configs: Mapping[str, Config]) -> Iterator[None]:
    """Force the configs of ``op``'s kernels (as given by :func:`op_configs`) in this context."""
    for k in configs:
        if k.split(".")[0] not in _owners(op):
            raise KeyError(f"config key {k!r} does not belong to op {op!r}")
    token = _forced.set({**(_forced.get() or {}), **configs})
    try:
        yield
    finally:
        _forced.reset(token)
