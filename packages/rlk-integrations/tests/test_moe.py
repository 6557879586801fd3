"""Qwen3-MoE and Qwen2-MoE on rlk: the patched sparse block against transformers', routing logs,
refusals, and rollout = training with the experts' choice measured (tiny-qwen3-moe,
tiny-qwen2-moe; Qwen2-MoE's shared expert has its own tests in test_qwen2_moe.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations.engine import rollout, training  # noqa: E402
from rlk_integrations.models import moe as rmoe  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402

MODELS = ["tiny-qwen3-moe", "tiny-qwen2-moe"]


def _ids(b, s, seed=0):
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODELS)
def test_patched_matches_transformers(name):
    """fp32 on the float64 backend: the patched model is transformers' (router, top-k with
    renormalised weights (Qwen3-MoE) or not (Qwen2-MoE), experts, Qwen2-MoE's gated shared
    expert, combine), to rounding; unpatching restores it."""
    model = zoo.load_model(name, dtype=torch.float32)
    ids = _ids(2, 7)
    with torch.no_grad():
        ref = model(ids).logits
        rt.patch_model(model)
        blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
        assert blocks and all(rmoe._is_patched(b) for b in blocks)
        with rlk.use_backend("reference"):
            out = model(ids).logits
        rt.unpatch_model(model)
        assert torch.equal(model(ids).logits, ref)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_refusals(name):
    model = zoo.load_model(name, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="leaves"):
        rt.patch_model(model, leaves=2)
    model.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        rt.patch_model(model)
    assert not rt.is_patched(model)
    # DeepSeek-V2's softmax group-limited router (DeepSeek-V3 is patched, test_deepseek.py):
    # another model type, refused by name.
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, intermediate_size=32, vocab_size=64,
                           q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=0)  # fmt: skip
    with pytest.raises(NotImplementedError, match="deepseek_v2"):
        rt.patch_model(DeepseekV2ForCausalLM(cfg))
    from rlk_integrations.models.megatron.config import _check_supported

    _check_supported(zoo.make_config(name))  # Megatron's MoE layers: test_megatron_moe


@pytest.mark.parametrize("name", MODELS)
def test_rollout_equals_training_with_the_same_experts(name):
    """bf16 on the auto backend: a padded rollout and a packed training pass in another batch
    composition give the same log-probabilities and route every token to the same experts."""
    model = rt.patch_model(zoo.load_model(name, dtype=torch.bfloat16))
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
@pytest.mark.parametrize("name", MODELS)
def test_consistency_tiny_moe(name):
    """``rlk consistency --model tiny-qwen3-moe`` / ``tiny-qwen2-moe``: rlk rows 0 (padded and
    paged), experts column 0 for rlk's padded row; the stock row's experts differ for some
    tokens (4 to 8 minutes each on 2 shared CPU cores)."""
    report = consistency.run(name)
    assert consistency.ok(report), consistency.format_table(report)
    rows = {(r["side"], r["rollout_mode"]): r for r in report["rows"]}
    assert rows["rlk", "padded"]["expert_differ"] == 0.0
    assert rows["rlk", "paged"]["expert_differ"] is None
    assert rows["stock", "padded"]["expert_differ"] > 0
    assert "experts" in consistency.format_table(report)
