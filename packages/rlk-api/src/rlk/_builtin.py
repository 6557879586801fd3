"""rlk's own plugin: the float64 reference backend (rlk-reference is always installed)."""

from __future__ import annotations

from rlk._plugins import BackendImpl, BackendSpec, hookimpl


def _load_reference() -> BackendImpl:
    import rlk_reference
    from rlk.ops import CATALOG

    # Every op of the catalog that the oracle implements (all of them; a missing required op
    # makes the backend incomplete, which rlk reports by name).
    return BackendImpl(
        ops={
            s.name: getattr(rlk_reference, s.name)
            for s in CATALOG
            if hasattr(rlk_reference, s.name)
        },
        # The oracle is obviously correct, not engineered for invariance: it claims accuracy only.
        claims=frozenset({"accuracy"}),
    )


@hookimpl
def rlk_backends():
    return [
        BackendSpec(
            name="reference",
            priority=0,
            device_types=("*",),
            is_available=lambda: (True, ""),
            load=_load_reference,
            description="float64 unfused oracle (slow; for testing)",
            distribution="rlk-reference",
        )
    ]
