"""DeepSeek-V3 on rlk (tiny-deepseek-v3): its router against transformers', multi-head latent
attention and the whole model against transformers' (forward and gradients), the zero-padded
value columns, refusals, and the paged rollout = the padded one = training with the same
experts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations.engine import paged, rollout, training  # noqa: E402
from rlk_integrations.models import moe as rmoe  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402

MODEL = "tiny-deepseek-v3"


def _ids(b, s, seed=0):
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


def _moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]


def test_router_matches_transformers():
    """rlk.moe_route_grouped (the auto backend) chooses the experts transformers'
    DeepseekV3TopkRouter chooses, with its weights to float32 rounding, on 64 tokens of the
    tiny model's first sparse layer (4 groups, 2 kept, 4 of 16 experts, bias, scale 2.5)."""
    model = zoo.load_model(MODEL, dtype=torch.float32)
    router = _moe_blocks(model)[0].gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, want_w, want_i = router(x)
        w, idx = rmoe.route(router, x)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(idx.sort(1).values, want_i.sort(1).values)
    dense = torch.zeros(64, 16)
    torch.testing.assert_close(
        dense.scatter(1, idx, w), dense.scatter(1, want_i, want_w), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("v_head_dim", [32, 16])
def test_patched_matches_transformers_and_unpatches(v_head_dim, monkeypatch):
    """fp32 on the float64 backend: the patched model (MLA with q/kv latents, interleaved rope
    and YaRN's softmax scale, v as wide as q and k or zero-padded from half their width, a
    dense layer, the grouped router, experts and shared expert) is transformers', logits and
    gradients, to rounding; unpatching restores it."""
    name = f"{MODEL}-v{v_head_dim}"
    model_type, kw = zoo.CONFIGS[MODEL]
    monkeypatch.setitem(zoo.CONFIGS, name, (model_type, dict(kw, v_head_dim=v_head_dim)))
    ids = _ids(2, 7)
    grads, logits = [], []
    for patched in (False, True):
        model = zoo.load_model(name, dtype=torch.float32)
        if patched:
            rt.patch_model(model)
        with rlk.use_backend("reference"):
            out = model(ids).logits
        out.float().logsumexp(-1).mean().backward()
        logits.append(out.detach())
        attn, block = model.model.layers[1].self_attn, _moe_blocks(model)[0]
        grads.append([attn.q_a_proj.weight.grad, attn.kv_a_proj_with_mqa.weight.grad,
                      attn.kv_b_proj.weight.grad, block.gate.weight.grad,
                      block.experts.gate_up_proj.grad, block.shared_experts.up_proj.weight.grad,
                      model.model.layers[0].mlp.down_proj.weight.grad])  # fmt: skip
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    for stock, ours in zip(*grads):
        torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-6)
    rt.unpatch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits[0], rtol=0, atol=0)


def test_padded_value_columns_do_not_reach_the_real_ones():
    """MLA's v (16 columns) is zero-padded to q's and k's 32 for rlk.attention and the paged
    cache: an output column is a sum over keys of that column of v alone, so the real columns
    are the same bits whatever the padding holds, and zero padding gives zero columns."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(9, 4, 32, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(9, 4, 16, generator=g).bfloat16()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    zero = rlk.attention(q, k, torch.nn.functional.pad(v, (0, 16)), cu, cu)
    noise = rlk.attention(q, k, torch.cat([v, torch.randn(9, 4, 16, generator=g).bfloat16()], -1),
                          cu, cu)  # fmt: skip
    assert torch.equal(zero[..., :16], noise[..., :16])
    assert not zero[..., 16:].any() and noise[..., 16:].any()


def test_refusals():
    """Key/value heads other than the heads, a value head above q's and k's, and leaves are
    refused by name; Megatron refuses the model type."""
    for key, value, match in (
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("v_head_dim", 40, "v_head_dim"),
    ):
        model = zoo.load_model(MODEL, dtype=torch.float32)
        setattr(model.config, key, value)
        with pytest.raises(NotImplementedError, match=match):
            rt.patch_model(model)
        assert not rt.is_patched(model)
    with pytest.raises(NotImplementedError, match="leaves"):
        rt.patch_model(zoo.load_model(MODEL, dtype=torch.float32), leaves=2)
    from rlk_integrations.models.megatron.config import _check_supported

    with pytest.raises(NotImplementedError, match="deepseek_v3"):
        _check_supported(zoo.make_config(MODEL))


def test_paged_rollout_equals_padded_and_training_with_the_same_experts(monkeypatch):
    """bf16 on the auto backend: the paged rollout (2 slots, chunked prompts sharing steps with
    decodes, its cache holding the expanded keys and padded values) samples the padded
    rollout's tokens with their log-probabilities; packed training passes in another batch
    composition give the same bits and route every token to the padded rollout's experts."""
    # Two layers (the dense one and a sparse one) keep the interpreter's time down.
    model_type, kw = zoo.CONFIGS[MODEL]
    monkeypatch.setitem(zoo.CONFIGS, "two", (model_type, dict(kw, num_hidden_layers=2)))
    model = rt.patch_model(zoo.load_model("two", dtype=torch.bfloat16))
    prompts = consistency.random_prompts(3, 512, 3, 7, seed=4)
    seeds = [7, 8, 9]
    ro = paged.generate_paged(
        model, prompts, 4, seeds=seeds, page_size=4, max_batch=2, max_step_tokens=6,
        prefill_chunk=4,
    )  # fmt: skip
    assert ro.extra["mixed_steps"] > 0
    with rmoe.RoutingLog(model) as rlog:
        padded = rollout.generate(model, prompts, 4, seeds=seeds)
    groups = [[2, 0], [1]]  # another batch composition than the rollouts'
    with rmoe.RoutingLog(model) as tlog, torch.no_grad():
        train = {i: lp for g in groups for i, lp in zip(g, training.packed_logprobs(
            model, [ro.samples[i] for i in g]))}  # fmt: skip
    for i, (a, b) in enumerate(zip(padded.samples, ro.samples)):
        assert a.response == b.response
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(b.logprobs, train[i])
    share, tokens = rmoe.routing_differ(
        rmoe.padded_routing(rlog), rmoe.packed_routing(tlog, groups)
    )
    # Every token both passes ran (prompt and response but the last sampled one).
    assert tokens == sum(len(p) + 3 for p in prompts) and share == 0.0
    assert tlog.calls[0][2].shape[2:] == (1, 4)  # one sparse layer, 4 experts per token
