"""The GRPO loop on vLLM's CPU build (the real engine) with Megatron-core as the trainer,
through ``rlk consistency --rollout-engine vllm --steps N``, and tensor parallelism 2 in vLLM.

``rlk consistency --steps 2 --train-engine megatron``: Megatron at TP 1 trains, its weights go
back to the checkpoint's names and into rlk's vLLM model, and the rlk rows are 0 at every step;
the stock loop beside it (stock vLLM, stock transformers, vLLM's own weight reload) differs.
Then one engine at ``tensor_parallel_size=2`` with the trainer's tree-ordered row-parallel
linears (``engine_args(leaves=8)``) and Megatron at TP 2 (two spawned gloo ranks per step):
the recompute equals vLLM's log-probabilities bit for bit at every step. (The transformers
trainer's loop is test_vllm_rl.py's.)

The checkpoint: vllm_helpers' head_dim-64 tiny Qwen2 with 2 key/value heads (TP 2 splits them).
Two engine starts for the command, one for TP 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from vllm_helpers import load_trainer, prompts, rv, start_engine, write_checkpoint

pytest.importorskip("megatron.core")

from rlk import cli  # noqa: E402
from rlk_integrations.adapters.vllm import loop  # noqa: E402
from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402

LEAVES = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-hd64-kv2"))
    write_checkpoint(path, kv_heads=2)
    return path


def test_megatron_weights_are_the_checkpoints_names(checkpoint):
    """A Megatron trainer's weights (TP 1) before any step are the checkpoint's tensors under
    the checkpoint's names, bit for bit (what goes into vLLM is what was trained)."""
    trainer = loop.MegatronTrainer(load_trainer(checkpoint), lr=1.0, leaves=LEAVES)
    try:
        got = dict(trainer.weights())
    finally:
        trainer.close()
    want = zoo.load_model(checkpoint, dtype=torch.bfloat16).state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_megatron_trainer_refuses_tp_without_leaves():
    model = zoo.load_model("tiny")
    with pytest.raises(ValueError, match="tp = 2 needs leaves"):
        loop.MegatronTrainer(model, lr=1.0, tp=2)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        loop.MegatronTrainer(model, lr=1.0, tp=0)


def test_unshard_tp_inverts_shard_for_tp():
    from rlk_integrations.adapters import megatron

    hf = zoo.load_model("tiny", dtype=torch.float32)
    full = megatron.hf_to_megatron(hf.state_dict(), hf.config)
    shards = [megatron.shard_for_tp(full, hf.config, rank=r, world_size=2) for r in range(2)]
    back = loop.unshard_tp(shards)
    assert sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
    norm = next(k for k in full if k.endswith("layernorm.weight"))
    shards[1][norm] = shards[1][norm] + 1
    with pytest.raises(ValueError, match=f"replicated {norm} differs"):
        loop.unshard_tp(shards)


@pytest.mark.slow
def test_cli_steps_rlk_rows_zero_stock_rows_not(checkpoint, tmp_path, capsys):
    """``rlk consistency --rollout-engine vllm --steps 2 --train-engine megatron``: two GRPO
    steps per side, Megatron-core (TP 1) training the rlk side, its weights converted back to
    the checkpoint's names and pushed into vLLM; a row per side and step. The rlk rows are
    exactly zero, the stock rows (stock vLLM, stock transformers, vLLM's reload) are not, and
    the command exits 0."""
    out = tmp_path / "loop.json"
    argv = ["consistency", "--model", checkpoint, "--rollout-engine", "vllm", "--steps", "2"]
    argv += ["--prompts", "2", "--new-tokens", "4", "--temperature", "0.7", "--quiet"]
    argv += ["--train-engine", "megatron"]
    rc = cli.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    rows = {(r["side"], r["step"]): r for r in report["rows"]}
    assert sorted(rows) == [(side, i) for side in ("rlk", "stock") for i in range(2)]
    for i in range(2):
        rlk_row, stock_row = rows["rlk", i], rows["stock", i]
        assert rlk_row["tokens"] == 2 * 4 * 4 and rlk_row["rollout_mode"] == "vllm"
        assert rlk_row["train_engine"] == "megatron"
        assert rlk_row["max_abs_dlogp"] == 0.0 and rlk_row["frac_differ"] == 0.0
        assert stock_row["rollout_mode"] == "vllm-stock" and stock_row["frac_differ"] > 0
    assert "2 GRPO steps" in printed and "step side" in printed


def test_ok_fails_on_any_rlk_step():
    """One rlk row of one step off by a rounding: the command's verdict is a failure."""
    zero = dict(side="rlk", tokens=8, max_abs_dlogp=0.0, frac_differ=0.0)
    off = dict(zero, max_abs_dlogp=2.0**-9, frac_differ=0.125, step=2)
    assert consistency.ok({"rows": [dict(zero, step=0), dict(zero, step=1)]})
    assert not consistency.ok({"rows": [dict(zero, step=0), dict(zero, step=1), off]})


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rollout-engine", "paged"], "rollout mode 'vllm' alone"),
        (["--rollout-engine", "vllm", "--train-engine", "transformers-graphs"], "not 'transf"),
        (["--rollout-engine", "vllm", "--train-tp", "2", "--leaves", "8"], "trains with megatron"),
        (["--rollout-engine", "vllm", "--temperature", "0"], "temperature > 0"),
        (["--rollout-engine", "vllm", "--steps", "0"], "steps must be an int >= 1"),
    ],
)
def test_cli_steps_usage_errors(extra, message, capsys):
    argv = ["consistency", "--steps", "2", *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_tp2_in_vllm_and_in_megatron_ratio_is_one(checkpoint, monkeypatch):
    """vLLM at ``tensor_parallel_size=2`` (two CPU workers, one core each) on rlk's models with
    8 leaves, and Megatron-core training at TP 2 (two gloo ranks per step), in fp32 (where the
    tree order shows in the bits): two GRPO steps at 0.7, n = 4, the joined Megatron weights
    pushed into both vLLM ranks' shards between them; every log-probability equals the
    trainer's recompute, and the first step's equal the one-device transformers recompute with
    the same leaves (TP 2 == TP 1). The controls: the one-device model on plain
    ``rlk.linear`` (no leaves) gives other bits for the first step's samples, and the
    checkpoint's weights other bits for the last step's (the pushed weights sampled them)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored after the test
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    args = rv.engine_args(logprobs_mode="processed_logprobs", leaves=LEAVES, tensor_parallel_size=2)
    engine = start_engine(checkpoint, dtype="float32", **args)
    fp32 = zoo.load_model(checkpoint, dtype=torch.float32)
    trainer = loop.MegatronTrainer(fp32, lr=1.0, tp=2, leaves=LEAVES)
    try:
        steps = list(loop.grpo_loop(engine, trainer, prompts([5, 7], seed=4), 2, seed=6))
    finally:
        engine.llm_engine.engine_core.shutdown()
    assert [s.max_abs_dlogp for s in steps] == [0.0, 0.0]
    plain = rt.patch_model(zoo.load_model(checkpoint, dtype=torch.float32))
    first, last = steps[0].samples, steps[-1].samples
    lps = training.recompute_logprobs(plain, first, 3, temperature=0.7)
    assert any(not torch.equal(s.logprobs, lp) for s, lp in zip(first, lps))
    tree = rt.patch_model(zoo.load_model(checkpoint, dtype=torch.float32), leaves=LEAVES)
    lps = training.recompute_logprobs(tree, first, 3, temperature=0.7)  # one device, TP 1
    assert all(torch.equal(s.logprobs, lp) for s, lp in zip(first, lps))
    lps = training.recompute_logprobs(tree, last, 3, temperature=0.7)
    assert all(not torch.equal(s.logprobs, lp) for s, lp in zip(last, lps))
