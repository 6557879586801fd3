"""rlk_triton.tuning: a forced config runs where it fits the shape, yields to the rule's choice
where it does not, and a chooser that picks a config that does not fit is an error."""

from __future__ import annotations

import pytest

from rlk_triton import tuning

SMALL, LARGE = {"BLOCK": 16}, {"BLOCK": 256}


def _fits(cfg, n: int = 1, **_: int) -> bool:
    return cfg["BLOCK"] * n <= 256


TABLE = {"op.fwd": tuning.Rule(configs=(SMALL, LARGE), choose=lambda n=1, **_: 0, fits=_fits)}


def test_forced_config_runs_where_it_fits():
    with tuning.force("op", {"op.fwd": LARGE}):
        assert tuning.config(TABLE, "op.fwd", n=1) is LARGE
        # LARGE at n = 2 cannot launch: the shape's own choice runs instead.
        assert tuning.config(TABLE, "op.fwd", n=2) is SMALL
    assert tuning.config(TABLE, "op.fwd", n=2) is SMALL


def test_a_chooser_picking_a_config_that_does_not_fit_is_an_error():
    table = {"op.fwd": tuning.Rule(configs=(SMALL, LARGE), choose=lambda **_: 1, fits=_fits)}
    assert tuning.config(table, "op.fwd", n=1) is LARGE
    with pytest.raises(RuntimeError, match="does not fit"):
        tuning.config(table, "op.fwd", n=2)


def test_rules_fit_every_config_by_default_and_preferring_keeps_fits():
    assert tuning.config({"op.fwd": tuning.Rule(configs=(LARGE,))}, "op.fwd", n=99) is LARGE
    rule = tuning.preferring(TABLE["op.fwd"], {"BLOCK": 512})
    assert rule.fits is _fits
