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


def trl_conflict() -> str | None:
    """Why verl cannot build a model beside the installed TRL, None when it can.

    verl 0.9.1's ``apply_monkey_patch`` (run for every model its FSDP engine builds) imports
    TRL's ``AutoModelForCausalLMWithValueHead`` whenever any TRL is installed, from
    ``trl.experimental.ppo`` or ``trl``; TRL 1.x releases that have neither (1.16 among them)
    make every model build fail with an ``ImportError`` deep inside verl. This names the cause
    before any weight is loaded."""
    try:
        import trl
    except ImportError:
        return None
    if hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        return None
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        found = getattr(trl, "__version__", "unknown")
        return (
            f"verl {TESTED_VERL} imports trl's AutoModelForCausalLMWithValueHead whenever trl is "
            f"installed, and the installed trl {found} has none: run verl in an environment "
            "without trl (pip uninstall trl)"
        )
    return None


def info() -> dict[str, object]:
    """``rlk info``'s line for verl (entry point ``rlk.info``): the release rlk's engine is
    written for, the installed one, and whether the engine accepts it."""
    found = installed_verl()
    conflict = trl_conflict() if found == TESTED_VERL else None
    ok = found == TESTED_VERL and conflict is None
    if ok:
        note = "VERL_ENGINE_VENDOR=rlk selects rlk's FSDP2 engine"
    elif conflict is not None:
        note = conflict
    elif found is None:
        note = f'pip install "rlk-integrations[verl]" && pip install --no-deps verl=={TESTED_VERL}'
    else:
        note = f"rlk's engine refuses verl {found}"
    return {"name": "verl", "tested": TESTED_VERL, "installed": found, "ok": ok, "note": note}
