"""The op catalog (``rlk.ops.CATALOG``, declared by ``rlk._catalog.op`` on the public functions)
is the one op list: what is derived from it, and what must agree with it (the exports, the
float64 oracle, the kit's case builders, the custom operators' schemas)."""

from __future__ import annotations

import importlib
import inspect

import pytest

import rlk
import rlk_reference
from rlk import _builtin, _library, ops, parallel
from rlk._catalog import op
from rlk.ops import CATALOG, OPS, OPTIONAL_OPS, SPECS
from rlk.testing import cases


def test_ops_are_the_required_specs_in_order():
    assert rlk.OPS == OPS == tuple(s.name for s in CATALOG if not s.optional)
    assert OPS[:4] == ("linear", "rms_norm", "silu_and_mul", "apply_rotary")  # FAMILIES' order
    assert OPTIONAL_OPS == (
        "moe_route", "moe_route_grouped", "moe_experts", "tree_linear", "column_tree_linear",
        "vocab_parallel_linear_logprobs", "expert_parallel_moe_experts",
    )  # fmt: skip
    assert len(SPECS) == len(CATALOG)  # names are unique


def _declared_in(module) -> list[str]:
    return [s.name for s in CATALOG if s.module == module.__name__]


def test_every_spec_is_its_public_function():
    for s in CATALOG:
        fn = getattr(importlib.import_module(s.module), s.name)
        assert inspect.isfunction(fn) and fn.__module__ == s.module, s.name
    assert {s.module for s in CATALOG} == {
        *(f"rlk.ops.{f}" for f in ops.FAMILIES),
        parallel.__name__,
    }


def test_family_modules_export_their_ops_and_rlk_exports_the_required_ones():
    for family in ops.FAMILIES:
        mod = importlib.import_module(f"rlk.ops.{family}")
        assert mod.__all__ == _declared_in(mod), family
    # rlk's __all__: the API, then the required ops in catalog order, each the family's function.
    assert [n for n in rlk.__all__ if n in SPECS] == list(OPS)
    for s in CATALOG:
        if s.module.startswith("rlk.ops."):
            assert getattr(rlk, s.name) is getattr(importlib.import_module(s.module), s.name)


#: Keyword-only arguments of a public op that rlk folds into others before the backend call.
ALIASES = {"policy_loss": {"tis_cap"}}  # an upper importance-sampling bound: is_max


def test_kwonly_is_the_public_signatures():
    for name in OPS:
        params = inspect.signature(getattr(rlk, name)).parameters.values()
        kwonly = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        assert [k for k in kwonly if k not in ALIASES.get(name, ())] == list(SPECS[name].kwonly)
        names = {p.name for p in params}
        assert set(SPECS[name].grad_args) <= names, name
        assert set(SPECS[name].unit_grads) <= set(SPECS[name].grad_args), name


def test_a_second_declaration_of_an_op_is_refused():
    def linear(x):
        return x

    with pytest.raises(ValueError, match="declared twice"):
        op("elsewhere", optional=True)(linear)


def test_a_required_op_without_its_operator_is_refused():
    # torch.compile needs every required op as an operator: its entry must describe it.
    def new_op(x):
        return x

    with pytest.raises(ValueError, match="'new_op' needs its operator"):
        op("elsewhere")(new_op)


def test_out_dtypes_name_torch_dtypes():
    import torch

    for s in CATALOG:
        for name in s.out_dtype.split(","):  # one dtype, or one per output
            assert name == "input" or isinstance(getattr(torch, name), torch.dtype)


def test_reference_implements_every_op_of_the_catalog():
    assert sorted(rlk_reference.__all__) == sorted(SPECS)
    impl = _builtin._load_reference()
    assert set(impl.ops) == set(SPECS)
    assert impl.missing() == []


def test_reference_takes_the_backend_arguments():
    # The oracle has every op's backend signature: the catalog's keywords, by keyword.
    for s in CATALOG:
        params = inspect.signature(getattr(rlk_reference, s.name)).parameters
        kwonly = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "table"]
        assert kwonly == list(s.kwonly), s.name


@pytest.mark.parametrize("backend", ["triton", "ascend"])
def test_backends_take_the_catalog_keywords(backend):
    # Each backend writes its ops' signatures itself; they must take the catalog's keywords.
    if backend == "triton":
        from rlk_triton import backend as b

        impl = b.make_impl(b.default_table())
    else:
        from rlk_ascend import backend as b

        impl = b.make_impl()
    for name, fn in impl.ops.items():
        params = inspect.signature(fn).parameters
        kwonly = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "table"]
        assert kwonly == list(SPECS[name].kwonly), (backend, name)


def test_operator_schemas_end_in_the_catalog_keywords():
    # rlk._library derives how a backend is called from each schema and the catalog, and
    # refuses a schema whose keyword arguments are not the catalog's.
    assert set(OPS) <= set(_library.SCHEMAS)
    for name in _library.SCHEMAS:
        positional = [n for n, k in _library.ARGS[name] if k.startswith("pos")]
        params = inspect.signature(getattr(rlk, name)).parameters.values()
        assert positional == [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD], name


def test_every_required_op_has_a_case_builder():
    assert list(cases.BUILDERS) == list(OPS)
    assert cases.KWONLY is ops.KWONLY  # what the kit's call() passes by keyword
