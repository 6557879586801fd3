"""rlk's own plugin: the float64 reference backend (rlk-reference is always installed).

:mod:`rlk.selection` registers it in the process's registry under the name ``rlk``, the only
plugin that may declare :data:`rlk.plugins.ORACLE`.
"""

from __future__ import annotations

from rlk._catalog import declared
from rlk.plugins import ORACLE, BackendImpl, BackendSpec, hookimpl


def _load_reference() -> BackendImpl:
    # Imported here, as every backend imports its kernels: declaring the backend stays cheap.
    import rlk_reference

    # Every op of the catalog that the oracle implements (all of them; a missing required op
    # makes the backend incomplete, which rlk reports by name).
    return BackendImpl(
        ops={
            s.name: getattr(rlk_reference, s.name)
            for s in declared()
            if hasattr(rlk_reference, s.name)
        },
        # The oracle is obviously correct, not engineered for invariance: it claims accuracy only.
        claims=frozenset({"accuracy"}),
    )


@hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name=ORACLE,
            priority=0,
            device_types=("*",),
            is_available=lambda: (True, ""),
            load=_load_reference,
            description="float64 unfused oracle (slow; for testing)",
            distribution="rlk-reference",
        )
    ]
