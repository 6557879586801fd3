"""Megatron-core integration: exact weight conversion, stock Megatron == transformers (fp32),
and the rlk Megatron model's log-probs == the transformers integration's, bitwise.

Megatron runs on CPU here in one process (a 1-rank gloo group). Megatron 0.16's stock RoPE
moves its table to ``torch.cuda.current_device()`` and its default causal mask is built on
"cuda", so the stock-model test points ``current_device`` at the CPU and passes the causal mask
explicitly; the rlk model needs neither.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import rlk  # first: it picks Triton's CPU interpreter before Megatron imports triton

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from rlk_integrations.adapters import megatron as rm  # noqa: E402
from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

NAMES = ["tiny-llama", "tiny", "tiny-qwen3"]  # llama (untied), qwen2 (qkv bias, tied), qwen3
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    owned = not dist.is_initialized()
    if owned:
        with tempfile.NamedTemporaryFile(delete=False) as f:
            path = f.name
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    # Dropout is 0 everywhere; the inference tracker's fork is a no-op (no CUDA RNG on CPU).
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    yield
    parallel_state.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()


def _hf(name, dtype=torch.float32):
    return zoo.load_model(name, dtype=dtype, attn_implementation="eager")


@pytest.mark.parametrize("name", NAMES)
def test_weight_round_trip_is_bitwise(name):
    check_round_trip(_hf(name))


def check_round_trip(hf):
    """transformers -> Megatron -> transformers bitwise, the converted keys and shapes exactly
    those of Megatron's own (stock local-spec) model, and its weights -> transformers ->
    Megatron bitwise. Returns the converted state dict."""
    cfg = hf.config
    sd = hf.state_dict()
    mg_sd = rm.hf_to_megatron(sd, cfg)
    back = rm.megatron_to_hf(mg_sd, cfg)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # Megatron -> HF -> Megatron from a Megatron model's own (random) weights.
    mg = rm.build_gpt_model(cfg, use_rlk=False)
    own = {k: v for k, v in mg.state_dict().items() if not k.endswith("_extra_state")}
    assert own.keys() == mg_sd.keys()  # the converted keys are exactly Megatron's
    for k, v in own.items():
        assert v.shape == mg_sd[k].shape, k
    again = rm.hf_to_megatron(rm.megatron_to_hf(own, cfg), cfg)
    assert again.keys() == own.keys()
    for k in own:
        assert torch.equal(again[k], own[k]), k
    return mg_sd


def test_qkv_layout_is_grouped():
    """Rows of the fused QKV: per KV group, its q heads, then its k head, then its v head."""
    hf = _hf("tiny")
    cfg = hf.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    sd = hf.state_dict()
    w = rm.hf_to_megatron(sd, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = cfg.head_dim
    for g in range(2):
        base = g * 4 * d  # (2 q heads + k + v) * d rows per group
        assert torch.equal(w[base : base + 2 * d], q[2 * g * d : 2 * (g + 1) * d])
        assert torch.equal(w[base + 2 * d : base + 3 * d], k[g * d : (g + 1) * d])
        assert torch.equal(w[base + 3 * d : base + 4 * d], v[g * d : (g + 1) * d])


def test_conversion_rejects_mismatched_tied_head():
    hf = _hf("tiny")
    sd = dict(hf.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        rm.hf_to_megatron(sd, hf.config)
    sd.pop("lm_head.weight")
    sd["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="unexpected"):
        rm.hf_to_megatron(sd, hf.config)


@pytest.mark.parametrize("name", NAMES)
def test_stock_megatron_matches_transformers(name, monkeypatch):
    """The converted weights in Megatron's own (stock, local-spec) GPTModel give the
    transformers model's logits in fp32: the layout is Megatron's, not just self-consistent."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    hf = _hf(name)
    mg = rm.load_hf_weights(
        rm.build_gpt_model(hf.config, use_rlk=False), hf.state_dict(), hf.config
    )
    mg.eval()
    b, s = 2, 9
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s)[None].expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        ref = hf(ids).logits
        out = mg(ids, pos, causal)  # [B, S, V]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in lengths:
        toks = torch.randint(0, VOCAB, (p + r,), generator=g).tolist()
        out.append(Sample(prompt=toks[:p], response=toks[p:], logprobs=torch.zeros(r)))
    return out


def _pair(name, dtype):
    hf = rt.patch_model(_hf(name, dtype))
    mg = rm.build_gpt_model(hf.config, dtype=dtype)
    rm.load_hf_weights(mg, hf.state_dict(), hf.config)
    return hf, mg.eval()


def test_rlk_megatron_close_to_transformers_fp32_reference():
    """Packed (thd) and one-row-per-sequence (sbhd) layouts of the rlk Megatron model agree
    with the transformers model in fp32 (reference backend: fast, checks the wiring)."""
    hf, mg = _pair("tiny-qwen3", torch.float32)
    samples = _samples([(3, 4), (5, 2), (2, 6)], seed=1)
    with torch.no_grad(), rlk.use_backend("reference"):
        ref = training.packed_logprobs(hf, samples)
        got = rm.packed_logprobs(mg, samples)
        ids = torch.tensor([samples[0].tokens, samples[0].tokens[::-1]])  # [B=2, S=7]
        h = rm.hidden_states(mg, ids)  # [S, B, H], no packed params
        hf_h = rt.decoder(hf)(input_ids=ids).last_hidden_state
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.transpose(0, 1), hf_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_rlk_megatron_logprobs_bitwise_equal_transformers(name):
    """On CPU: training recompute with Megatron-core + rlk gives the transformers
    integration's log-probs bit for bit (bf16, the auto-selected backend)."""
    hf, mg = _pair(name, torch.bfloat16)
    samples = _samples([(3, 5), (6, 2), (2, 4)], seed=2)
    with torch.no_grad():
        ref = training.packed_logprobs(hf, samples)
        got = rm.packed_logprobs(mg, samples)
        got_other = rm.packed_logprobs(mg, [samples[2], samples[0]])  # another micro-batch
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max()
    assert torch.equal(got_other[0], ref[2]) and torch.equal(got_other[1], ref[0])


def test_layer_spec_modules():
    hf, mg = _pair("tiny-qwen3", torch.float32)
    layer = mg.decoder.layers[0]
    names = {type(m).__name__ for m in mg.modules()}
    assert {"RlkColumnParallelLinear", "RlkRowParallelLinear", "RlkRMSNorm", "RlkCoreAttention",
            "RlkSelfAttention", "RlkMLP"} <= names  # fmt: skip
    assert type(layer.self_attention.q_layernorm).__name__ == "RlkRMSNorm"
    assert type(mg.decoder.final_layernorm).__name__ == "RlkRMSNorm"
    assert not hasattr(mg, "rotary_pos_emb")  # rotary lives in the attention, from HF's table


def test_shard_for_tp_reassembles():
    hf = _hf("tiny")
    full = rm.hf_to_megatron(hf.state_dict(), hf.config)
    shards = [rm.shard_for_tp(full, hf.config, rank=r, world_size=2) for r in range(2)]
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = full[key].chunk(2)
    assert torch.equal(shards[1][key], torch.cat([gate[64:], up[64:]]))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([s[qkv] for s in shards]), full[qkv])
    proj = "decoder.layers.1.self_attention.linear_proj.weight"
    assert torch.equal(torch.cat([s[proj] for s in shards], dim=1), full[proj])


def test_rlk_megatron_backward_is_deterministic():
    """Backward through the rlk GPTModel reaches every parameter and repeats bit for bit."""
    _, mg = _pair("tiny", torch.bfloat16)
    samples = _samples([(3, 4), (4, 3)], seed=4)

    def grads():
        mg.zero_grad(set_to_none=True)
        lps = rm.packed_logprobs(mg, samples)
        torch.cat(lps).sum().backward()
        return {n: p.grad.clone() for n, p in mg.named_parameters()}

    a, b = grads(), grads()
    assert a.keys() == {n for n, _ in mg.named_parameters()}
    for n in a:
        assert torch.isfinite(a[n].float()).all() and a[n].abs().sum() > 0, n
        assert torch.equal(a[n], b[n]), n


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_rlk_megatron_logprobs_bitwise_equal_transformers_cuda(name):
    """On a GPU: the rlk Megatron model's packed log-probs (bf16) == the transformers
    integration's, bitwise, and its backward repeats bit for bit."""
    hf = rt.patch_model(_hf(name, torch.bfloat16).cuda())
    mg = rm.build_gpt_model(hf.config, dtype=torch.bfloat16)
    rm.load_hf_weights(mg, hf.state_dict(), hf.config)
    mg.cuda()
    samples = _samples([(3, 5), (6, 2), (2, 4)], seed=2)
    with torch.no_grad():
        ref = training.packed_logprobs(hf, samples)
        got = rm.packed_logprobs(mg, samples)
    for a, b in zip(got, ref):
        assert a.is_cuda and torch.equal(a, b), (a - b).abs().max()

    def grads():
        mg.zero_grad(set_to_none=True)
        torch.cat(rm.packed_logprobs(mg, samples)).sum().backward()
        return {n: p.grad.clone() for n, p in mg.named_parameters()}

    a, b = grads(), grads()
    for n in a:
        assert torch.equal(a[n], b[n]), n
