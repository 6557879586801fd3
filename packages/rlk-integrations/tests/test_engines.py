"""Rollout engines (:mod:`rlk_integrations.engine.engines`): the registry gives the CLI's choices
and builds every engine; each engine gives its function's bits through the protocol; an engine that
cannot run here is named with its reason, never dropped silently."""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

import rlk_integrations_cli  # noqa: E402
from rlk import cli  # noqa: E402
from rlk_integrations.engine import engines, paged, rollout  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402

CPU = torch.device("cpu")


class _Unrunnable:
    """An engine whose library is missing."""

    name = "nolib"

    def __init__(self, options):
        self.options = options

    def unavailable(self, device):
        return "nolib is not installed"

    def generate(self, *args, **kwargs):
        raise AssertionError("an unavailable engine was run")


@pytest.fixture
def nolib(monkeypatch):
    mod = types.ModuleType("_rlk_test_nolib_engine")
    mod.Engine = _Unrunnable
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(
        rlk_integrations_cli.ROLLOUT_ENGINES, "nolib", (f"{mod.__name__}:Engine", "a stand-in")
    )


def test_registry_builds_every_engine_and_gives_the_cli_choices():
    assert engines.names() == tuple(rlk_integrations_cli.ROLLOUT_ENGINES)
    opts = engines.RolloutOptions(page_size=4, max_batch=2)
    for name in engines.names():
        engine = engines.create(name, opts)
        why = engine.unavailable(CPU)
        assert engine.name == name and (why is None or (isinstance(why, str) and why))
    found, skipped = engines.available(None, CPU)
    assert sorted([e.name for e in found] + list(skipped)) == sorted(engines.names())
    assert {"padded", "paged"} <= {e.name for e in found}  # this package's, on any machine
    with pytest.raises(ValueError, match="unknown rollout engine 'nosuch'; registered: padded"):
        engines.create("nosuch")
    with pytest.raises(TypeError, match="RolloutOptions"):
        engines.create("paged", {"page_size": 4})
    # The choices of --rollout-mode are the registry's names and its groups.
    parser = cli_parser()
    action = next(a for a in parser._actions if a.dest == "rollout_mode")
    assert tuple(action.choices) == (*engines.names(), *rlk_integrations_cli.ROLLOUT_GROUPS)
    assert action.default == "all"


def cli_parser():
    import argparse

    parser = argparse.ArgumentParser()
    rlk_integrations_cli._add_arguments(parser)
    return parser


def test_a_misnamed_engine_is_refused(monkeypatch):
    monkeypatch.setitem(
        rlk_integrations_cli.ROLLOUT_ENGINES,
        "other",
        ("rlk_integrations.engine.paged:PagedRollout", ""),
    )
    with pytest.raises(TypeError, match="registered as 'other' but is named 'paged'"):
        engines.create("other")


def test_an_engine_that_cannot_run_says_why(nolib, capsys, monkeypatch):
    found, skipped = engines.available(None, CPU)
    assert "nolib" not in [e.name for e in found]
    # (vllm, without vLLM installed, is set aside too, with its own reason)
    assert skipped["nolib"] == "nolib is not installed" and set(skipped) <= {"nolib", "vllm"}
    # Asked for by name: a usage error carrying the reason, before any model is built.
    monkeypatch.setattr(consistency, "_run", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(consistency.UsageError, match="'nolib' cannot run here: nolib is not in"):
        consistency.run("tiny", rollout_modes=("nolib",))
    # By default (all), the report names it and the table prints why.
    report = dict(model="tiny", model_type="qwen2", dtype="bfloat16", device="cpu", backend="x",
                  prompts=1, new_tokens=1, micro_batch=1, rows=[],
                  rollout_skipped={"nolib": skipped["nolib"]})  # fmt: skip
    assert "rollout engine nolib not run: nolib is not installed" in consistency.format_table(
        report
    )


def test_an_engine_refuses_a_layout_it_cannot_sample_with(monkeypatch):
    # The options carry the run's rlk layout; vllm runs unsharded rlk ops (leaves served, TP 1)
    # and says so, so that rlk consistency needs no rule of its own for it (by name: a usage
    # error; all: skipped).
    import rlk_integrations.adapters.vllm as rv

    monkeypatch.setattr(rv, "check_vllm", lambda: rv.TESTED_VLLM)  # as if vLLM were installed
    tp2 = engines.RolloutOptions(leaves=8, tp=2)
    assert "runs unsharded rlk ops" in engines.create("vllm", tp2).unavailable(CPU)
    assert engines.create("paged", tp2).unavailable(CPU) is None
    assert engines.create("vllm", engines.RolloutOptions(leaves=8)).unavailable(CPU) is None
    assert engines.create("vllm").unavailable(CPU) is None
    monkeypatch.setattr(consistency, "_run", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(consistency.UsageError, match="'vllm' cannot run here: runs unsharded"):
        consistency.run("tiny", rollout_modes=("vllm",), leaves=8, rollout_tp=2)


def test_stock_twins():
    # The stock side runs an engine's stock counterpart beside the padded baseline: vLLM's own
    # kernels for vllm, where its CPU attention takes the model's head_dim; none for the others.
    from transformers import Qwen2Config

    model = types.SimpleNamespace(config=Qwen2Config(hidden_size=64, num_attention_heads=4))
    assert engines.create("vllm").stock_twin(model, CPU) == (
        "vLLM's CPU attention takes head_dim (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), "
        "not 16"
    )
    twin = engines.create("vllm").stock_twin(model, torch.device("cuda"))
    assert twin.name == "vllm-stock" and twin.stock
    for name in ("padded", "paged"):
        assert engines.create(name).stock_twin(model, CPU) is None


@pytest.fixture(scope="module")
def model():
    return rt.patch_model(zoo.load_model("tiny", dtype=torch.bfloat16))


def test_engines_give_their_functions_bits(model):
    prompts, seeds = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [3, 1, 2]
    want = rollout.generate(model, prompts, 3, seeds=seeds, temperature=0.7)
    opts = engines.RolloutOptions(page_size=2, max_batch=2)
    for engine in engines.available(None, CPU, opts)[0]:  # the others: where they run
        name = engine.name
        got = engine.generate(model, prompts, 3, seeds, temperature=0.7)
        assert got.logits_dtype == want.logits_dtype and got.new_tokens == 9
        for a, b in zip(want.samples, got.samples):
            assert (a.prompt, a.response, a.seed) == (b.prompt, b.response, b.seed), name
            assert torch.equal(a.logprobs, b.logprobs), name


def test_paged_rollout_keeps_its_engine_for_the_calls_it_fits(model):
    engine = paged.PagedRollout(engines.RolloutOptions(page_size=4))
    engine.generate(model, [[1, 2, 3], [4]], 3, [0, 1])
    kept = engine._kept
    assert kept.max_len == 6 and kept.max_batch == 2
    engine.generate(model, [[5], [6, 7]], 2, [0, 1])  # fits: the same cache
    assert engine._kept is kept
    engine.generate(model, [[5], [6, 7]], 2, [0, 1], temperature=0.5)  # other sampling
    assert engine._kept is not kept
    kept = engine._kept
    engine.generate(model, [[1, 2, 3, 4, 5, 6]], 1, [0], temperature=0.5)  # other batch
    assert engine._kept is not kept


def test_cli_all_is_the_default(monkeypatch):
    seen = {}

    def fake_run(*args, **kwargs):
        seen.update(kwargs)
        raise consistency.UsageError("stop")

    monkeypatch.setattr(consistency, "run", fake_run)
    assert cli.main(["consistency"]) == 2
    assert seen["rollout_modes"] is None  # every engine that can run here
    assert cli.main(["consistency", "--rollout-mode", "both"]) == 2
    assert seen["rollout_modes"] == ("padded", "paged")
    assert cli.main(["consistency", "--rollout-mode", "paged"]) == 2
    assert seen["rollout_modes"] == ("paged",)
