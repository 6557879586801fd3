"""Broken backends the conformance kit must catch: a pluggy plugin for tests.

Each wraps the float64 reference and breaks exactly one guarantee it claims, with a change of one
unit in the last place: small enough to stay within the accuracy tolerances, so only the check
of that guarantee can catch it. Install with
``rlk.selection.reset_registry(extra_plugins=[fake_backends])``.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

import rlk
import rlk_reference
from rlk import BackendImpl, BackendSpec
from rlk_reference import _moe as _ref_moe

REF_OPS = {op: getattr(rlk_reference, op) for op in rlk.OPS}
ROW_OPS = (
    "linear",
    "rms_norm",
    "silu_and_mul",
    "apply_rotary",
    "logprobs",
    "linear_logprobs",
    "kl_penalty",
    "gae_advantages",
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
    if op in ("linear", "rms_norm", "value_loss"):
        return [{f"{op}.fwd": {"BLOCK_M": 16}}, {f"{op}.fwd": {"BLOCK_M": 32}}]
    return []


def tuning_dependent(op):
    """linear's and value_loss's second config changes bits (the loss of value_loss, as if
    its sequences were summed in another order); rms_norm's configs are harmless."""
    ref = REF_OPS[op]

    def fn(*args, **kwargs):
        out = ref(*args, **kwargs)
        block = (_config.get() or {}).get(f"{op}.fwd", {}).get("BLOCK_M")
        return ulp_up(out) if op in ("linear", "value_loss") and block == 32 else out

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


def reordered_combine(x, indices, weights, gate_up, down, **kwargs):
    """moe_experts with the k expert outputs added in descending rank order (each the float64
    oracle's, rounded to fp32; the sum in fp32): accurate, batch-invariant, and not the
    contract's rank order, which the kit's combine-order check must catch."""
    ones = torch.ones_like(weights[:, :1])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for r in reversed(range(indices.shape[1])):
        y = _ref_moe.moe_experts(x, indices[:, r : r + 1], ones, gate_up, down).float()
        out = out + weights[:, r : r + 1].float() * y
    return out.to(x.dtype)


def arrival_order_router(logits, bias, top_k, n_group=1, topk_group=1, normalize=True,
                         scale=1.0, **kwargs):  # fmt: skip
    """moe_route_grouped with ties (of experts and of groups) to the later index, as a router
    that keeps the last best it meets: the float64 oracle on the experts in reverse order.
    Accurate and batch-invariant off ties; the kit's tie cases must catch it."""
    w, idx = _ref_moe.moe_route_grouped(
        logits.flip(1), bias.flip(0), top_k, n_group, topk_group, normalize, scale
    )
    return w, logits.shape[1] - 1 - idx


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
            {op: tuning_dependent(op) for op in ("linear", "rms_norm", "value_loss")},
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
        "fake_moe_order": lambda: _impl(
            {"accuracy", "batch_invariance", "path_invariance"},
            {"moe_route": _ref_moe.moe_route, "moe_experts": reordered_combine},
        ),
        "fake_route_ties": lambda: _impl(
            {"accuracy", "batch_invariance"}, {"moe_route_grouped": arrival_order_router}
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


# --------------------------------------------------------------------------------------------
# Misbehaving plugins: each breaks the plugin contract in one way; rlk must report it by name
# and keep every other backend working. Install one with
# ``reset_registry(extra_plugins=[Misbehaving(kind)])``. They serve the CPU at a priority above
# every real backend, so ``auto`` meets them first.
# --------------------------------------------------------------------------------------------


def _raise(what):
    def fn():
        raise RuntimeError(f"boom: {what} exploded")

    return fn


def _good_load():
    return _impl({"accuracy"})


#: kind -> (BackendSpec fields that differ from a good spec, words the report must contain)
MISBEHAVING_SPECS = {
    "available_raises": ({"is_available": _raise("is_available")}, "is_available() raised"),
    "available_none": ({"is_available": lambda: None}, "is_available() returned None"),
    "available_not_bool": ({"is_available": lambda: ("yes", "")}, "not (bool, str)"),
    "priority_none": ({"priority": None}, "priority must be an int"),
    "priority_str": ({"priority": "high"}, "priority must be an int"),
    "devices_str": ({"device_types": "cpu"}, "device_types must be"),
    "load_not_callable": ({"load": "rlk_fake:load"}, "load must be callable"),
    "load_raises": ({"load": _raise("load")}, "failed to load: boom"),
    "load_garbage": ({"load": lambda: "not an impl"}, "loader returned str"),
    "ops_not_callable": (
        {"load": lambda: _impl({"accuracy"}, {"linear": "not a function"})},
        "linear with no callable",
    ),
}


class Misbehaving:
    """A plugin named ``fake_<kind>`` declaring one backend ``fake_<kind>`` that misbehaves."""

    def __init__(self, kind: str):
        self.__name__ = f"fake_{kind}"  # pluggy names a registered plugin by its __name__
        self.kind = kind

    @rlk.hookimpl
    def rlk_backends(self):
        fields = dict(
            name=self.__name__,
            priority=1000,
            device_types=("cpu",),
            is_available=lambda: (True, ""),
            load=_good_load,
            distribution="rlk-tests",
        )
        fields.update(MISBEHAVING_SPECS[self.kind][0])
        return [BackendSpec(**fields)]


class RaisingHook:
    """A plugin whose ``rlk_backends()`` hook itself raises."""

    __name__ = "fake_hook_raises"

    @rlk.hookimpl
    def rlk_backends(self):
        raise RuntimeError("boom: hook exploded")


class GarbageHook:
    """A plugin whose hook returns something other than a list of BackendSpec records."""

    def __init__(self, result, name="fake_hook_garbage"):
        self.__name__ = name
        self.result = result

    @rlk.hookimpl
    def rlk_backends(self):
        return self.result
