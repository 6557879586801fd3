"""Build a backend implementation from the rlk_triton kernels and a tuning table."""

from __future__ import annotations

import functools
import importlib

from rlk import BackendImpl
from rlk_triton import tuning
from rlk_triton._triton import INTERPRET

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


#: Vendor tuning tables built on these kernels: (name, module, attribute of overrides).
VENDOR_TABLES = (("cuda", "rlk_cuda.tables", "NVIDIA"), ("rocm", "rlk_rocm.tables", "CDNA3"))


def known_tables() -> dict[str, dict[str, tuning.Rule]]:
    """The portable table and every installed vendor table (merged over it), by backend name.

    Vendor packages are found by import, not through their backends: the rocm table must be
    checkable on an NVIDIA GPU or a CPU, where backend ``rocm`` is not available.
    """
    base = default_table()
    tables = {"triton": base}
    for name, module, attr in VENDOR_TABLES:
        try:
            overrides = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError:
            continue
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
        tuning_configs=all_op_configs,
        use_config=tuning.force,
    )
