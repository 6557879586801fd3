"""``rlk bench``: the report, its ratios, merging and rendering, the CLI without a GPU, and rlk's
own families run end to end on CPU (tiny shapes, timing stubbed: speed is measured on GPUs only).
The e2e family is rlk-integrations' (its tests)."""

from __future__ import annotations

import json

import pytest
import torch

from rlk import bench, cli
from rlk.bench import timing as _timing


def _row(op, impl, ms, family="gemm", shape="s", dtype="bf16"):
    return {"family": family, **_timing.row(op, shape, dtype, impl, ms)}


def _report(rows, commit="abc", command="rlk bench"):
    meta = {
        "date": "2026-11-30T00:00:00+00:00",
        "commit": commit,
        "gpu": "NVIDIA H200",
        "versions": {"torch": "2.11"},
        "command": command,
        "copy_GBps": 4300.0,
        "cublas_bf16_TFLOPs": 790.0,
    }
    return {"meta": meta, "rows": rows, "failed": []}


def test_ratios_take_the_fastest_peer():
    rows = [
        _row("linear.fwd", "rlk", 2.0),
        _row("linear.fwd", "cublas", 1.0),
        _row("linear.fwd", "other", 0.5),
        _row("attention.fwd", "sdpa", 1.0, family="attention"),  # no rlk row: no ratio
    ]
    (r,) = bench.ratios(rows)
    assert r["peer"] == "other" and r["peer_over_rlk"] == pytest.approx(0.25)


def test_ratios_one_per_rlk_impl_never_a_peer():
    rows = [
        _row("e2e.train", "stock", 3.0, "e2e"),
        _row("e2e.train", "rlk", 4.0, "e2e"),
        _row("e2e.train", "rlk graphed", 1.5, "e2e"),
    ]
    a, b = bench.ratios(rows)
    assert (a["rlk_impl"], a["peer"], a["peer_over_rlk"]) == ("rlk", "stock", 0.75)
    assert (b["rlk_impl"], b["peer"], b["peer_over_rlk"]) == ("rlk graphed", "stock", 2.0)


def test_render_and_merge(tmp_path):
    a = _report([_row("linear.fwd", "rlk", 2.0), _row("linear.fwd", "cublas", 1.0)])
    b = _report([_row("e2e.train", "rlk", 4.0, "e2e"), _row("e2e.train", "stock", 5.0, "e2e")])
    b["meta"]["command"] = "rlk bench --only e2e"
    merged = bench.merge([a, b])
    assert len(merged["rows"]) == 4 and len(merged["meta"]["parts"]) == 2
    text = bench.render_markdown(merged)
    assert "| gemm   | linear.fwd | s     | rlk | cublas    | 0.50" in text
    assert "`rlk bench --only e2e`" in text and "(one process each, same machine)" in text
    with pytest.raises(ValueError, match="different commits"):
        bench.merge([a, _report([], commit="def")])
    c = _report([], commit="def")
    c["meta"]["command"] = "rlk bench --only norm"
    mixed = bench.merge([a, c], mixed_commits=True)
    assert [p["commit"] for p in mixed["meta"]["parts"]] == [a["meta"]["commit"], "def"]
    assert mixed["meta"]["commit_note"] == (
        "measured at other commits: `rlk bench --only norm` at `def`"
    )
    text = bench.render_markdown(mixed)
    # Parts of other commits ran at other times, maybe on other machines of the same kind.
    assert "measured at other commits" in text and "(one process each)" in text
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "m.json"
    assert cli.main(["bench", "--render", str(pa), str(pb), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == merged["rows"]


def test_each_gpu_kind_has_its_own_record(tmp_path, monkeypatch):
    """The kind names the record (h100.json on an H100); parts of two kinds never merge; with
    no file named, --render writes the parts' kind's record under docs/benchmarks."""
    assert bench.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.gpu_kind("NVIDIA H200") == "h200"
    assert bench.gpu_kind("NVIDIA A100-SXM4-80GB") == "a100"
    assert bench.gpu_kind("AMD Instinct MI300X") == "mi300x"
    assert bench.gpu_kind("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    h200 = _report([_row("linear.fwd", "rlk", 2.0)])
    h100 = _report([_row("linear.fwd", "cublas", 1.0)])
    h100["meta"]["gpu"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="different GPU kinds"):
        bench.merge([h200, h100])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "part.json").write_text(json.dumps(h100))
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    assert cli.main(["bench", "--render", "part.json", "--json", "--markdown"]) == 0
    record = json.loads((tmp_path / "docs" / "benchmarks" / "h100.json").read_text())
    assert record["rows"] == h100["rows"] and record["meta"]["gpu"].startswith("NVIDIA H100")
    md = (tmp_path / "docs" / "benchmarks" / "h100.md").read_text()
    assert md.startswith("# Benchmarks: NVIDIA H100 80GB HBM3")
    assert not (tmp_path / "docs" / "benchmarks" / "h200.json").exists()


def test_merge_into_a_merged_report_keeps_its_parts_and_replaces_rows_measured_again():
    """The committed report is itself merged: its parts stay listed with their commits, a row
    measured again comes from the newer part, and a part with no row left leaves the list."""
    a = _report([_row("linear.fwd", "rlk", 2.0)], commit="aaa")
    a["meta"]["command"] = "rlk bench --only gemm"
    b = _report([_row("e2e.train", "rlk", 4.0, "e2e")], commit="bbb")
    b["meta"]["command"] = "rlk bench --only e2e"
    oom = {"family": "e2e", "op": "e2e.train", "shape": "s", "dtype": "bf16",
           "impl": "stock", "left_out": "OutOfMemoryError"}  # fmt: skip
    b["left_out"] = [oom]
    b2 = _report([], commit="bbb")  # a second e2e process of that run, whose rows b holds
    b2["meta"]["command"] = "rlk bench --only e2e --json other.json"
    old = bench.merge([a, b, b2], mixed_commits=True)
    assert len(old["meta"]["parts"]) == 3
    c = _report([_row("e2e.train", "rlk", 3.0, "e2e")], commit="ccc")
    c["meta"]["command"] = "rlk bench --only e2e"
    c["left_out"] = [dict(oom, left_out="OutOfMemoryError: again")]
    d = _report([_row("moe_layer.fwd", "rlk", 1.0, "moe")], commit="ccc")
    d["meta"]["command"] = "rlk bench --only moe"
    new = bench.merge([old, c, d], mixed_commits=True)
    assert [(p["command"], p["commit"]) for p in new["meta"]["parts"]] == [
        ("rlk bench --only gemm", "aaa"),
        ("rlk bench --only e2e", "ccc"),
        ("rlk bench --only moe", "ccc"),
    ]
    assert [(r["op"], r["ms"]) for r in new["rows"]] == [
        ("linear.fwd", 2.0),
        ("e2e.train", 3.0),
        ("moe_layer.fwd", 1.0),
    ]
    assert [r["left_out"] for r in new["left_out"]] == ["OutOfMemoryError: again"]
    measured = bench.merge([new, _report([_row("e2e.train", "stock", 9.0, "e2e")], "ddd")],
                           mixed_commits=True)  # fmt: skip
    assert measured["left_out"] == []
    assert (
        new["meta"]["commit"] == "aaa"
        and "`rlk bench --only e2e` at `ccc`" in (new["meta"]["commit_note"])
    )


def test_a_peer_that_raises_is_recorded_as_left_out(on_cpu, monkeypatch):
    """A failing peer gets no row but a left_out record with its error, through run(), merge()
    and the Markdown; an error of rlk's own propagates."""
    from rlk.bench import _peers

    def family(quick, emit):
        _peers.measure(emit, "x.fwd", "T=1", "bf16", "rlk", lambda: None, nbytes=1)

        def oom():
            raise MemoryError("out of memory\nmore lines")

        _peers.measure(emit, "x.fwd", "T=1", "bf16", "compile", oom, nbytes=1)

    monkeypatch.setattr(bench, "family_module", lambda name: type("M", (), {"run": family}))
    left: list[dict] = []
    rows, failed = bench.run(["norm"], True, left_out=left)
    assert [r["impl"] for r in rows] == ["rlk"] and failed == []
    assert left == [{"family": "norm", "op": "x.fwd", "shape": "T=1", "dtype": "bf16",
                     "impl": "compile", "left_out": "MemoryError: out of memory"}]  # fmt: skip
    a, b = _report(rows), _report([])
    a["left_out"] = left
    merged = bench.merge([a, b])
    assert merged["left_out"] == left
    assert "- left out (the peer raised): `compile` at x.fwd T=1: MemoryError: out of memory" in (
        bench.render_markdown(merged)
    )
    with pytest.raises(RuntimeError, match="own"):
        _peers.measure(print, "x.fwd", "T=1", "bf16", "rlk", _raise_own, nbytes=1)


def _raise_own():
    raise RuntimeError("rlk's own error")


def test_cli_without_a_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--quick"]) == 2
    assert (
        capsys.readouterr().err
        == "rlk: error: rlk bench needs a CUDA/ROCm GPU, and this torch sees none\n"
    )
    assert cli.main(["bench", "--only", "nosuch"]) == 2
    assert "unknown families ['nosuch']" in capsys.readouterr().err


def test_a_family_of_a_missing_distribution_says_what_to_install(capsys, monkeypatch):
    """Without rlk-integrations (no entry point in the group rlk.bench) the e2e family is not
    run by default, and asking for it is an error naming what to install."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert bench.available() == ["gemm", "attention", "norm", "logprobs", "sampling", "moe"]
    with pytest.raises(ValueError, match=r"e2e family comes with rlk-integrations"):
        bench.family_module("e2e")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["bench", "--only", "gemm,e2e"]) == 2
    err = capsys.readouterr().err
    assert err == (
        'rlk: error: the e2e family comes with rlk-integrations (pip install "rlk[transformers]")\n'
    )


@pytest.fixture
def on_cpu(monkeypatch):
    """Families allocate on the CPU and each timed function runs twice (for real) instead of
    being timed."""
    monkeypatch.setattr(_timing, "DEVICE", "cpu")

    def run_twice(fn, **_):
        fn()
        fn()
        return 1.0, "events"

    monkeypatch.setattr(_timing, "time_call", run_twice)
    monkeypatch.setattr(_timing, "eager_call_us", lambda fn: run_twice(fn)[0])


def _run(monkeypatch, module, **shapes):
    rows = []
    for name, value in shapes.items():
        monkeypatch.setattr(module, name, value)
    module.run(quick=True, emit=rows.append)
    return rows


def test_gemm_family_runs(on_cpu, monkeypatch):
    from rlk.bench import gemm

    monkeypatch.setattr(gemm, "BACKWARD", [("t", 8, 64, 32)])
    rows = _run(monkeypatch, gemm, QUICK_SHAPES=[("t", 64, 32)], QUICK_MS=[1, 8])
    assert {(r["op"], r["impl"]) for r in rows} == {
        (op, impl)
        for op in ("linear.fwd", "linear.eager_call", "linear.fwd+bwd")
        for impl in ("rlk", "cublas")
    }


def test_attention_family_runs(on_cpu, monkeypatch):
    from rlk.bench import attention

    monkeypatch.setattr(attention, "QUICK_DECODE", [(2, 32, 4, 2, 16, 8)])
    rows = _run(monkeypatch, attention, QUICK_SHAPES=[(2, 16, 4, 2, 16)])
    impls = {(r["op"], r["impl"]) for r in rows}
    assert ("attention.fwd+bwd", "rlk") in impls and ("attention.fwd", "sdpa") in impls
    assert ("paged_attention.decode", "rlk") in impls


def _rlk_ops(rows):
    return {r["op"] for r in rows if r["impl"] == "rlk"}


def test_norm_family_runs(on_cpu, monkeypatch):
    from rlk.bench import norm

    shapes = {"rms_norm": [(8, 64)], "silu_and_mul": [(8, 32)], "apply_rotary": [(8, 4, 2, 16)]}
    rows = _run(monkeypatch, norm, SHAPES=shapes)
    assert _rlk_ops(rows) == {
        f"{op}.{p}"
        for op in ("rms_norm", "rms_norm_residual", "silu_and_mul", "apply_rotary")
        for p in ("fwd", "fwd+bwd")
    }
    assert {r["impl"] for r in rows} >= {"rlk", "compile"}


def test_logprobs_and_sampling_families_run(on_cpu, monkeypatch):
    from rlk.bench import logprobs, sampling

    shapes = {"logprobs": [(8, 512)], "linear_logprobs": [(8, 64, 512)]}
    rows = _run(monkeypatch, logprobs, SHAPES=shapes)
    assert _rlk_ops(rows) == {
        "logprobs.fwd",
        "logprobs.fwd+bwd",
        "logprobs_entropy.fwd",
        "logprobs_entropy.fwd+bwd",
        "linear_logprobs.fwd+bwd",
    }
    rows = _run(monkeypatch, sampling, SHAPES=[(4, 512)])
    assert _rlk_ops(rows) == {"sample.temperature", "sample.top_k_top_p"}
    assert {r["impl"] for r in rows} >= {"rlk", "torch"}


def test_memory_and_roofline_columns_only_where_measured():
    rows = [
        {"family": "logprobs", "op": "linear_logprobs.fwd+bwd", "shape": "s", "dtype": "bf16",
         "impl": impl, "ms": 2.0, "timing": "events", "extra_GiB": gib}
        for impl, gib in (("rlk", 1.25), ("liger", 1.5))
    ]  # fmt: skip
    text = bench.format_family(rows, "logprobs")
    header = text.splitlines()[0]
    assert "extra_GiB" in header and "1.25" in text and "1.5" in text
    for r in rows:
        del r["extra_GiB"]
    assert "extra_GiB" not in bench.format_family(rows, "logprobs")
    assert "hbm_roofline" not in header
    rows[0]["hbm_roofline"] = 0.523
    text = bench.format_family(rows, "logprobs")
    assert "hbm_roofline" in text.splitlines()[0] and "0.523" in text


#: Tiny Qwen3-MoE and DeepSeek-V3 layers (hidden, 8 experts, 2 per token, intermediate; the
#: DeepSeek one in 4 groups of 2, the best 2 kept).
_TINY_MOE = {"qwen3": (32, 8, 2, 32, None), "deepseek": (32, 8, 2, 32, (4, 2))}


def test_moe_family_runs(on_cpu, monkeypatch):
    pytest.importorskip("transformers")
    from rlk.bench import moe

    layers = [moe.Layer(name, *dims) for name, dims in _TINY_MOE.items()]
    rows = _run(monkeypatch, moe, LAYERS=layers, QUICK_TOKENS=[8])
    assert {(r["op"], r["impl"], r["shape"].split("(")[1]) for r in rows} == {
        (op, impl, f"{name})")
        for op in ("moe_layer.fwd", "moe_layer.fwd+bwd")
        for impl in ("rlk", "stock", "stock-grouped_mm")
        for name in _TINY_MOE
    }


@pytest.mark.parametrize("name", list(_TINY_MOE))
def test_moe_layers_compute_the_stock_function(on_cpu, name):
    """rlk's layer and transformers' (both experts implementations) are one function of the
    same weights: the same experts chosen, weights and outputs equal to bf16 rounding."""
    pytest.importorskip("transformers")
    from rlk.bench import moe

    layer = moe.Layer(name, *_TINY_MOE[name])
    p = moe.make_params(layer)
    x = _timing.randn(16, layer.hidden, dtype=torch.bfloat16)
    got = moe.rlk_layer(layer, x, p)
    blocks = moe.stock_blocks(layer, p)
    for impl, block in blocks.items():
        want = block(x.view(1, *x.shape)).view(x.shape)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * want.float().abs().max().item(), (impl, err)
    # The routing itself: the same experts (as sets: transformers' top-k order is unspecified)
    # and their weights (Qwen3-MoE's rounded to bf16 by transformers).
    w, idx = moe.rlk_route(layer, x, p)
    _, want_w, want_idx = blocks["stock"].gate(x)
    order, want_order = idx.sort(-1), want_idx.sort(-1)
    assert torch.equal(order.values, want_order.values)
    want_w = want_w.gather(1, want_order.indices)
    torch.testing.assert_close(w.gather(1, order.indices).to(want_w.dtype), want_w)
