"""``rlk bench``'s e2e and e2e-long families (rollout and training engines, the GRPO step; the
long rollouts) run end to end on the tiny model on CPU: their own wall-clock timing is kept (on
CPU it only has to run); every row the result file's readers look for comes out."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from rlk.bench import timing  # noqa: E402
from rlk_integrations.tools import e2e_bench, e2e_common  # noqa: E402


def test_e2e_family_runs(monkeypatch):
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    shapes = dict(
        QUICK_MODELS=("tiny",),
        QUICK_BATCHES=(2,),
        QUICK_NEW_TOKENS=2,
        QUICK_TRAIN_SEQS=2,
        QUICK_TRAIN_LEN=8,
        PROMPT_LEN=(3, 5),
        QUICK_LONG_PROMPT_LEN=(6, 8),
        QUICK_LONG_NEW_TOKENS=3,
        QUICK_GRPO_PROMPTS=2,
        GRPO_GROUP=2,
        GRPO_MICRO_BATCH=2,
    )
    for name, value in shapes.items():
        monkeypatch.setattr(e2e_bench, name, value)
    monkeypatch.setattr(e2e_common, "TRAIN_ITERS", 1)
    # The CPU has no copy bandwidth measured: a made-up one (100 kB/s, so that the tiny
    # model's share is far from 0), so that the paged rows' roofline share is computed as on
    # CUDA.
    monkeypatch.setattr(e2e_bench, "_copy_GBps", lambda device: 1e-4)
    rows = []
    e2e_bench.run(quick=True, emit=rows.append)
    long = []
    e2e_bench.LONG.run(quick=True, emit=long.append)
    got = {(r["op"], r["impl"]) for r in rows}
    assert got >= {
        ("e2e.rollout.padded", "hf-generate"),
        ("e2e.rollout.padded", "hf-generate-static"),
        ("e2e.rollout.padded", "rlk"),
        ("e2e.rollout.paged", "hf-generate"),
        ("e2e.rollout.paged", "hf-generate-static"),
        ("e2e.rollout.paged", "rlk"),
        ("e2e.train", "stock"),
        ("e2e.train", "rlk"),
        ("e2e.grpo_step", "stock"),
        ("e2e.grpo_step", "rlk"),
    }
    assert all(r["tok_s"] > 0 for r in rows + long)
    # The static-cache peer: its own run (transformers compiles no decode step on a CPU), the
    # other op's row a copy of it; the paged rows alone give the roofline share.
    static = [r for r in rows + long if r["impl"] == "hf-generate-static"]
    assert {(r["cache"], r["decode_compiled"]) for r in static} == {("static", False)}
    assert all(r["first_run_ms"] > 0 for r in static)
    assert sum("same_run_as" not in r for r in static) == 2  # one run per shape
    for r in rows + long:
        paged = (r["op"], r["impl"]) == ("e2e.rollout.paged", "rlk")
        assert ("hbm_roofline" in r) == paged, r
        if paged:
            share = r["decode_bytes"] / 1e5 / (r["ms"] / 1e3)
            assert r["hbm_roofline"] == round(share, 3) and r["hbm_roofline"] > 0
    # The e2e-long family: the long setting, the paged engine and its hf-generate peers only.
    assert not any("prompt=6-8 new=3" in r["shape"] for r in rows)
    assert all("prompt=6-8 new=3" in r["shape"] for r in long)
    assert {(r["op"], r["impl"]) for r in long} == {
        ("e2e.rollout.paged", "hf-generate"),
        ("e2e.rollout.paged", "hf-generate-static"),
        ("e2e.rollout.paged", "rlk"),
    }
    # A GRPO step samples every completion of every group in full.
    assert {r["new_tokens"] for r in rows if r["op"] == "e2e.grpo_step"} == {2 * 2 * 2}


def test_heldout_family_and_model_filter(monkeypatch):
    # The held-out family gives the training rows (every impl the CPU has) of its models, and
    # RLK_E2E_MODELS keeps only the models it names; a name the family lacks is an error.
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    for name, value in dict(
        HELDOUT_MODELS=("tiny", "tiny-llama"), QUICK_TRAIN_SEQS=2, QUICK_TRAIN_LEN=8
    ).items():
        monkeypatch.setattr(e2e_bench, name, value)
    monkeypatch.setattr(e2e_common, "TRAIN_ITERS", 1)
    monkeypatch.setenv("RLK_E2E_MODELS", "tiny-llama")
    rows = []
    e2e_bench.HELDOUT_FAMILY.run(quick=True, emit=rows.append)
    assert {r["op"] for r in rows} == {"e2e.train"}
    assert {r["shape"] for r in rows} == {"tiny-llama 2x8"}
    assert {"stock", "rlk"} <= {r["impl"] for r in rows}
    monkeypatch.setenv("RLK_E2E_MODELS", "tiny-qwen3")
    with pytest.raises(ValueError, match="RLK_E2E_MODELS"):
        e2e_bench.HELDOUT_FAMILY.run(quick=True, emit=rows.append)


def test_train_long_family_rows_and_a_stock_peer_out_of_memory(monkeypatch):
    # Every (model, shape) gives its training rows; a stock peer that runs out of memory is left
    # out (a left_out record says why) and rlk's rows still come; rlk's own failure is raised.
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(e2e_bench, "TRAIN_LONG_MODELS", ("tiny",))
    monkeypatch.setattr(e2e_bench, "QUICK_TRAIN_LONG_SHAPES", ((1, 8), (2, 4)))
    monkeypatch.setattr(e2e_common, "TRAIN_WARMUP", 0)
    monkeypatch.setattr(e2e_common, "TRAIN_ITERS", 1)
    rows = []
    e2e_bench.TRAIN_LONG_FAMILY.run(quick=True, emit=rows.append)
    got = {(r["shape"], r["impl"]) for r in rows}
    for shape in ("tiny 1x8", "tiny 2x4"):
        assert {(shape, "stock"), (shape, "rlk")} <= got, shape

    def oom(model, samples):
        raise torch.OutOfMemoryError("CUDA out of memory (made up)")

    monkeypatch.setattr(e2e_bench, "_stock_step", oom)
    monkeypatch.setattr(e2e_bench, "QUICK_TRAIN_LONG_SHAPES", ((1, 8),))
    rows = []
    e2e_bench.TRAIN_LONG_FAMILY.run(quick=True, emit=rows.append)
    timed = [r for r in rows if "left_out" not in r]
    assert {r["impl"] for r in timed} >= {"rlk"} and "stock" not in {r["impl"] for r in timed}
    # The report records why stock has no row (the record goes to its left_out, not its rows).
    assert [(r["impl"], r["left_out"]) for r in rows if "left_out" in r] == [
        ("stock", "OutOfMemoryError: CUDA out of memory (made up)")
    ]
    monkeypatch.setattr(e2e_bench, "_rlk_step", oom)
    with pytest.raises(torch.OutOfMemoryError):
        e2e_bench.TRAIN_LONG_FAMILY.run(quick=True, emit=rows.append)


def test_train_long_shapes():
    # The family's second model keeps Qwen3-4B's layer shape.
    from rlk_integrations.tools.zoo import make_config

    cfg = make_config("qwen3-4b-4layers")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) == (2560, 9728, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (32, 8, 4)
    assert e2e_bench.TRAIN_LONG_SHAPES == ((1, 16384), (4, 8192))


def test_heldout_shapes():
    # The held-out configs keep the features they stand for.
    from rlk_integrations.tools.zoo import HELDOUT, make_config

    llama, qwen = (make_config(n) for n in HELDOUT)
    assert llama.head_dim == 64 and llama.tie_word_embeddings
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert qwen.model_type == "qwen2" and qwen.num_attention_heads // qwen.num_key_value_heads == 6
    assert llama.num_hidden_layers == qwen.num_hidden_layers == 4


def test_decode_bytes_count_every_weight_per_step_and_the_context():
    # tiny-llama (untied embeddings: the input embedding counts nothing): 2 layers of q, k, v,
    # o (128x128, 128x64, 128x64, 128x128), gate, up, down (128x128 each), two norms; the final
    # norm and the 512x128 head; bf16. Keys and values: 2 layers x 2 heads x 32 x 2 (K, V) x 2
    # bytes a token. Prompts of 3 and 5 tokens, 4 steps: (3 + 5) x 4 + 2 x (0 + 1 + 2 + 3).
    from rlk_integrations.tools.zoo import load_model

    model = load_model("tiny-llama", dtype=torch.bfloat16, device="cpu", seed=0)
    layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 128 + 2 * 128
    weights = 2 * (2 * layer + 128 + 512 * 128)
    tokens = 8 * 4 + 2 * 6
    got = e2e_bench._decode_bytes(model, [[1, 2, 3], [1, 2, 3, 4, 5]], 4)
    assert got == 4 * weights + tokens * 2 * 2 * 32 * 2 * 2
    moe = load_model("tiny-qwen3-moe", dtype=torch.bfloat16, device="cpu", seed=0)
    assert e2e_bench._decode_bytes(moe, [[1, 2]], 4) is None  # routed: no fixed bytes


def test_static_peer_that_does_not_compile_or_fails_is_left_out(monkeypatch):
    # On CUDA the static-cache row claims a compiled decode step: generate not compiling it
    # (here: the run stubbed, no compiled call on the model) gives a left_out record, as a
    # run that raises does; neither gives a row.
    model = torch.nn.Linear(1, 1)
    stub = {"op": "e2e.rollout.paged", "impl": "hf-generate-static", "ms": 1.0}
    monkeypatch.setattr(e2e_bench, "_rollout_row", lambda *a: dict(stub))
    monkeypatch.setattr(e2e_bench, "_free", lambda device: None)
    args = ("e2e.rollout.paged", model, [[1]], 1, "s")
    r = e2e_bench._hf_static_row(*args, torch.device("cuda"))
    assert r["left_out"] == (
        "RuntimeError: generate with the static cache did not compile its decode step"
    )
    assert "ms" not in r
    r = e2e_bench._hf_static_row(*args, torch.device("cpu"))
    assert (r["ms"], r["decode_compiled"], r["cache"]) == (1.0, False, "static")

    def compiled(*a):  # what generate leaves on the model when it compiles
        model.__dict__.update(_compiled_call=print, _previous_max_cache_length=9)
        return dict(stub)

    monkeypatch.setattr(e2e_bench, "_rollout_row", compiled)
    r = e2e_bench._hf_static_row(*args, torch.device("cuda"))
    assert r["decode_compiled"] and "left_out" not in r
    # Gone after the row: the next shape compiles and sizes its cache afresh.
    assert not {"_compiled_call", "_previous_max_cache_length"} & set(vars(model))

    def fail(*a):
        raise MemoryError("out of memory\nmore")

    monkeypatch.setattr(e2e_bench, "_rollout_row", fail)
    r = e2e_bench._hf_static_row(*args, torch.device("cpu"))
    assert r["left_out"] == "MemoryError: out of memory" and r["impl"] == "hf-generate-static"


def test_liger_compiled_rows_run_after_every_other_row(monkeypatch):
    """On CUDA Liger's compiled peer runs last (it has left a CUDA context unusable, which
    would fail every row after it): each model's other rows first, then its row per model."""
    from rlk_integrations.tools import e2e_compile

    calls, compiled_trainings = [], e2e_compile.compiled_trainings
    monkeypatch.setattr(timing, "DEVICE", "cuda")  # only the calls' order is run here
    monkeypatch.setattr(e2e_bench, "_free", lambda device: None)
    monkeypatch.setattr(e2e_bench, "_liger", lambda: "flce")
    monkeypatch.setattr(e2e_bench, "_bench_model", lambda name, *a: calls.append(("rows", name)))
    monkeypatch.setattr(
        e2e_compile, "compiled_trainings", lambda name, *a: calls.append((a[-1], name))
    )
    monkeypatch.setenv("RLK_E2E_MODELS", "qwen2-0.5b,qwen3-0.6b")
    e2e_bench.run(quick=False, emit=lambda row: None)
    liger = (e2e_compile.LIGER,)
    assert calls == [
        ("rows", "qwen2-0.5b"),
        ("rows", "qwen3-0.6b"),
        (liger, "qwen2-0.5b"),
        (liger, "qwen3-0.6b"),
    ]
    with pytest.raises(ValueError, match="not in"):
        compiled_trainings("tiny", 2, 8, torch.device("cpu"), None, None, ("x",))
