"""The verl release rlk's verl integration is written against (kept apart: the engine module and
the package both read it)."""

from __future__ import annotations

#: The verl release this integration is written and tested against (its engine subclasses
#: that release's FSDP engine); with any other the engine raises ``RuntimeError`` when built.
TESTED_VERL = "0.9.1"


def installed_verl() -> str | None:
    """The installed verl release, None without one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return None


def check_verl() -> str:
    """The installed verl release; ``RuntimeError`` when none is, or another than
    :data:`TESTED_VERL`."""
    found = installed_verl()
    if found is None:
        raise RuntimeError(
            'rlk_integrations.adapters.verl needs verl: pip install "rlk-integrations[verl]" '
            f"and pip install --no-deps verl=={TESTED_VERL}"
        )
    if found != TESTED_VERL:
        raise RuntimeError(
            f"rlk's verl engine supports verl {TESTED_VERL} only (it subclasses that release's "
            f"FSDP engine), found {found}"
        )
    return found


def info() -> dict[str, object]:
    """``rlk info``'s line for verl (entry point ``rlk.info``): the release rlk's engine is
    written for, the installed one, and whether the engine accepts it."""
    found = installed_verl()
    ok = found == TESTED_VERL
    if ok:
        note = "VERL_ENGINE_VENDOR=rlk selects rlk's FSDP2 engine"
    elif found is None:
        note = f'pip install "rlk-integrations[verl]" && pip install --no-deps verl=={TESTED_VERL}'
    else:
        note = f"rlk's engine refuses verl {found}"
    return {"name": "verl", "tested": TESTED_VERL, "installed": found, "ok": ok, "note": note}
