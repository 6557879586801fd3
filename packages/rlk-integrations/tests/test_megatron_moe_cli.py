"""``rlk consistency --train-engine megatron`` on Qwen3-MoE (tiny-qwen3-moe): a transformers + rlk
rollout, Megatron-core's MoE layers on rlk for the training recompute, exactly zero mismatch and
zero tokens routed to other experts on CPU (slow: one consistency run)."""

from __future__ import annotations

import json

import pytest

import rlk  # noqa: F401  (first: it picks Triton's CPU interpreter before Megatron imports triton)

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from rlk import cli  # noqa: E402


@pytest.mark.slow
def test_cli_megatron_engine_moe_rlk_row_zero(tmp_path, capsys):
    """``rlk consistency --train-engine megatron --model tiny-qwen3-moe``: the rlk row (a
    transformers + rlk padded rollout, Megatron-core + rlk training) has 0 log-prob difference
    and 0 tokens routed to other experts (Megatron's RoutingLog against the rollout's); the
    stock row, both sides stock transformers, is there for contrast."""
    out = tmp_path / "c.json"
    args = ["consistency", "--model", "tiny-qwen3-moe", "--prompts", "3", "--new-tokens", "3",
            "--micro-batch", "2", "--rollout-mode", "padded", "--train-engine", "megatron",
            "--quiet", "--json", str(out)]  # fmt: skip
    rc = cli.main(args)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = {r["side"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["rlk"]["train_engine"] == "megatron" and rows["rlk"]["tokens"] == 9
    assert rows["rlk"]["max_abs_dlogp"] == 0.0 and rows["rlk"]["frac_differ"] == 0.0
    assert rows["rlk"]["expert_differ"] == 0.0
    assert rows["stock"]["max_abs_dlogp"] > 0
