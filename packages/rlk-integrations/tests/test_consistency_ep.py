"""``rlk consistency --ep N`` on tiny-qwen3-moe, on CPU.

The rlk row's padded rollout and transformers recompute run in 2 spawned gloo processes, each
holding half of every MoE layer's experts (``shard_ep``) and sampling, then recomputing, its
own share of the sequences (the recompute's share is another than the rollout's); the tokens
reach their experts by all-to-all. The rlk row must show 0 log-prob difference and 0 tokens
routed to other experts, the stock row (stock transformers on one device) a non-zero difference.
The options EP cannot honour are refused in one line before anything runs.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from test_consistency_cli import test_usage_errors_are_one_line as usage_error_is_one_line  # noqa: E402

from rlk import cli  # noqa: E402


def _cli(capsys, *argv):
    rc = cli.main(["consistency", "--prompts", "2", "--new-tokens", "2", "--micro-batch", "2",
                   "--quiet", *argv])  # fmt: skip
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 1])  # 1: the expert-parallel code path in one process
def test_ep_rlk_row_zero(ep, tmp_path, capsys):
    out = tmp_path / "c.json"
    rc, printed, _ = _cli(capsys, "--model", "tiny-qwen3-moe", "--ep", str(ep), "--json", str(out))
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["ep"] == ep and f"EP={ep} ranks" in printed
    rows = {r["side"]: r for r in report["rows"]}
    rlk, stock = rows["rlk"], rows["stock"]
    assert (rlk["rollout_mode"], rlk["train_engine"]) == (f"padded-ep{ep}", f"transformers-ep{ep}")
    assert rlk["tokens"] == 4 and rlk["max_abs_dlogp"] == 0.0 and rlk["frac_differ"] == 0.0
    assert rlk["expert_differ"] == 0.0  # measured: both ranks' routing logs came back
    assert stock["max_abs_dlogp"] > 0
    assert "paged" in report["rollout_skipped"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "tiny", "--ep", "2"], "ep = 2 shards experts: tiny (qwen2) is a dense model"),
        (["--model", "tiny-qwen3-moe", "--ep", "3"], "ep = 3 must divide tiny-qwen3-moe"),
        (["--model", "tiny-qwen3-moe", "--ep", "4", "--prompts", "2"], "divide prompts = 2"),
        (["--model", "tiny-qwen3-moe", "--ep", "2", "--rollout-mode", "paged"], "'padded' alone"),
        (
            ["--model", "tiny-qwen3-moe", "--ep", "2", "--train-engine", "transformers-graphs"],
            "not 'transformers-graphs'",
        ),
        (["--model", "tiny-qwen3-moe", "--ep", "0"], "ep must be an int >= 1"),
        (["--model", "tiny", "--ep", "1"], "ep = 1 shards experts: tiny (qwen2) is a dense model"),
        (["--model", "tiny-qwen3-moe", "--train-tp", "2", "--leaves", "8"], "leaves (and train_tp"),
    ],
)
def test_refused_in_one_line(argv, message, capsys, monkeypatch):
    # Refused where the config is built: no model is, and the message is one line.
    usage_error_is_one_line(argv, message, capsys, monkeypatch)
