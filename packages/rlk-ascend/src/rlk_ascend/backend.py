"""Build the ascend backend implementation. Importing this module never imports torch_npu."""

from __future__ import annotations

import os
from typing import Any

from rlk.ops import CATALOG
from rlk.plugins import BackendImpl
from rlk_ascend import npu as _npu
from rlk_ascend import portable, portable_losses, portable_ppo

#: What the portable code has been checked for, on CPU, by the conformance kit and the tests of
#: this package. On an Ascend NPU nothing has been run yet (see docs/backends.md).
CLAIMS = frozenset(
    {"accuracy", "batch_invariance", "determinism", "tuning_invariance", "path_invariance"}
)


def make_impl(npu: Any = None, fused: tuple[str, ...] | None = None) -> BackendImpl:
    """The ``ascend`` :class:`rlk.BackendImpl`, without importing torch_npu.

    ``npu``: the torch_npu module, imported by the plugin's loader; ``None`` builds the portable
    backend only (any device; CI registers it for ``cpu`` under a test name). ``fused``: ops to
    serve with torch_npu fused operators (:data:`rlk_ascend.npu.FUSED`, unverified); default
    from ``RLK_ASCEND_FUSED`` (unset: none).

    The claims are the same with fused operators on, so that ``rlk conformance`` checks them
    against the whole contract.
    """
    if fused is None:
        fused = _npu.requested(os.environ.get("RLK_ASCEND_FUSED", ""))
    if fused and npu is None:
        raise RuntimeError(
            f"fused torch_npu operators requested for {', '.join(fused)} "
            "(RLK_ASCEND_FUSED), but torch_npu is not loaded"
        )
    ops, delegated = {}, {}
    # Every op of the catalog that the portable code (or a fused operator) has: a required op
    # it lacks makes the backend incomplete, which rlk reports by name; an optional one is left
    # out.
    for op in (s.name for s in CATALOG):
        found = (m for m in (portable_ppo, portable_losses, portable) if hasattr(m, op))
        mod = next(found, None)
        if op in fused:
            ops[op] = _npu.fused_op(op, npu)
            delegated[op] = (
                f"torch_npu.{_npu.FUSED[op]} (opt-in RLK_ASCEND_FUSED; never checked on an NPU)"
            )
        elif mod is not None:
            ops[op] = getattr(mod, op)
            delegated[op] = f"portable PyTorch, fixed order ({mod.__name__}.{op})"
    return BackendImpl(
        ops=ops,
        claims=CLAIMS,
        delegated=delegated,
        tuning_configs=lambda op: [] if op in fused else portable.tuning_configs(op),
        use_config=portable.use_config,
    )
