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
