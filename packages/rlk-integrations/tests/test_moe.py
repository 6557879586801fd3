"""Qwen3-MoE on rlk: the patched sparse block against transformers', routing logs, refusals,
and rollout = training with the experts' choice measured (tiny-qwen3-moe)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations.engine import rollout, training  # noqa: E402
from rlk_integrations.models import moe as rmoe  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402


def _ids(b, s, seed=0):
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


def test_patched_matches_transformers():
    """fp32 on the float64 backend: the patched model is transformers' (router, top-k with
    renormalised weights, experts, combine), to rounding; unpatching restores it."""
    model = zoo.load_model("tiny-qwen3-moe", dtype=torch.float32)
    ids = _ids(2, 7)
    with torch.no_grad():
        ref = model(ids).logits
        rt.patch_model(model)
        blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
        assert blocks and all(rmoe._is_patched(b) for b in blocks)
        with rlk.use_backend("reference"):
            out = model(ids).logits
        rt.unpatch_model(model)
        assert torch.equal(model(ids).logits, ref)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_refusals():
    model = zoo.load_model("tiny-qwen3-moe", dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="leaves"):
        rt.patch_model(model, leaves=2)
    model.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        rt.patch_model(model)
    assert not rt.is_patched(model)
    # Shared experts (Qwen2-MoE), DeepSeek's grouped top-k and score-correction bias: other
    # model types, refused by name.
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=4, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, intermediate_size=32,
                         vocab_size=64)  # fmt: skip
    with pytest.raises(NotImplementedError, match="qwen2_moe"):
        rt.patch_model(Qwen2MoeForCausalLM(cfg))
    from rlk_integrations.models.megatron.config import _check_supported

    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        _check_supported(zoo.make_config("tiny-qwen3-moe"))


def test_rollout_equals_training_with_the_same_experts():
    """bf16 on the auto backend: a padded rollout and a packed training pass in another batch
    composition give the same log-probabilities and route every token to the same experts."""
    model = rt.patch_model(zoo.load_model("tiny-qwen3-moe", dtype=torch.bfloat16))
    prompts = consistency.random_prompts(4, 512, 3, 7, seed=1)
    with rmoe.RoutingLog(model) as rlog:
        ro = rollout.generate(model, prompts, 5, seeds=[3, 4, 5, 6])
    groups = [[2, 0], [3, 1]]
    with rmoe.RoutingLog(model) as tlog, torch.no_grad():
        lps = {i: lp for g in groups for i, lp in zip(g, training.packed_logprobs(
            model, [ro.samples[i] for i in g]))}  # fmt: skip
    for i, s in enumerate(ro.samples):
        assert torch.equal(lps[i], s.logprobs)
    share, tokens = rmoe.routing_differ(
        rmoe.padded_routing(rlog), rmoe.packed_routing(tlog, groups)
    )
    # Every token both passes ran: prompt and response but the last sampled one.
    assert tokens == sum(len(p) + 4 for p in prompts) and share == 0.0
    assert len(tlog.calls) == 2 and tlog.calls[0][2].shape[2:] == (2, 4)  # 2 layers, k = 4


def test_routing_differ_counts_tokens():
    a = {(0, 0): ((1, 2),), (0, 1): ((0, 3),), (1, 0): ((2, 3),)}
    b = {(0, 0): ((1, 2),), (0, 1): ((0, 2),), (2, 0): ((1, 3),)}
    assert rmoe.routing_differ(a, b) == (0.5, 2)
    assert rmoe.routing_differ({}, b) == (0.0, 0)


@pytest.mark.slow
def test_consistency_tiny_qwen3_moe():
    """``rlk consistency --model tiny-qwen3-moe``: rlk rows 0 (padded and paged), experts
    column 0 for rlk's padded row; the stock row's experts differ for some tokens."""
    report = consistency.run("tiny-qwen3-moe")
    assert consistency.ok(report), consistency.format_table(report)
    rows = {(r["side"], r["rollout_mode"]): r for r in report["rows"]}
    assert rows["rlk", "padded"]["expert_differ"] == 0.0
    assert rows["rlk", "paged"]["expert_differ"] is None
    assert rows["stock", "padded"]["expert_differ"] > 0
    assert "experts" in consistency.format_table(report)
