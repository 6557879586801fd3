"""The conformance kit (rlk.testing, ``rlk conformance``): it passes a correct backend and
catches broken ones (tests/fake_backends.py), each with a FAIL on exactly the broken guarantee."""

from __future__ import annotations

import json

import fake_backends
import pytest
import torch

import rlk
from rlk import cli, plugins, selection, testing
from rlk.testing import cases, checks


@pytest.fixture
def fakes(monkeypatch):
    """The fake backends registered through a pluggy plugin; the real registry afterwards."""
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    selection.reset_registry(extra_plugins=[fake_backends])
    yield
    selection.reset_registry()


def _status(report, op, check):
    return report.row(op, check).status


@pytest.fixture(scope="module")
def reference_report():
    selection.reset_registry()
    return testing.run_conformance(backend="reference", device="cpu")


def test_reference_passes_accuracy_and_skips_what_it_does_not_claim(reference_report):
    r = reference_report
    assert r.ok, testing.format_table(r)
    assert r.backend == "reference" and r.claims == ["accuracy"]
    assert [row.op for row in r.rows if row.check == "accuracy"] == list(testing.KIT_OPS)
    for row in r.rows:
        if row.check == "accuracy":
            assert row.status == "pass", row.detail
        else:
            assert (row.status, row.detail) == ("skip", "not claimed by backend")
    lin = r.row("linear", "accuracy")
    assert 0 < lin.max_err < 0.1 and 0 < lin.rel_rms < 1e-2  # errors are measured, not zero
    assert r.counts() == {"pass": 17, "fail": 0, "skip": 68}
    assert r.seconds < 30


def test_table_and_dict(reference_report):
    table = testing.format_table(reference_report)
    assert "backend 'reference'" in table
    assert table.splitlines()[-1].startswith("17 passed, 0 failed, 68 skipped")
    assert "not claimed by backend: 68 checks" in table
    d = reference_report.to_dict()
    json.dumps(d)  # serialisable
    assert d["ok"] and d["summary"] == {"pass": 17, "fail": 0, "skip": 68}
    assert d["tolerances"] == testing.TOLERANCES and len(d["rows"]) == 85


def test_batch_dependent_backend_fails_batch_invariance_only(fakes):
    ops = ["linear", "rms_norm", "logprobs", "kl_penalty", "gae_advantages"]
    r = testing.run_conformance(backend="fake_batchdep", ops=ops, device="cpu")
    assert not r.ok
    for op in ops:
        assert _status(r, op, "accuracy") == "pass"  # an ulp is within tolerance
        row = r.row(op, "batch_invariance")
        assert row.status == "fail" and "alone" in row.detail and row.max_err > 0
        assert _status(r, op, "determinism") == "skip"
    assert "FAIL" in testing.format_table(r)


def test_nondeterministic_backend_fails_determinism(fakes):
    r = testing.run_conformance(backend="fake_nondet", ops=["linear", "attention"], device="cpu")
    for op in ("linear", "attention"):
        assert _status(r, op, "accuracy") == "pass"
        row = r.row(op, "determinism")
        assert row.status == "fail" and "run 2" in row.detail
    # weight gradients are compared too
    assert any("grad.weight" in f for f in r.row("linear", "determinism").failures)
    assert _status(r, "linear", "batch_invariance") == "skip"


def test_tuning_dependent_backend_fails_tuning_invariance(fakes):
    r = testing.run_conformance(
        backend="fake_tuning", ops=["linear", "rms_norm", "silu_and_mul"], device="cpu"
    )
    row = r.row("linear", "tuning_invariance")
    assert row.status == "fail" and "BLOCK_M': 32" in row.detail
    assert _status(r, "rms_norm", "tuning_invariance") == "pass"  # harmless configs pass
    row = r.row("silu_and_mul", "tuning_invariance")
    assert (row.status, row.detail) == ("skip", "no tunable kernels")


def test_tuning_dependent_value_loss_fails_tuning_invariance(fakes):
    r = testing.run_conformance(backend="fake_tuning", ops=["value_loss"], device="cpu")
    assert _status(r, "value_loss", "accuracy") == "pass"
    row = r.row("value_loss", "tuning_invariance")
    assert row.status == "fail" and "BLOCK_M': 32" in row.detail


def test_path_dependent_backend_fails_path_invariance(fakes):
    ops = ["attention", "paged_attention", "rms_norm", "linear_logprobs"]
    r = testing.run_conformance(backend="fake_pathdep", ops=ops, device="cpu")
    for op in ops:
        assert _status(r, op, "path_invariance") == "fail", op
        assert _status(r, op, "accuracy") == "skip"  # not claimed
    att = r.row("attention", "path_invariance").failures
    assert any("decode" in f for f in att) and any("chunk" in f for f in att)
    assert not any("prefill of" in f for f in att)  # nq == nk calls are not perturbed


def test_reordered_moe_combine_fails_path_invariance_only(fakes):
    """Summing the experts in descending rank order is accurate and batch-invariant, and not
    the contract's order: the combine-order check catches it."""
    r = testing.run_conformance(backend="fake_moe_order", ops=["moe_experts"], device="cpu")
    assert _status(r, "moe_experts", "accuracy") == "pass"
    assert _status(r, "moe_experts", "batch_invariance") == "pass"
    row = r.row("moe_experts", "path_invariance")
    assert row.status == "fail" and "combine" in row.detail


def test_grouped_router_breaking_ties_by_arrival_order_fails_accuracy(fakes):
    """DeepSeek-V3's router with ties of experts and of groups to the later index is accurate
    and batch-invariant, and chooses other experts on the tie cases: the kit's accuracy check
    (indices exactly the oracle's) catches it; the float64 oracle and rlk-triton pass."""
    r = testing.run_conformance(backend="fake_route_ties", ops=["moe_route_grouped"], device="cpu")
    row = r.row("moe_route_grouped", "accuracy")
    assert row.status == "fail" and "differ" in row.detail, row.detail
    assert _status(r, "moe_route_grouped", "batch_invariance") == "pass"
    for backend in ("reference", "triton"):
        r = testing.run_conformance(backend=backend, ops=["moe_route_grouped"], device="cpu")
        assert r.ok, testing.format_table(r)


def test_optional_op_a_backend_lacks_is_skipped(fakes):
    r = testing.run_conformance(backend="fake_batchdep", ops=["moe_route"], device="cpu")
    assert (r.row("moe_route", "implemented").status, r.ok) == ("skip", True)


def test_missing_op_and_crashing_op_are_failures_and_the_run_goes_on(fakes):
    r = testing.run_conformance(
        backend="fake_broken", ops=["sample", "silu_and_mul", "linear"], device="cpu"
    )
    row = r.row("sample", "implemented")
    assert (row.status, row.detail) == ("fail", "not implemented")
    row = r.row("silu_and_mul", "accuracy")
    assert row.status == "fail" and "RuntimeError: boom" in row.detail
    assert _status(r, "linear", "accuracy") == "pass"
    table = testing.format_table(r)
    assert "FAIL: not implemented" in table and "2 failed" in table
    with pytest.raises(AssertionError, match="boom"):
        testing.assert_conformance("fake_broken", ops=["silu_and_mul"], device="cpu")


def test_cli_reference_passes_with_json(tmp_path, capsys):
    selection.reset_registry()
    out = tmp_path / "report.json"
    code = cli.main(["conformance", "--backend", "reference", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out
    assert "17 passed, 0 failed, 68 skipped" in captured.out
    assert "linear: accuracy pass" in captured.err  # progress, one line per op
    d = json.loads(out.read_text())
    assert d["ok"] and d["backend"] == "reference" and d["mode"] == "quick"
    assert {(row["op"], row["check"]) for row in d["rows"]} == {
        (op, c) for op in testing.KIT_OPS for c in plugins.GUARANTEES
    }


def test_cli_failing_backend_exits_1(fakes, capsys):
    code = cli.main(["conformance", "--backend", "fake_batchdep", "--ops", "linear", "--quiet"])
    captured = capsys.readouterr()
    assert code == 1
    assert "linear / batch_invariance" in captured.out and captured.err == ""


def test_cli_unknown_backend_or_op_exits_2(capsys):
    selection.reset_registry()
    assert cli.main(["conformance", "--backend", "nope"]) == 2
    assert "unknown rlk backend 'nope'" in capsys.readouterr().err
    assert cli.main(["conformance", "--backend", "reference", "--ops", "lienar"]) == 2
    assert "unknown ops ['lienar']" in capsys.readouterr().err


def test_runs_are_reproducible():
    selection.reset_registry()
    a = testing.run_conformance(backend="reference", ops=["rms_norm"], device="cpu")
    b = testing.run_conformance(backend="reference", ops=["rms_norm"], device="cpu")
    assert a.row("rms_norm", "accuracy").max_err == b.row("rms_norm", "accuracy").max_err


def test_bitwise_comparison_sees_signed_zero_and_one_ulp():
    x = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert checks.bits_equal(x, x.clone())
    assert not checks.bits_equal(x, torch.tensor([-0.0, 1.0], dtype=torch.bfloat16))
    assert not checks.bits_equal(x, fake_backends.ulp_up(x))
    assert not checks.bits_equal(x, x.float())


def test_accuracy_check_catches_a_real_error():
    case = cases.build("silu_and_mul", True, torch.device("cpu")).accuracy[:1]
    ref = fake_backends.REF_OPS["silu_and_mul"]
    off = lambda x: ref(x) * 1.05  # 5%: beyond the bf16 tolerance
    out = checks.accuracy(off, ref, case, None)
    assert out.status == "fail" and "rel RMS" in out.detail


def test_quick_shapes_are_small():
    dev = torch.device("cpu")
    for op in rlk.OPS:
        oc = cases.build(op, True, dev)
        for case in oc.accuracy + oc.invariance:
            for v in case.args.values():
                if isinstance(v, torch.Tensor):
                    assert v.numel() <= 64 * 1024, (op, case.label)


@pytest.mark.parametrize("op", ["linear", "rms_norm", "kl_penalty", "grpo_advantages"])
def test_triton_op_passes_every_claimed_check(op):
    """Real kernels (under the interpreter) pass: the invariance checks can pass, not only fail.
    (The whole triton backend: ``rlk conformance --backend triton``, about a minute here.)"""
    selection.reset_registry()
    impl = selection.registry().load("triton", complete=False)
    if op not in impl.ops:
        pytest.skip(f"rlk_triton has no {op} yet")
    r = testing.run_conformance(backend="triton", ops=[op], device="cpu")
    assert r.ok, testing.format_table(r)
    for check in ("accuracy", "batch_invariance", "determinism", "tuning_invariance"):
        assert _status(r, op, check) == "pass"


@pytest.mark.gpu
def test_gpu_backend_conformance_quick():
    """The vendor backend on the CI shapes, all ops (real shapes: ``rlk conformance --full``,
    the conformance stage of scripts/gpu_stages.sh)."""
    selection.reset_registry()
    backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    r = testing.run_conformance(backend=backend, device="cuda", quick=True, progress=print)
    print(testing.format_table(r))
    assert r.ok, testing.format_table(r)


def test_sample_accuracy_catches_wrong_draws():
    oc = cases.build("sample", True, torch.device("cpu"))
    ref = fake_backends.REF_OPS["sample"]
    argmax = lambda logits, seeds, offsets, **kw: logits.argmax(-1)  # ignores the sampling
    out = checks.accuracy(argmax, ref, oc.accuracy[:1], None)
    assert out.status == "fail" and "rows agree with the reference" in out.detail
    assert "greedy" not in out.detail  # greedy rows are right
    argmin = lambda logits, seeds, offsets, **kw: logits.argmin(-1)
    assert "greedy rows" in checks.accuracy(argmin, ref, oc.accuracy[:1], None).detail
