"""The GRPO loop on vLLM's CPU build (the real engine) with Megatron-core as the trainer, and
``rlk consistency --rollout-engine vllm --steps N``.

Megatron at TP 1 and at TP 2 (two spawned gloo ranks per step) trains, its weights go back to
the checkpoint's names and into rlk's vLLM model (``engine_args(leaves=8)``: the trainer's
tree-ordered row-parallel linears), and the recompute equals vLLM's log-probabilities bit for bit
at every step. The command runs the transformers trainer's loop beside the stock one (stock
vLLM, stock transformers, vLLM's own weight reload), whose rows differ.

The checkpoint: vllm_helpers' head_dim-64 tiny Qwen2 with 2 key/value heads (Megatron's TP 2
splits them).
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


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = start_engine(
        checkpoint, **rv.engine_args(logprobs_mode="processed_logprobs", leaves=LEAVES)
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def tree_trainer(checkpoint):
    """The checkpoint on the transformers integration with the trainer's tree-ordered linears."""
    return rt.patch_model(zoo.load_model(checkpoint, dtype=torch.bfloat16), leaves=LEAVES)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_trainer_loop_ratio_is_one(llm, checkpoint, tp):
    """GRPO steps with Megatron-core training at TP ``tp`` (temperature 0.7, n = 4): the
    recompute equals vLLM's log-probabilities bit for bit at every step. The control: the last
    step's samples recomputed with the checkpoint's weights differ (the pushed weights are the
    ones that sampled)."""
    trainer = loop.MegatronTrainer(
        zoo.load_model(checkpoint, dtype=torch.bfloat16), lr=1.0, tp=tp, leaves=LEAVES
    )
    try:
        loop.push(llm, trainer.weights())  # from the checkpoint, whatever ran before
        steps = list(loop.grpo_loop(llm, trainer, prompts([5, 7], seed=11), 3, seed=tp))
    finally:
        trainer.close()
    assert [s.max_abs_dlogp for s in steps] == [0.0, 0.0, 0.0]
    last = steps[-1].samples
    before = training.recompute_logprobs(tree_trainer(checkpoint), last, 3, temperature=0.7)
    assert all(not torch.equal(s.logprobs, lp) for s, lp in zip(last, before))


@pytest.mark.slow
def test_megatron_weights_are_the_checkpoints_names(llm, checkpoint):
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
    """``rlk consistency --rollout-engine vllm --steps 2``: two GRPO steps per side, a row per
    side and step; the rlk rows are exactly zero, the stock rows are not, and the command
    exits 0."""
    out = tmp_path / "loop.json"
    argv = ["consistency", "--model", checkpoint, "--rollout-engine", "vllm", "--steps", "2"]
    argv += ["--prompts", "2", "--new-tokens", "4", "--temperature", "0.7", "--quiet"]
    rc = cli.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    rows = {(r["side"], r["step"]): r for r in report["rows"]}
    assert sorted(rows) == [(side, i) for side in ("rlk", "stock") for i in range(2)]
    for i in range(2):
        rlk_row, stock_row = rows["rlk", i], rows["stock", i]
        assert rlk_row["tokens"] == 2 * 4 * 4 and rlk_row["rollout_mode"] == "vllm"
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
def test_vllm_tensor_parallel_2_has_one_devices_bits(checkpoint, monkeypatch):
    """vLLM at ``tensor_parallel_size=2`` (two CPU workers, one core each) on rlk's models with
    8 leaves, in fp32 (where the tree order shows in the bits): two GRPO steps whose samples'
    log-probabilities equal the one-device recompute with the same leaves, with weights pushed
    into both ranks' shards between them. The control: the one-device model on plain
    ``rlk.linear`` (no leaves) gives other bits for the same samples."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored after the test
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    args = rv.engine_args(logprobs_mode="processed_logprobs", leaves=LEAVES, tensor_parallel_size=2)
    engine = start_engine(checkpoint, dtype="float32", **args)
    fp32 = zoo.load_model(checkpoint, dtype=torch.float32)
    trainer = loop.TransformersTrainer(rt.patch_model(fp32, leaves=LEAVES), lr=1.0)
    try:
        steps = list(loop.grpo_loop(engine, trainer, prompts([5, 7], seed=4), 2, seed=6))
    finally:
        engine.llm_engine.engine_core.shutdown()
    assert [s.max_abs_dlogp for s in steps] == [0.0, 0.0]
    plain = rt.patch_model(zoo.load_model(checkpoint, dtype=torch.float32))
    first = steps[0].samples
    lps = training.recompute_logprobs(plain, first, 3, temperature=0.7)
    assert any(not torch.equal(s.logprobs, lp) for s, lp in zip(first, lps))
