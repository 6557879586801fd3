"""``rlk consistency --train-engine megatron --train-tp 2 --leaves 8`` on CPU: the command spawns
2 gloo processes that recompute in Megatron-core at TP=2 from ``shard_for_tp`` shards; their
log-probs equal the transformers rollout's (tree-ordered o_proj/down_proj, 8 leaves) bit for
bit. fp32, where the tree order shows in the bits (at the tiny model's K, bf16 rounds the plain
and the tree order to the same values)."""

from __future__ import annotations

import json

import pytest
import torch

import rlk  # noqa: F401  first: it picks Triton's CPU interpreter before Megatron imports triton

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")
# Spawned gloo processes running Megatron-core under the interpreter.
pytestmark = pytest.mark.slow

from rlk import cli  # noqa: E402
from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402


def test_cli_megatron_tp2_rlk_row_zero(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["consistency", "--model", "tiny", "--prompts", "3", "--new-tokens", "3"]
    argv += ["--micro-batch", "2", "--rollout-mode", "padded", "--dtype", "float32", "--quiet"]
    argv += ["--train-engine", "megatron", "--train-tp", "2", "--leaves", "8"]
    rc = cli.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["train_tp"] == 2 and report["leaves"] == 8
    rows = {r["side"]: r for r in report["rows"]}
    assert rows["rlk"]["train_engine"] == "megatron-tp2"
    assert rows["rlk"]["tokens"] == 9
    assert rows["rlk"]["max_abs_dlogp"] == 0.0 and rows["rlk"]["frac_differ"] == 0.0
    assert "TP=2" in printed


def test_tp2_recompute_has_the_tree_bits_not_the_plain_ones():
    """The TP=2 workers' log-probs are the leaves=8 transformers bits, and not those of the
    plain rlk.linear model (so the comparison above can fail)."""
    hf = zoo.load_model("tiny", dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    samples = []
    for p, r in [(3, 4), (5, 2), (2, 5)]:
        toks = torch.randint(0, hf.config.vocab_size, (p + r,), generator=g).tolist()
        samples.append(Sample(prompt=toks[:p], response=toks[p:], logprobs=torch.zeros(r)))
    with torch.no_grad():
        plain = torch.cat(training.packed_logprobs(rt.patch_model(hf), samples))
        rt.unpatch_model(hf)
        tree = torch.cat(training.packed_logprobs(rt.patch_model(hf, leaves=8), samples))
        rt.unpatch_model(hf)
    tp = consistency.MegatronTP(hf, 2, 8, None)
    got, seconds = tp(samples, [[2, 0], [1]], 1.0, None)
    assert seconds > 0
    assert torch.equal(torch.cat(got), tree)
    assert not torch.equal(tree, plain)


def test_train_tp_validated():
    with pytest.raises(ValueError, match="leaves"):
        consistency.run("tiny", train_engine="megatron", train_tp=2)
    with pytest.raises(ValueError, match="rollout_tp > 1 needs leaves"):
        consistency.run("tiny", rollout_tp=2)
    with pytest.raises(ValueError, match="rollout_tp must be an int"):
        consistency.run("tiny", rollout_tp=0, leaves=8)
    with pytest.raises(ValueError, match="power of two"):
        consistency.run("tiny", train_engine="megatron", train_tp=3, leaves=8)
    import rlk.parallel

    assert rlk.parallel.TREE_BACKENDS


def _cuda_tp_report(tmp_path, capsys, tp, dtype):
    out = tmp_path / "c.json"
    argv = ["consistency", "--model", "tiny", "--prompts", "4", "--new-tokens", "8"]
    argv += ["--micro-batch", "3", "--rollout-mode", "padded", "--dtype", dtype, "--quiet"]
    argv += ["--device", "cuda", "--train-engine", "megatron", "--leaves", "8"]
    argv += ["--train-tp", str(tp)]
    rc = cli.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    return {r["side"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_megatron_tp1_rlk_row_zero(tmp_path, capsys, dtype):
    """TP=1 on one GPU: Megatron-core recompute (tree linears, 8 leaves) == the rollout."""
    rows = _cuda_tp_report(tmp_path, capsys, 1, dtype)
    assert rows["rlk"]["train_engine"] == "megatron" and rows["rlk"]["tokens"] == 32
    assert rows["rlk"]["max_abs_dlogp"] == 0.0 and rows["rlk"]["frac_differ"] == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_megatron_tp2_nccl_rlk_row_zero(tmp_path, capsys, dtype):
    """TP=2 over NCCL (ranks on cuda:0 and cuda:1) == the rollout on cuda:0, bit for bit."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 over NCCL needs 2 GPUs, {torch.cuda.device_count()} visible")
    rows = _cuda_tp_report(tmp_path, capsys, 2, dtype)
    assert rows["rlk"]["train_engine"] == "megatron-tp2" and rows["rlk"]["tokens"] == 32
    assert rows["rlk"]["max_abs_dlogp"] == 0.0 and rows["rlk"]["frac_differ"] == 0.0
