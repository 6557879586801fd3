"""The op catalog (rlk/_catalog.py) is the one op list: what is derived from it, and what must
agree with it (the public functions, the float64 oracle, the kit's case builders)."""

from __future__ import annotations

import importlib
import inspect

import rlk
import rlk_reference
from rlk import _builtin, _catalog, ops
from rlk._catalog import CATALOG, OPS, OPTIONAL_OPS, SPECS
from rlk.testing import cases


def test_ops_are_the_required_specs_in_order():
    assert rlk.OPS == OPS == tuple(s.name for s in CATALOG if not s.optional)
    assert OPTIONAL_OPS == (
        "tree_linear", "column_tree_linear", "moe_route", "moe_experts",
        "vocab_parallel_linear_logprobs",
    )  # fmt: skip
    assert len(SPECS) == len(CATALOG)  # names are unique


def _family_ops() -> dict:
    """The op functions of the rlk.ops family modules (their public functions, less the
    argument checks they share with other distributions)."""
    found = {}
    for family in ops.FAMILIES:
        mod = importlib.import_module(f"rlk.ops.{family}")
        for name, obj in vars(mod).items():
            public = not name.startswith(("_", "check_"))
            if public and inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                found[name] = obj
    return found


def test_public_exports_are_the_catalog_ops():
    assert set(OPS) <= set(rlk.__all__)
    # The op functions rlk exports are exactly the catalog's, each the one of its family module.
    family_ops = _family_ops()
    assert set(family_ops) == set(OPS)
    exported = {n for n in rlk.__all__ if getattr(rlk, n) is family_ops.get(n)}
    assert exported == set(OPS)


#: Keyword-only arguments of a public op that rlk folds into others before the backend call.
ALIASES = {"policy_loss": {"tis_cap"}}  # an upper importance-sampling bound: is_max


def test_kwonly_matches_the_public_signatures():
    for op in OPS:
        params = inspect.signature(getattr(rlk, op)).parameters.values()
        kwonly = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        assert [k for k in kwonly if k not in ALIASES.get(op, ())] == list(SPECS[op].kwonly), op
        names = {p.name for p in params}
        assert set(SPECS[op].grad_args) <= names, op
        assert set(SPECS[op].unit_grads) <= set(SPECS[op].grad_args), op


def test_out_dtypes_name_torch_dtypes():
    import torch

    for s in CATALOG:
        for name in s.out_dtype.split(","):  # one dtype, or one per output
            assert name == "input" or isinstance(getattr(torch, name), torch.dtype)


def test_reference_implements_every_op_of_the_catalog():
    assert set(rlk_reference.__all__) == set(SPECS)
    impl = _builtin._load_reference()
    assert set(impl.ops) == set(SPECS)
    assert impl.missing() == []


def test_every_required_op_has_a_case_builder():
    assert list(cases.BUILDERS) == list(OPS)
    assert cases.KWONLY is _catalog.KWONLY  # what the kit's call() passes by keyword
