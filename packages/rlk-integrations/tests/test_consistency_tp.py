"""``rlk consistency --rollout-tp / --train-tp`` with the transformers integration, on CPU.

The command spawns 2 gloo processes that shard the tiny model (:mod:`rlk_integrations.models.tp`)
and either sample (rollout at TP=2, padded and paged) or recompute with vocabulary-parallel
``linear_logprobs`` (training at TP=2); the other side runs at TP=1 in this process. fp32, where
the tree order of o_proj/down_proj shows in the bits (bf16 rounds both orders alike at the tiny
model's K); the rlk rows must be exactly zero. A unit test checks that a sharded model's
log-probs are the tree bits, not those of plain ``rlk.linear`` (so the rows above can fail).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
# Every test here spawns gloo processes that run the tiny model under the interpreter.
pytestmark = pytest.mark.slow

import time  # noqa: E402

from rlk import cli  # noqa: E402
from rlk_integrations.engine import tp_workers, training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.models import tp  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402


def _cli(tmp_path, capsys, *extra):
    out = tmp_path / "c.json"
    argv = ["consistency", "--model", "tiny", "--prompts", "3", "--new-tokens", "3"]
    argv += ["--micro-batch", "2", "--dtype", "float32", "--quiet", "--leaves", "8", *extra]
    rc = cli.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    return json.loads(out.read_text()), printed


def test_rollout_tp2_train_tp1(tmp_path, capsys):
    report, printed = _cli(tmp_path, capsys, "--rollout-tp", "2", "--rollout-mode", "both")
    rows = [r for r in report["rows"] if r["side"] == "rlk"]
    assert [r["rollout_mode"] for r in rows] == ["padded-tp2", "paged-tp2"]
    for r in rows:
        assert r["tokens"] == 9 and r["max_abs_dlogp"] == 0.0 and r["frac_differ"] == 0.0
    assert "at TP=2" in printed


def test_rollout_tp1_train_tp2(tmp_path, capsys):
    report, _ = _cli(tmp_path, capsys, "--train-tp", "2", "--rollout-mode", "padded")
    (row,) = [r for r in report["rows"] if r["side"] == "rlk"]
    assert row["train_engine"] == "transformers-tp2" and row["tokens"] == 9
    assert row["max_abs_dlogp"] == 0.0 and row["frac_differ"] == 0.0


def _samples(vocab):
    g = torch.Generator().manual_seed(3)
    out = []
    for p, r in [(3, 4), (5, 2), (2, 5)]:
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(prompt=toks[:p], response=toks[p:], logprobs=torch.zeros(r)))
    return out


def test_sharded_logprobs_are_the_tree_bits(tmp_path):
    hf = zoo.load_model("tiny", dtype=torch.float32)
    samples = _samples(hf.config.vocab_size)
    weights = str(tmp_path / "w.pt")
    tp_workers.save_weights(hf, weights)
    got, _ = tp_workers.spawn(tp_workers.train_worker, 2, "cpu", hf.config, weights,
                              torch.float32, 8, samples, [[0, 1, 2]], 1.0, torch.float32,
                              False)  # fmt: skip
    rt.patch_model(hf, leaves=8)
    tree = training.packed_logprobs(hf, samples)
    rt.unpatch_model(hf)
    rt.patch_model(hf)
    plain = training.packed_logprobs(hf, samples)
    assert all(torch.equal(a, b) for a, b in zip(got, tree))
    assert not all(torch.equal(a, b) for a, b in zip(got, plain))


def test_shard_tp_errors():
    hf = zoo.load_model("tiny", dtype=torch.float32)
    with pytest.raises(ValueError, match="patch_model"):
        tp.shard_tp(hf)


def test_rollout_tp4_train_tp2(tmp_path, capsys):
    # tiny-mha: 4 key/value heads, so 4 ranks split every layer (TP 4 on CPU).
    report, _ = _cli(tmp_path, capsys, "--rollout-tp", "4", "--train-tp", "2",
                     "--rollout-mode", "padded", "--model", "tiny-mha")  # fmt: skip
    (row,) = [r for r in report["rows"] if r["side"] == "rlk"]
    assert row["rollout_mode"] == "padded-tp4" and row["train_engine"] == "transformers-tp2"
    assert row["tokens"] == 9 and row["max_abs_dlogp"] == 0.0 and row["frac_differ"] == 0.0


def test_rollout_tp8_train_tp1(tmp_path, capsys):
    # tiny-mha8: 8 key/value heads, so 8 ranks split every layer and the vocabulary's 8 leaves.
    report, _ = _cli(tmp_path, capsys, "--rollout-tp", "8", "--rollout-mode", "padded",
                     "--model", "tiny-mha8")  # fmt: skip
    (row,) = [r for r in report["rows"] if r["side"] == "rlk"]
    assert row["rollout_mode"] == "padded-tp8" and row["train_engine"] == "transformers"
    assert row["tokens"] == 9 and row["max_abs_dlogp"] == 0.0 and row["frac_differ"] == 0.0


def test_spawn_collective_times_out():
    # A rank that never joins a collective fails the run after timeout_s, not after the stalled
    # rank's 90 s (gloo's own default would wait 30 minutes): the elapsed bound fails otherwise.
    from tp_stall_workers import STALL_S, stalled_peer_worker

    start = time.monotonic()
    with pytest.raises(Exception, match="(?i)timed out|timeout"):
        tp_workers.spawn(stalled_peer_worker, 2, "cpu", timeout_s=3)
    assert time.monotonic() - start < STALL_S / 2
    for bad in (0, -1.0, True, "3"):
        with pytest.raises(ValueError, match="timeout_s"):
            tp_workers.spawn(stalled_peer_worker, 2, "cpu", timeout_s=bad)
