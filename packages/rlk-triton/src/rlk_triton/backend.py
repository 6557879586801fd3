"""Build a backend implementation from the rlk_triton kernels and a tuning table."""

from __future__ import annotations

import functools
import importlib

from rlk import BackendImpl
from rlk_triton import tuning

#: op -> module of rlk_triton holding its public function (one file per op family).
OP_MODULES = {
    "linear": "gemm",
    "rms_norm": "norm",
    "silu_and_mul": "activation",
    "apply_rotary": "rotary",
    "attention": "attention",
    "paged_attention": "attention",
    "logprobs": "logprobs",
    "linear_logprobs": "fused_logprobs",
    "policy_loss": "losses",
    "kl_penalty": "losses",
    "grpo_advantages": "losses",
    "sample": "sampling",
}

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
    """The portable table: every kernel's ``TUNING`` rules, as its module declares them."""
    table: dict[str, tuning.Rule] = {}
    for mod in _modules().values():
        table.update(getattr(mod, "TUNING", {}))
    return table


def make_impl(table: tuning.TuningTable) -> BackendImpl:
    """Every op found in rlk_triton, bound to ``table``; ops not written yet are left out."""
    mods = _modules()
    ops = {}
    for op, modname in OP_MODULES.items():
        fn = getattr(mods.get(modname), op, None)
        if fn is not None:
            ops[op] = functools.partial(fn, table=table)
    return BackendImpl(
        ops=ops,
        claims=CLAIMS,
        tuning_configs=lambda op: tuning.op_configs(table, op),
        use_config=tuning.force,
    )
