"""``rlk consistency --train-engine megatron`` and ``--leaves``: transformers + rlk rollout,
Megatron-core + rlk training recompute, exactly zero mismatch on the tiny model on CPU; the
tree-ordered row-parallel linears (``patch_model(leaves=)``) on both sides."""

from __future__ import annotations

import json

import pytest
import torch

import rlk  # first: it picks Triton's CPU interpreter before Megatron imports triton

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from rlk import cli  # noqa: E402
from rlk_integrations.adapters import megatron as rm  # noqa: E402
from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402

ARGS = ["consistency", "--model", "tiny", "--prompts", "3", "--new-tokens", "3"]
ARGS += ["--micro-batch", "2", "--rollout-mode", "padded", "--quiet"]


def _report(tmp_path, capsys, *extra):
    out = tmp_path / "c.json"
    rc = cli.main([*ARGS, *extra, "--json", str(out)])
    printed = capsys.readouterr().out
    return rc, json.loads(out.read_text()), printed


@pytest.mark.slow
def test_cli_megatron_engine_rlk_row_zero(tmp_path, capsys):
    import torch.distributed as dist

    rc, report, printed = _report(tmp_path, capsys, "--train-engine", "megatron")
    assert rc == 0, printed
    rows = {r["side"]: r for r in report["rows"]}
    assert rows["rlk"]["train_engine"] == "megatron"
    assert rows["stock"]["train_engine"] == "transformers"
    assert rows["rlk"]["tokens"] == 9
    assert rows["rlk"]["max_abs_dlogp"] == 0.0 and rows["rlk"]["frac_differ"] == 0.0
    assert "megatron" in printed and "stock row is stock transformers" in printed
    assert not dist.is_initialized()  # the command tears its process group down


@pytest.mark.slow
def test_cli_megatron_engine_with_leaves_rlk_row_zero(tmp_path, capsys):
    rc, report, printed = _report(tmp_path, capsys, "--train-engine", "megatron", "--leaves", "8")
    assert rc == 0, printed
    assert report["leaves"] == 8
    row = next(r for r in report["rows"] if r["side"] == "rlk")
    assert row["tokens"] == 9 and row["max_abs_dlogp"] == 0.0


def test_cli_rejects_bad_leaves(tmp_path, capsys):
    """A usage error is one line and exit status 2, before any model is built."""
    rc = cli.main([*ARGS, "--leaves", "3", "--json", str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == "rlk: error: leaves must be a power of two, got 3\n"


def _samples(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in lengths:
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(prompt=toks[:p], response=toks[p:], logprobs=torch.zeros(r)))
    return out


def test_leaves_reach_both_sides_and_change_the_bits():
    """patch_model(leaves=8) runs o_proj/down_proj on tree_linear; Megatron with leaves=8 at
    TP=1 matches it bitwise, and both differ from the plain rlk.linear bits (so the leaves are
    really used: a side that ignored them would mismatch the other). fp32: at the tiny model's
    K (128) the tree and the plain K order round to the same bf16 outputs."""
    teardown = rm.init_single_process()
    try:
        hf = zoo.load_model("tiny", dtype=torch.float32)
        samples = _samples([(3, 5), (6, 2), (2, 4)], hf.config.vocab_size, seed=5)
        mg_plain = rm.build_gpt_model(hf.config, dtype=torch.float32)
        mg_tree = rm.build_gpt_model(hf.config, dtype=torch.float32, leaves=8)
        for mg in (mg_plain, mg_tree):
            rm.load_hf_weights(mg, hf.state_dict(), hf.config)
        with torch.no_grad():
            rt.patch_model(hf)
            plain = torch.cat(training.packed_logprobs(hf, samples))
            rt.unpatch_model(hf)
            rt.patch_model(hf, leaves=8)
            layer = rt.decoder(hf).layers[0]
            assert layer.self_attn.o_proj.forward.__func__ is rt._tree_linear_forward
            assert layer.mlp.down_proj.forward.__func__ is rt._tree_linear_forward
            assert layer.self_attn.q_proj.forward.__func__ is rt._linear_forward
            with pytest.raises(ValueError, match="already patched"):
                rt.patch_model(hf, leaves=4)
            tree = torch.cat(training.packed_logprobs(hf, samples))
            mg_tree_lp = torch.cat(rm.packed_logprobs(mg_tree, samples))
            mg_plain_lp = torch.cat(rm.packed_logprobs(mg_plain, samples))
        rt.unpatch_model(hf)
        assert not hasattr(layer.self_attn.o_proj, "_rlk_leaves")
    finally:
        teardown()
    assert torch.equal(mg_tree_lp, tree)
    assert torch.equal(mg_plain_lp, plain)
    assert not torch.equal(tree, plain)


def test_leaves_backward_of_last_mlp_matches_transformers():
    """Backward through the tree-ordered down_proj: the transformers side (tree_linear) and
    Megatron at TP=1 (row_parallel_linear, leaves=8) give the last layer's MLP and final-norm
    weight gradients bit for bit. Earlier layers' gradients are not compared: their dY passes a
    column-parallel dX, which Megatron reduces over the fused fc1/QKV rows (by the N-leaf tree
    with leaves) and transformers over separate gate/up (q/k/v) linears; the contract here is
    the log-probs."""
    teardown = rm.init_single_process()
    try:
        hf = rt.patch_model(zoo.load_model("tiny", dtype=torch.float32), leaves=8)
        mg = rm.build_gpt_model(hf.config, dtype=torch.float32, leaves=8)
        rm.load_hf_weights(mg, hf.state_dict(), hf.config)
        samples = _samples([(4, 3), (2, 5)], hf.config.vocab_size, seed=6)
        torch.cat(training.packed_logprobs(hf, samples)).sum().backward()
        torch.cat(rm.packed_logprobs(mg, samples)).sum().backward()
        hf_grads = rm.hf_to_megatron({k: p.grad for k, p in hf.named_parameters()}, hf.config)
        last = f"decoder.layers.{hf.config.num_hidden_layers - 1}.mlp."
        params = dict(mg.named_parameters())
        for key in (last + "linear_fc2.weight", last + "linear_fc1.weight",
                    "decoder.final_layernorm.weight"):  # fmt: skip
            assert params[key].grad.abs().sum() > 0, key
            assert torch.equal(params[key].grad, hf_grads[key]), key
    finally:
        teardown()


def test_train_engine_validated():
    with pytest.raises(ValueError, match="train_engine"):
        consistency.run("tiny", train_engine="deepspeed")
    with pytest.raises(ValueError, match="power of two"):
        rt.patch_model(zoo.load_model("tiny"), leaves=6)
    assert rlk.parallel.TREE_BACKENDS
