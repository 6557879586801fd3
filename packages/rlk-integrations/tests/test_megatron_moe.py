"""Megatron-core's MoE layer on rlk (Qwen3-MoE, Qwen2-MoE): exact weight conversion both ways,
the layout checked against stock Megatron's own MoE (fp32), and the rlk ``GPTModel``'s packed
log-probs and gradients bit for bit those of rlk's transformers model on CPU; the Megatron MoE
options rlk cannot honour are refused by name.

Stock Megatron 0.16's router reads ``te_general_gemm``, which it defines only with Transformer
Engine installed, and moves its weight to ``torch.cuda.current_device()``: the stock-model test
sets the one to None and points the other at the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import rlk  # noqa: F401  (first: it picks Triton's CPU interpreter before Megatron imports triton)

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from test_consistency_megatron import _samples  # noqa: E402
from test_integration_megatron import check_round_trip  # noqa: E402

from rlk_integrations.adapters import megatron as rm  # noqa: E402
from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.models import moe  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

NAME = "tiny-qwen3-moe"
#: Qwen3-MoE, and Qwen2-MoE with its sigmoid-gated shared expert and q/k/v biases.
NAMES = [NAME, "tiny-qwen2-moe"]


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    teardown = rm.init_single_process()
    yield
    teardown()


def _hf(dtype=torch.float32, name=NAME, **changes):
    """A tiny MoE model, or its config with ``changes`` (seeded random weights)."""
    if not changes:
        return zoo.load_model(name, dtype=dtype, attn_implementation="eager")
    from transformers import AutoModelForCausalLM

    cfg = zoo.make_config(name)
    for key, value in changes.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "name, dense_first", [(NAME, False), (NAME, True), ("tiny-qwen2-moe", False)]
)
def test_weight_round_trip_is_bitwise(name, dense_first):
    """transformers -> Megatron -> transformers, and Megatron's own (stock local-spec MoE
    model's) keys and shapes -> transformers -> Megatron, bitwise; with the first layer dense
    (``mlp_only_layers=[0]``) too, and Qwen2-MoE's gated shared expert."""
    hf = _hf(name=name, mlp_only_layers=[0]) if dense_first else _hf(name=name)
    sd = hf.state_dict()
    mg_sd = check_round_trip(hf)
    assert ("decoder.layers.0.mlp.linear_fc1.weight" in mg_sd) == dense_first
    shared = "decoder.layers.1.mlp.shared_experts.gate_weight"
    assert (shared in mg_sd) == (name == "tiny-qwen2-moe")
    if shared in mg_sd:
        assert torch.equal(mg_sd[shared], sd["model.layers.1.mlp.shared_expert_gate.weight"])
    j, h = "decoder.layers.1.mlp.experts.local_experts.3.", "model.layers.1.mlp.experts."
    assert torch.equal(mg_sd[j + "linear_fc1.weight"], sd[h + "gate_up_proj"][3])
    assert torch.equal(mg_sd[j + "linear_fc2.weight"], sd[h + "down_proj"][3])


@pytest.mark.parametrize(
    "name, norm_topk_prob", [(NAME, True), (NAME, False), ("tiny-qwen2-moe", False)]
)
def test_stock_megatron_moe_matches_transformers(name, norm_topk_prob, monkeypatch):
    """The converted weights in Megatron's own MoE layer (TopKRouter, token dispatcher,
    SequentialMLP, SharedExpertMLP) give transformers' logits in fp32: the layout and the
    router mapping (``moe_router_pre_softmax = not norm_topk_prob``) are Megatron's."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    hf = _hf(name=name, norm_topk_prob=norm_topk_prob)
    mg = rm.load_hf_weights(
        rm.build_gpt_model(hf.config, use_rlk=False), hf.state_dict(), hf.config
    ).eval()
    assert mg.config.moe_router_pre_softmax is not norm_topk_prob
    b, s = 2, 9
    ids = torch.randint(0, hf.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s)[None].expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        ref = hf(ids).logits
        out = mg(ids, pos, causal)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _pair(dtype=torch.bfloat16, name=NAME, **changes):
    hf = rt.patch_model(_hf(dtype, name, **changes))
    mg = rm.build_gpt_model(hf.config, dtype=dtype)
    rm.load_hf_weights(mg, hf.state_dict(), hf.config)
    return hf, mg.eval()


@pytest.mark.parametrize(
    "name, changes",
    [(NAME, {}), (NAME, {"mlp_only_layers": [0], "norm_topk_prob": False}),
     ("tiny-qwen2-moe", {})],
)  # fmt: skip
def test_rlk_megatron_moe_logprobs_bitwise_equal_transformers(name, changes):
    """bf16 on CPU: the rlk GPTModel's MoE layers (RlkTopKRouter, RlkExperts, Qwen2-MoE's
    RlkSharedExperts) give the transformers integration's packed log-probs bit for bit, in two
    micro-batch compositions; also with the first layer dense and the top-k weights not
    renormalised."""
    hf, mg = _pair(name=name, **changes)
    layers = [type(layer.mlp).__name__ for layer in mg.decoder.layers]
    assert layers == (["RlkMLP", "RlkMoELayer"] if changes else ["RlkMoELayer"] * 2)
    sparse = mg.decoder.layers[1].mlp
    assert type(sparse.router).__name__ == "RlkTopKRouter"
    assert type(sparse.experts).__name__ == "RlkExperts"
    shared = type(sparse.shared_experts).__name__ if sparse.shared_experts is not None else None
    assert shared == ("RlkSharedExperts" if name == "tiny-qwen2-moe" else None)
    samples = _samples([(3, 5), (6, 2), (2, 4)], hf.config.vocab_size, seed=2)
    with torch.no_grad(), moe.RoutingLog(hf) as hf_log, rm.RoutingLog(mg) as mg_log:
        ref = training.packed_logprobs(hf, samples)
        got = rm.packed_logprobs(mg, samples)
        got_other = rm.packed_logprobs(mg, [samples[2], samples[0]])
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max()
    assert torch.equal(got_other[0], ref[2]) and torch.equal(got_other[1], ref[0])
    # Megatron's routing log: every token's experts in every sparse layer, as the
    # transformers log has them (both micro-batches); one changed expert is seen.
    hf_routes = moe.packed_routing(hf_log, [[0, 1, 2]])
    mg_routes = moe.packed_routing(mg_log, [[0, 1, 2], [2, 0]])
    assert len(mg_routes) == sum(len(x.tokens) for x in samples)
    assert len(next(iter(mg_routes.values()))) == layers.count("RlkMoELayer")
    assert moe.routing_differ(hf_routes, mg_routes) == (0.0, len(hf_routes))
    pos, valid, experts = mg_log.calls[0]
    experts[0, 10, -1, 0] = (experts[0, 10, -1, 0] + 1) % hf.config.num_experts  # sample 1
    assert moe.routing_differ(hf_routes, moe.packed_routing(mg_log, [[0, 1, 2], [2, 0]]))[0] > 0


def test_rlk_megatron_moe_backward_matches_transformers():
    """The backward reaches every parameter, and the last MoE layer's router and expert
    gradients (and the final norm's) are the transformers integration's, bit for bit. Earlier
    layers are not compared: their dY passes the fused QKV's dX, which Megatron reduces over
    one [q; k; v] weight and transformers over three (the dense test says the same)."""
    hf, mg = _pair(torch.float32)
    samples = _samples([(4, 3), (2, 5)], hf.config.vocab_size, seed=6)
    torch.cat(training.packed_logprobs(hf, samples)).sum().backward()
    torch.cat(rm.packed_logprobs(mg, samples)).sum().backward()
    hf_grads = rm.hf_to_megatron({k: p.grad for k, p in hf.named_parameters()}, hf.config)
    params = dict(mg.named_parameters())
    for key, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), key
    last = f"decoder.layers.{hf.config.num_hidden_layers - 1}.mlp."
    keys = [last + "router.weight", "decoder.final_layernorm.weight"]
    keys += [k for k in params if k.startswith(last + "experts.")]
    assert len(keys) == 2 + 2 * hf.config.num_experts
    for key in keys:
        assert torch.equal(params[key].grad, hf_grads[key]), key
    assert params[last + "router.weight"].grad.abs().sum() > 0


@pytest.mark.parametrize(
    "option",
    [
        # Megatron itself wants the sigmoid score function with the aux-loss-free bias.
        dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
        dict(moe_expert_capacity_factor=1.0),
        dict(moe_shared_expert_intermediate_size=32),
        dict(moe_router_dtype="fp32"),
        dict(moe_router_score_function="sigmoid"),
        dict(moe_aux_loss_coeff=0.01),
        dict(moe_z_loss_coeff=1e-3),
        dict(moe_input_jitter_eps=0.01),
        dict(moe_token_dispatcher_type="flex"),
    ],
)
def test_unsupported_megatron_moe_options_are_refused_by_name(option):
    hf = _hf()
    name = next(iter(option))
    with pytest.raises(NotImplementedError, match=f"Megatron's {name}="):
        rm.megatron_config(hf.config, **option)


def test_refusals():
    hf = _hf()
    with pytest.raises(NotImplementedError, match="leaves"):
        rm.build_gpt_model(hf.config, leaves=8)
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        rm.shard_for_tp(rm.hf_to_megatron(hf.state_dict(), hf.config), hf.config,
                        rank=0, world_size=2)  # fmt: skip
    hf.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        rm.megatron_config(hf.config)
    qwen2_moe = zoo.make_config("tiny-qwen2-moe")
    with pytest.raises(NotImplementedError, match="moe_shared_expert_intermediate_size=32"):
        rm.megatron_config(qwen2_moe, moe_shared_expert_intermediate_size=32)
    assert {"qwen3_moe", "qwen2_moe"} <= set(rm.SUPPORTED_MODEL_TYPES)
