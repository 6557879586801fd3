"""The argument checks of rlk's ops, public for other distributions (the integrations' entry
points check their own arguments with them, and read the ``RLK_VALIDATE`` switch).

Each raises ``TypeError``/``ValueError`` naming the argument. Example::

    from rlk import validate

    n = validate.positive_int("max_tokens", max_tokens)
    if validate.validate_requested():
        ...
"""

from __future__ import annotations

from rlk._validate import (
    choice,
    flag,
    positive_float,
    positive_int,
    validate_requested,
    value_checks_enabled,
)

__all__ = [
    "choice",
    "flag",
    "positive_float",
    "positive_int",
    "validate_requested",
    "value_checks_enabled",
]
