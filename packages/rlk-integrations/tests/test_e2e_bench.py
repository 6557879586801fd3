"""``rlk bench``'s e2e and e2e-long families (rollout and training engines, the GRPO step; the
long rollouts) run end to end on the tiny model on CPU: their own wall-clock timing is kept (on
CPU it only has to run); every row the result file's readers look for comes out."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from rlk.bench import _timing  # noqa: E402
from rlk_integrations import e2e_bench  # noqa: E402


def test_e2e_family_runs(monkeypatch):
    monkeypatch.setattr(_timing, "DEVICE", "cpu")
    shapes = dict(
        QUICK_MODELS=("tiny",),
        QUICK_BATCHES=(2,),
        QUICK_NEW_TOKENS=2,
        QUICK_TRAIN_SEQS=2,
        QUICK_TRAIN_LEN=8,
        PROMPT_LEN=(3, 5),
        QUICK_LONG_PROMPT_LEN=(6, 8),
        QUICK_LONG_NEW_TOKENS=3,
        TRAIN_ITERS=1,
        QUICK_GRPO_PROMPTS=2,
        GRPO_GROUP=2,
        GRPO_MICRO_BATCH=2,
    )
    for name, value in shapes.items():
        monkeypatch.setattr(e2e_bench, name, value)
    rows = []
    e2e_bench.run(quick=True, emit=rows.append)
    long = []
    e2e_bench.LONG.run(quick=True, emit=long.append)
    got = {(r["op"], r["impl"]) for r in rows}
    assert got >= {
        ("e2e.rollout.padded", "hf-generate"),
        ("e2e.rollout.padded", "rlk"),
        ("e2e.rollout.paged", "hf-generate"),
        ("e2e.rollout.paged", "rlk"),
        ("e2e.train", "stock"),
        ("e2e.train", "rlk"),
        ("e2e.grpo_step", "stock"),
        ("e2e.grpo_step", "rlk"),
    }
    assert all(r["tok_s"] > 0 for r in rows + long)
    # The e2e-long family: the long setting, the paged engine and its hf-generate peer only.
    assert not any("prompt=6-8 new=3" in r["shape"] for r in rows)
    assert all("prompt=6-8 new=3" in r["shape"] for r in long)
    assert {(r["op"], r["impl"]) for r in long} == {
        ("e2e.rollout.paged", "hf-generate"),
        ("e2e.rollout.paged", "rlk"),
    }
    # A GRPO step samples every completion of every group in full.
    assert {r["new_tokens"] for r in rows if r["op"] == "e2e.grpo_step"} == {2 * 2 * 2}


def test_heldout_family_and_model_filter(monkeypatch):
    # The held-out family gives the training rows (every impl the CPU has) of its models, and
    # RLK_E2E_MODELS keeps only the models it names; a name the family lacks is an error.
    monkeypatch.setattr(_timing, "DEVICE", "cpu")
    for name, value in dict(
        HELDOUT_MODELS=("tiny", "tiny-llama"), QUICK_TRAIN_SEQS=2, QUICK_TRAIN_LEN=8, TRAIN_ITERS=1
    ).items():
        monkeypatch.setattr(e2e_bench, name, value)
    monkeypatch.setenv("RLK_E2E_MODELS", "tiny-llama")
    rows = []
    e2e_bench.HELDOUT_FAMILY.run(quick=True, emit=rows.append)
    assert {r["op"] for r in rows} == {"e2e.train"}
    assert {r["shape"] for r in rows} == {"tiny-llama 2x8"}
    assert {"stock", "rlk"} <= {r["impl"] for r in rows}
    monkeypatch.setenv("RLK_E2E_MODELS", "tiny-qwen3")
    with pytest.raises(ValueError, match="RLK_E2E_MODELS"):
        e2e_bench.HELDOUT_FAMILY.run(quick=True, emit=rows.append)


def test_heldout_shapes():
    # The held-out configs keep the features they stand for.
    from rlk_integrations.models import HELDOUT, make_config

    llama, qwen = (make_config(n) for n in HELDOUT)
    assert llama.head_dim == 64 and llama.tie_word_embeddings
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert qwen.model_type == "qwen2" and qwen.num_attention_heads // qwen.num_key_value_heads == 6
    assert llama.num_hidden_layers == qwen.num_hidden_layers == 4
