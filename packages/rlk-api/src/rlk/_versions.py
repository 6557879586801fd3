"""The versions ``rlk info`` shows and ``rlk bench`` records in its report's ``meta``."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import platform

#: The distributions whose versions are reported, when installed.
DISTRIBUTIONS = (
    "torch",
    "triton",
    "pluggy",
    "rlk",
    "rlk-reference",
    "rlk-triton",
    "rlk-cuda",
    "rlk-rocm",
    "rlk-ascend",
    "rlk-integrations",
)


def versions(*extra: str) -> dict[str, str]:
    """Python's and the installed distributions' versions (``extra``: more distributions), e.g.
    ``{"python": "3.12.3", "torch": "2.13.0+cpu", "rlk": "0.1.0", ...}``."""
    out = {"python": platform.python_version()}
    for dist in (*DISTRIBUTIONS, *extra):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out
