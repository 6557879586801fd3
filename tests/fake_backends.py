"""Broken backends the conformance kit must catch: a pluggy plugin for tests.

Each wraps the float64 reference and breaks exactly one guarantee it claims, with a change of one
unit in the last place: small enough to stay within the accuracy tolerances, so only the check
of that guarantee can catch it. Install with
``rlk._plugins.reset_registry(extra_plugins=[fake_backends])``.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

import rlk
import rlk_reference
from rlk import BackendImpl, BackendSpec

REF_OPS = {op: getattr(rlk_reference, op) for op in rlk.OPS}
ROW_OPS = (
    "linear",
    "rms_norm",
    "silu_and_mul",
    "apply_rotary",
    "logprobs",
    "linear_logprobs",
    "kl_penalty",
)


def ulp_up(out, noise: bool = False):
    """Every float result scaled by ``1 + eps`` of its dtype (elementwise at random with
    ``noise``): one or two units in the last place, bits always change for non-zero values."""
    if isinstance(out, tuple):
        return tuple(ulp_up(t, noise) for t in out)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return out
    eps = torch.finfo(out.dtype).eps
    if noise:  # unseeded global RNG: a different draw on every call
        return out * (1 + eps * torch.randint(0, 2, out.shape, device=out.device).to(out.dtype))
    return out * (1 + eps)


def batch_dependent(op):
    """Results of a batch of more than one row change by an ulp."""
    ref = REF_OPS[op]

    def fn(*args, **kwargs):
        out = ref(*args, **kwargs)
        return ulp_up(out) if args[0].shape[0] > 1 else out

    return fn


def nondeterministic(op):
    ref = REF_OPS[op]
    return lambda *a, **kw: ulp_up(ref(*a, **kw), noise=True)


_config: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fake_config", default=None)


@contextlib.contextmanager
def use_config(op, cfg):
    token = _config.set(dict(cfg))
    try:
        yield
    finally:
        _config.reset(token)


def tuning_configs(op):
    if op in ("linear", "rms_norm"):
        return [{f"{op}.fwd": {"BLOCK_M": 16}}, {f"{op}.fwd": {"BLOCK_M": 32}}]
    return []


def tuning_dependent(op):
    """linear's second config changes bits; rms_norm's configs are harmless."""
    ref = REF_OPS[op]

    def fn(*args, **kwargs):
        out = ref(*args, **kwargs)
        block = (_config.get() or {}).get(f"{op}.fwd", {}).get("BLOCK_M")
        return ulp_up(out) if op == "linear" and block == 32 else out

    return fn


def path_dependent(op):
    """Decode/chunked attention, paged attention, fused rms_norm and fused logprobs are off."""
    ref = REF_OPS[op]

    def fn(*args, **kwargs):
        out = ref(*args, **kwargs)
        if op == "attention":
            cu_q, cu_k = args[3], args[4]
            if bool(((cu_q[1:] - cu_q[:-1]) < (cu_k[1:] - cu_k[:-1])).any()):
                return ulp_up(out)
            return out
        if op == "rms_norm":
            return ulp_up(out) if args[3] is not None else out
        return ulp_up(out)

    return fn


def crashing(*args, **kwargs):
    raise RuntimeError("boom: kernel exploded")


def _impl(claims, ops=None, **kw) -> BackendImpl:
    return BackendImpl(ops={**REF_OPS, **(ops or {})}, claims=frozenset(claims), **kw)


def _loaders():
    return {
        "fake_batchdep": lambda: _impl(
            {"accuracy", "batch_invariance"}, {op: batch_dependent(op) for op in ROW_OPS}
        ),
        "fake_nondet": lambda: _impl(
            {"accuracy", "determinism"}, {op: nondeterministic(op) for op in rlk.OPS}
        ),
        "fake_tuning": lambda: _impl(
            {"accuracy", "tuning_invariance"},
            {op: tuning_dependent(op) for op in ("linear", "rms_norm")},
            tuning_configs=tuning_configs,
            use_config=use_config,
        ),
        "fake_pathdep": lambda: _impl(
            {"path_invariance"},
            {
                op: path_dependent(op)
                for op in ("attention", "paged_attention", "rms_norm", "linear_logprobs")
            },
        ),
        "fake_broken": lambda: BackendImpl(
            ops={
                **{op: f for op, f in REF_OPS.items() if op != "sample"},
                "silu_and_mul": crashing,
            },
            claims=frozenset({"accuracy"}),
        ),
    }


@rlk.hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name=name,
            priority=-1,
            device_types=("*",),
            is_available=lambda: (True, ""),
            load=load,
            description="broken on purpose (conformance kit tests)",
            distribution="rlk-tests",
        )
        for name, load in _loaders().items()
    ]
