"""Plugin discovery, backend selection and their errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import fake_backends
import pytest
import torch

import rlk
from rlk import selection
from rlk.plugins import BackendError, BackendImpl, BackendSpec


def _reference_ops():
    import rlk_reference

    return {op: getattr(rlk_reference, op) for op in rlk_reference.__all__}


class _Plugin:
    """A test plugin declaring the given specs."""

    def __init__(self, *specs):
        self.specs = specs

    @rlk.hookimpl
    def rlk_backends(self):
        return list(self.specs)


def _spec(
    name,
    *,
    priority=10,
    devices=("cpu",),
    ops=None,
    available=(True, ""),
    load=None,
    distribution="test-dist",
):
    if load is None:
        ops = _reference_ops() if ops is None else ops
        load = lambda: BackendImpl(ops=ops, claims=frozenset({"accuracy"}))  # noqa: E731
    return BackendSpec(
        name=name,
        priority=priority,
        device_types=devices,
        is_available=lambda: available,
        load=load,
        distribution=distribution,
    )


@pytest.fixture
def plugins(monkeypatch):
    """Install extra test plugins for one test; the real registry comes back afterwards."""
    monkeypatch.delenv("RLK_BACKEND", raising=False)

    def install(*specs):
        return selection.reset_registry(extra_plugins=[_Plugin(*specs)])

    yield install
    selection.reset_registry()


def test_all_five_backends_are_discovered_with_honest_availability():
    reg = selection.reset_registry()
    specs = reg.specs
    assert {"reference", "triton", "cuda", "rocm", "ascend"} <= set(specs)
    ok, _ = specs["reference"].is_available()
    assert ok
    if not torch.cuda.is_available():
        ok, reason = specs["cuda"].is_available()
        assert not ok and "CUDA" in reason
        ok, reason = specs["rocm"].is_available()
        assert not ok and "ROCm" in reason
    if "torch_npu" not in sys.modules:
        ok, reason = specs["ascend"].is_available()
        assert not ok and "torch_npu" in reason
    # Discovery must not import the heavy stacks.
    assert "torch_npu" not in sys.modules


def test_distributions_are_named():
    specs = selection.reset_registry().specs
    assert specs["reference"].distribution == "rlk-reference"
    assert specs["triton"].distribution == "rlk-triton"
    assert specs["cuda"].distribution == "rlk-cuda"


def test_unknown_backend_names_installed_ones_and_pip_hint(plugins):
    plugins()
    with pytest.raises(BackendError) as e, rlk.use_backend("nope"):
        pass
    msg = str(e.value)
    assert "'nope'" in msg and "reference" in msg and "triton" in msg
    assert 'pip install "rlk[cuda]"' in msg


def test_known_vendor_name_gets_its_extra(plugins):
    plugins()
    reg = selection.registry()
    reg._specs.pop("rocm")
    with pytest.raises(BackendError, match=r'pip install "rlk\[rocm\]"'):
        reg.spec("rocm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_backend_gives_the_reason(plugins):
    plugins()
    with pytest.raises(BackendError, match="not available: .*CUDA"), rlk.use_backend("cuda"):
        pass


def test_duplicate_names_name_both_distributions(plugins):
    plugins(_spec("alpha", distribution="one-dist"), _spec("alpha", distribution="evil-dist"))
    with pytest.raises(BackendError) as e, rlk.use_backend("alpha"):
        pass
    assert "one-dist" in str(e.value) and "evil-dist" in str(e.value)
    with rlk.use_backend("triton"):  # the other backends keep working
        rlk.silu_and_mul(torch.randn(2, 8))


def test_a_plugin_declaring_the_oracle_name_is_refused_and_the_oracle_stays(plugins):
    plugins(_spec("reference", distribution="evil-dist"), _spec("alpha", priority=-5))
    with rlk.use_backend("reference"):
        rlk.silu_and_mul(torch.randn(2, 8))
    assert selection.registry().spec("reference").distribution == "rlk-reference"
    reasons = [b.reason for b in selection.registry().broken]
    assert any("evil-dist" in r and "'reference'" in r and "oracle" in r for r in reasons)


def test_an_empty_backend_name_means_auto_in_both_forms(plugins, monkeypatch):
    plugins()
    monkeypatch.setenv("RLK_BACKEND", "")
    auto = rlk.current_backend("cpu")
    monkeypatch.delenv("RLK_BACKEND")
    with rlk.use_backend(""):
        assert rlk.current_backend("cpu") == auto


def _info():
    from rlk import cli

    return {b["name"]: b for b in cli.info_dict()["backends"]}


def _works(name):
    with rlk.use_backend(name):
        y = rlk.rms_norm(torch.randn(3, 8), torch.ones(8))
    assert y.shape == (3, 8)


@pytest.mark.parametrize("kind", sorted(fake_backends.MISBEHAVING_SPECS))
def test_misbehaving_backend_is_reported_by_name_and_the_others_work(monkeypatch, kind):
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    name, words = f"fake_{kind}", fake_backends.MISBEHAVING_SPECS[kind][1]
    try:
        selection.reset_registry(extra_plugins=[fake_backends.Misbehaving(kind)])
        entry = _info()[name]
        assert entry["broken"] and not entry["available"] and words in entry["reason"]
        with (
            pytest.raises(BackendError, match=f"'{name}'.*{re.escape(words)}"),
            rlk.use_backend(name),
        ):
            pass
        # auto meets it first on the CPU: an error naming it, never the next backend down
        with pytest.raises(BackendError, match=f"'{name}'.*{re.escape(words)}.*RLK_BACKEND"):
            rlk.current_backend("cpu")
        _works("reference")
        _works("triton")
    finally:
        selection.reset_registry()


@pytest.mark.parametrize(
    "plugin, words",
    [
        (fake_backends.RaisingHook(), "rlk_backends() hook raised RuntimeError: boom"),
        (fake_backends.GarbageHook(["not a spec"]), "returned str, not a BackendSpec"),
        (fake_backends.GarbageHook(7), "returned int, not a list"),
        (fake_backends.GarbageHook([_spec("no-dash")]), "invalid backend name 'no-dash'"),
    ],
)
def test_broken_plugin_is_reported_by_name_and_the_others_work(monkeypatch, plugin, words):
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    try:
        selection.reset_registry(extra_plugins=[plugin])
        entry = _info()[plugin.__name__]
        assert entry["broken"] and words in entry["reason"]
        with pytest.raises(BackendError, match=re.escape(words)), rlk.use_backend(plugin.__name__):
            pass
        # It might have served any device at any priority, so auto does not guess past it.
        with pytest.raises(BackendError, match=f"'{plugin.__name__}'.*RLK_BACKEND"):
            rlk.current_backend("cpu")
        _works("reference")
        _works("triton")
    finally:
        selection.reset_registry()


def test_plugin_whose_entry_point_fails_to_import_is_reported(monkeypatch):
    import importlib.metadata as md

    class _EP:
        name, value, dist = "fake_import", "rlk_no_such_module.plugin", None

        def load(self):
            raise ImportError("No module named 'rlk_no_such_module'")

    real = md.entry_points

    def entry_points(**kw):
        return [*real(**kw), _EP()] if kw.get("group") == "rlk" else real(**kw)

    monkeypatch.setattr(md, "entry_points", entry_points)
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    try:
        selection.reset_registry()
        assert "No module named" in _info()["fake_import"]["reason"]
        _works("reference")
    finally:
        monkeypatch.undo()
        selection.reset_registry()


def test_incomplete_backend_cannot_be_selected_and_auto_skips_it(plugins):
    ops = _reference_ops()
    del ops["attention"]
    plugins(_spec("partial", priority=1000, ops=ops))
    with (
        pytest.raises(BackendError, match="does not implement attention"),
        rlk.use_backend("partial"),
    ):
        pass
    assert rlk.current_backend("cpu") != "partial"


def test_info_lists_each_backends_ops(plugins, capsys):
    # rlk info: per available backend, the catalog ops it serves and the optional ones it lacks;
    # a backend without optional ops is still selected.
    from rlk import cli

    ops = _reference_ops()
    del ops["attention"], ops["moe_route"]
    no_optional = {op: fn for op, fn in _reference_ops().items() if op in rlk.OPS}
    plugins(_spec("partial", ops=ops), _spec("plain", priority=1000, ops=no_optional))
    info = _info()
    assert info["partial"]["missing_ops"] == ["attention"]
    assert info["partial"]["missing_optional_ops"] == ["moe_route"]
    assert info["plain"]["ops"] == list(rlk.OPS) and info["plain"]["missing_ops"] == []
    assert info["plain"]["missing_optional_ops"] == list(rlk.ops.OPTIONAL_OPS)
    assert info["reference"]["ops"] == [s.name for s in rlk.ops.CATALOG]
    assert rlk.current_backend("cpu") == "plain"
    cli.main(["info"])
    out = capsys.readouterr().out
    n = len(rlk.OPS)
    optional = "optional: moe_route_grouped, moe_experts, tree_linear"
    assert f"ops: {n - 1} of the {n} required; {optional}" in out
    assert "optional ops it lacks: moe_route\n" in out
    assert f"ops: {n} of the {n} required; optional: none" in out


def test_auto_picks_highest_priority_complete_backend(plugins):
    plugins(_spec("best", priority=1000), _spec("worse", priority=999))
    assert rlk.current_backend("cpu") == "best"
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.testing.assert_close(rlk.rms_norm(x, w), rlk.rms_norm(x, w))


def test_auto_respects_device_types(plugins):
    plugins(_spec("npu_only", priority=1000, devices=("npu",)))
    assert rlk.current_backend("cpu") != "npu_only"
    with pytest.raises(BackendError, match="does not serve 'cpu'"), rlk.use_backend("npu_only"):
        rlk.current_backend("cpu")


def test_loader_failure_is_a_reason_not_a_crash(plugins):
    def boom():
        raise ImportError("libvendor.so: cannot open shared object file")

    plugins(_spec("broken", priority=1000, load=boom))
    with (
        pytest.raises(BackendError, match="failed to load: libvendor.so"),
        rlk.use_backend("broken"),
    ):
        pass
    # auto never moves on to the next backend: it says what failed and how to choose.
    with pytest.raises(BackendError) as e:
        rlk.current_backend("cpu")
    msg = str(e.value)
    assert "'broken' failed to load: libvendor.so" in msg
    assert "RLK_BACKEND=<name>" in msg and "rlk.use_backend" in msg and "triton" in msg
    _works("triton")


@pytest.mark.parametrize("entry", ["not a pair", "unknown op"])
def test_bad_autograd_entries_are_refused_at_load(plugins, entry):
    from rlk.plugins import OpAutograd

    pair = OpAutograd(lambda *a: None, lambda *a: None)
    ops = _reference_ops()
    autograd = {"linear": (pair.forward, pair.backward)} if entry == "not a pair" else {}
    if entry == "unknown op":
        ops.pop("kl_penalty")
        autograd = {"kl_penalty": pair}
    load = lambda: BackendImpl(ops=ops, claims=frozenset(), autograd=autograd)  # noqa: E731
    plugins(_spec("odd", load=load))
    with pytest.raises(BackendError, match="autograd for"):
        selection.registry().load("odd", complete=False)


def test_unavailable_backends_are_passed_over(plugins):
    plugins(_spec("elsewhere", priority=1000, available=(False, "no such accelerator")))
    assert rlk.current_backend("cpu") == "triton"


def test_auto_never_picks_reference_where_another_backend_serves_the_device(plugins):
    assert rlk.current_backend("meta") == "reference"  # nothing else serves meta tensors
    plugins(_spec("meta_only", devices=("meta",), available=(False, "no meta hardware")))
    with pytest.raises(BackendError) as e:
        rlk.current_backend("meta")
    msg = str(e.value)
    assert "meta_only: no meta hardware" in msg and "'reference' backend is not picked" in msg
    assert "RLK_BACKEND=<name>" in msg
    with rlk.use_backend("reference"):  # an explicit choice still works
        assert rlk.current_backend("meta") == "reference"


def test_env_var_and_context_manager(plugins, monkeypatch):
    plugins(_spec("alpha", priority=-5), _spec("beta", priority=-6))
    monkeypatch.setenv("RLK_BACKEND", "beta")
    assert rlk.current_backend("cpu") == "beta"
    with rlk.use_backend("alpha"):
        assert rlk.current_backend("cpu") == "alpha"
        with rlk.use_backend("beta"):
            assert rlk.current_backend("cpu") == "beta"
        assert rlk.current_backend("cpu") == "alpha"
    assert rlk.current_backend("cpu") == "beta"


def test_use_backend_is_per_thread(plugins):
    plugins(_spec("alpha", priority=-5))
    seen = {}
    with rlk.use_backend("alpha"):
        t = threading.Thread(target=lambda: seen.setdefault("other", rlk.current_backend("cpu")))
        t.start()
        t.join()
        assert rlk.current_backend("cpu") == "alpha"
    assert seen["other"] != "alpha"


def test_a_plugin_op_returning_a_non_tensor_is_named(plugins):
    ops = _reference_ops()
    plugins(_spec("odd", priority=-1, ops={**ops, "rms_norm": lambda *a, **kw: [1, 2]}))
    with rlk.use_backend("odd"):
        with pytest.raises(
            TypeError, match=r"'odd' \(distribution 'test-dist'\).*'rms_norm'.*list"
        ):
            rlk.rms_norm(torch.randn(3, 8), torch.ones(8))
        loss, metrics = rlk.policy_loss(*[torch.randn(2, 3)] * 2, torch.randn(2), torch.ones(2, 3))
    assert loss.dim() == 0 and metrics  # results of every form an op has pass


def test_ops_dispatch_to_the_selected_backend(plugins):
    calls = []
    ops = _reference_ops()

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return ops["silu_and_mul"](*args, **kwargs)

    plugins(_spec("spy", priority=-1, ops={**ops, "silu_and_mul": spy}))
    with rlk.use_backend("spy"):
        y = rlk.silu_and_mul(torch.randn(2, 3, 8))
    assert y.shape == (2, 3, 4)
    assert calls == [(6, 8)]  # leading dims flattened for the backend


def _cli(*args, env=None):
    e = {k: v for k, v in os.environ.items() if k != "RLK_BACKEND"}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "rlk.cli", *args], capture_output=True, text=True, env=e, timeout=300
    )


def test_cli_info_lists_backends():
    r = _cli("info")
    assert r.returncode == 0, r.stderr
    for name in ("reference", "triton", "cuda", "rocm", "ascend"):
        assert name in r.stdout


def test_cli_info_json():
    import json

    r = _cli("info", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    names = {b["name"]: b for b in d["backends"]}
    assert names["reference"]["available"] is True
    assert "torch" in d["versions"]


@pytest.mark.skipif(bool(torch.version.hip), reason="rocm is available on ROCm builds")
def test_cli_info_with_an_unavailable_choice_still_prints_the_table():
    r = _cli("info", env={"RLK_BACKEND": "rocm"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "selected: none (RLK_BACKEND=rocm)" in r.stdout
    assert "not a ROCm build" in r.stdout and "not a ROCm build" in r.stderr
    for name in ("reference", "triton", "cuda", "rocm", "ascend"):
        assert name in r.stdout


def test_cli_info_shows_broken_plugins(monkeypatch, capsys):
    from rlk import cli

    monkeypatch.delenv("RLK_BACKEND", raising=False)
    try:
        selection.reset_registry(extra_plugins=[fake_backends.Misbehaving("load_raises")])
        assert cli.main(["info"]) == 2  # auto cannot choose: its first choice is broken
        out, err = capsys.readouterr()
        assert "fake_load_raises" in out and "broken: " in out and "boom: load" in out
        assert "reference" in out and "triton" in out
        assert "boom: load" in err and err.count("\n") == 1
    finally:
        selection.reset_registry()


def test_cli_unknown_backend_is_one_paragraph_without_traceback():
    r = _cli("info", env={"RLK_BACKEND": "nope"})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "Installed backends: " in r.stderr


def test_vendor_tables_are_registered_by_entry_point():
    # rlk_triton imports no vendor package: rlk-cuda and rlk-rocm declare their tables under
    # the entry-point group "rlk_triton.tables", and the kit's configs cover all of them.
    import rlk_cuda.tables
    import rlk_rocm.tables
    from rlk_triton import backend

    tables = backend.vendor_tables()
    assert tables["cuda"] is rlk_cuda.tables.NVIDIA and tables["rocm"] is rlk_rocm.tables.CDNA3
    checked = [cfg for sets in backend.all_op_configs("linear") for cfg in sets.values()]
    for key, rule in rlk_rocm.tables.CDNA3.items():
        for cfg in rule.configs:
            assert cfg in checked, (key, cfg)


def test_a_vendor_table_that_fails_to_load_is_an_error(monkeypatch):
    import importlib.metadata as md

    from rlk_triton import backend

    bad = md.EntryPoint("broken", "rlk_no_such_module.tables:X", backend.TABLES_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group: [bad] if group else [])
    with pytest.raises(RuntimeError, match="tuning table 'broken'.*failed to load"):
        backend.known_tables()
