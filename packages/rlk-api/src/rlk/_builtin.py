"""rlk's own plugin: the float64 reference backend (rlk-reference is always installed)."""

from __future__ import annotations

from rlk._plugins import BackendImpl, BackendSpec, hookimpl


def _load_reference() -> BackendImpl:
    import rlk_reference

    return BackendImpl(
        ops={op: getattr(rlk_reference, op) for op in rlk_reference.__all__},
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
