"""transformers integration: patched Llama/Qwen2/Qwen3 match HF, and rollout == training bitwise.

Structure/accuracy checks run on the reference backend (fast); bitwise checks run on the
backend that auto-selection picks (triton under the interpreter on CPU, a GPU backend on GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations.engine import rollout, training  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

VOCAB = 512


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny", "tiny-qwen3"])
def test_patched_matches_hf(name):
    model = zoo.load_model(name, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :2] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=pos).logits
        rt.patch_model(model)
        assert model.config._attn_implementation == "rlk"
        with rlk.use_backend("reference"):
            out = model(ids, attention_mask=mask, position_ids=pos).logits
        rt.unpatch_model(model)
        assert model.config._attn_implementation == "eager"
        again = model(ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-5)
    assert torch.equal(again, ref)  # unpatch restores the stock forwards


def test_packed_and_cached_paths_match_padded():
    """Packed rows (position_ids restart), and prefill + decode with a DynamicCache, give the
    padded forward's logits (reference backend, fp32)."""
    from transformers import DynamicCache

    model = rt.patch_model(zoo.load_model("tiny-qwen3", dtype=torch.float32))
    a, b = _prompts([5, 3], seed=2)
    with torch.no_grad(), rlk.use_backend("reference"):
        la = model(torch.tensor([a])).logits[0]
        lb = model(torch.tensor([b])).logits[0]
        packed = model(
            torch.tensor([a + b]), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
        ).logits[0]
        torch.testing.assert_close(packed, torch.cat([la, lb]), rtol=1e-5, atol=1e-6)
        cache = DynamicCache(config=model.config)
        kw = {rt.cache_kwarg(model): cache, "use_cache": True}
        pre = model(torch.tensor([a[:3]]), **kw).logits[0]
        step = model(torch.tensor([a[3:4]]), **kw).logits[0]
        torch.testing.assert_close(torch.cat([pre, step]), la[:4], rtol=1e-5, atol=1e-6)


def test_rollout_equals_training_bitwise():
    """Padded-batch rollout log-probs == packed recompute (other composition), bit for bit,
    and a request's tokens are the same alone and in a batch (auto backend)."""
    model = rt.patch_model(zoo.load_model("tiny", dtype=torch.bfloat16))
    prompts = _prompts([5, 8, 3], seed=3)
    seeds = [7, 8, 9]
    ro = rollout.generate(model, prompts, 4, seeds=seeds)
    assert ro.logits_dtype == torch.bfloat16
    train = training.recompute_logprobs(model, ro.samples, 2, order=[2, 0, 1])
    for s, lp in zip(ro.samples, train):
        assert len(s.response) == 4
        assert torch.equal(s.logprobs, lp), (s.logprobs, lp)
    alone = rollout.generate(model, prompts[1:2], 4, seeds=seeds[1:2]).samples[0]
    assert alone.response == ro.samples[1].response
    assert torch.equal(alone.logprobs, ro.samples[1].logprobs)


def test_grpo_step_updates_and_stays_exact():
    model = rt.patch_model(zoo.load_model("tiny", dtype=torch.float32))
    model.train()
    prompts = _prompts([4, 4], seed=4)
    ro = rollout.generate(model, [prompts[0]] * 2 + [prompts[1]] * 2, 3, seeds=[1, 2, 3, 4])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    before = model.lm_head.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = training.grpo_step(model, opt, ro.samples, rewards, 2, 3, order=[3, 2, 1, 0])
    assert out["max_abs_dlogp"] == 0.0
    assert torch.isfinite(torch.tensor(out["loss"]))
    assert not torch.equal(model.lm_head.weight, before)


def test_unsupported_model_raises():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    supported = r"\('llama', 'qwen2', 'qwen3', 'qwen3_moe', 'qwen2_moe', 'deepseek_v3'\)"
    with pytest.raises(NotImplementedError, match=rf"supports {supported}, not model_type='gpt2'"):
        rt.patch_model(model)


@pytest.mark.parametrize(
    "name, prefix", [("tiny-llama", "Llama"), ("tiny", "Qwen2"), ("tiny-qwen3", "Qwen3")]
)
def test_patch_replaces_the_named_classes(name, prefix):
    """patch_model dispatches on model_type to the architecture's patch, which replaces the
    forward of exactly the module classes it names (and every nn.Linear), nothing else."""
    from torch import nn

    model = zoo.load_model(name, dtype=torch.float32)
    rt.patch_model(model)
    patched = {type(m).__name__ for m in model.modules() if "forward" in vars(m)}
    roles = {"RotaryEmbedding", "DecoderLayer", "RMSNorm", "Attention", "MLP"}
    assert patched == {prefix + r for r in roles} | {"Linear"}
    kept = {type(m).__name__ for m in model.modules() if "forward" not in vars(m)}
    assert not kept & patched
    assert all("forward" in vars(m) for m in model.modules() if isinstance(m, nn.Linear))
    rt.unpatch_model(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_patch_of_another_architecture_raises():
    model = zoo.load_model("tiny-llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="qwen2 patch got a model_type='llama' model"):
        rt.patch_qwen2(model)
    assert not rt.is_patched(model)
    assert rt.patch_llama(model) is model and rt.is_patched(model)


def test_module_the_patch_does_not_replace_raises():
    """A module class of the architecture's modeling file that the patch does not name (here
    one defined there by hand) is refused before anything is patched."""
    import importlib

    model = zoo.load_model("tiny", dtype=torch.float32)
    modeling = importlib.import_module("transformers.models.qwen2.modeling_qwen2")
    extra = type("Qwen2NewBlock", (torch.nn.Module,), {"__module__": modeling.__name__})
    model.model.layers[0].extra = extra()
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.extra \(Qwen2NewBlock\)"):
        rt.patch_model(model)
    assert not rt.is_patched(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_untested_transformers_version_warns_once(monkeypatch):
    import warnings

    a, b = (zoo.load_model("tiny", dtype=torch.float32) for _ in range(2))
    monkeypatch.setattr(rt, "_installed_transformers", lambda: "5.99.0")
    monkeypatch.setattr(rt, "_version_warned", False)
    with pytest.warns(RuntimeWarning, match=r"tested with transformers 5\.17 to 5\.24"):
        rt.patch_model(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.patch_model(b)  # once per process


def test_changed_forward_conventions_raise():
    """A decoder layer whose forward no longer takes the cache (under either name) is refused
    before anything is patched, instead of silently dropping the KV cache."""
    model = zoo.load_model("tiny", dtype=torch.float32)
    layer = model.model.layers[0]
    base = type(layer)

    class RenamedDecoderLayer(base):
        def forward(self, hidden_states, attention_mask=None, position_embeddings=None, kv=None):
            return super().forward(hidden_states, attention_mask, past_key_values=kv)

    layer.__class__ = RenamedDecoderLayer
    with pytest.raises(RuntimeError, match="RenamedDecoderLayer.forward takes no past_key_values"):
        rt.patch_model(model)
    assert not rt.is_patched(model)


def test_cache_under_either_name_reaches_the_attention():
    """The patched layers read the KV cache as past_key_values (transformers < 5.24) and as
    cache (>= 5.24); a prefill + decode through each name gives the same logits."""
    from transformers import DynamicCache

    model = rt.patch_model(zoo.load_model("tiny", dtype=torch.float32))
    (a,) = _prompts([6], seed=3)
    base = rt.decoder(model)
    outs = []
    with torch.no_grad(), rlk.use_backend("reference"):
        full = base(torch.tensor([a])).last_hidden_state[0]
        for name in ("past_key_values", "cache"):
            cache = DynamicCache(config=model.config)
            h = torch.tensor([a[:4]])
            pos = torch.arange(4)[None]
            emb = base.rotary_emb(h, pos)
            x = base.embed_tokens(h)
            for layer in base.layers:
                x = layer(x, position_ids=pos, position_embeddings=emb, **{name: cache})
            h = torch.tensor([a[4:]])
            pos = torch.arange(4, 6)[None]
            emb = base.rotary_emb(h, pos)
            y = base.embed_tokens(h)
            for layer in base.layers:
                y = layer(y, position_ids=pos, position_embeddings=emb, **{name: cache})
            outs.append(base.norm(torch.cat([x, y], 1))[0])
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="two KV caches"):
        base.layers[0](x, position_embeddings=emb, past_key_values=cache, cache=DynamicCache())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hf_generate_with_transformers_caches(cache):
    """model.generate on the patched model (left padding, dynamic or static KV cache) scores
    like the stock model."""
    model = zoo.load_model("tiny-qwen3", dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=cache,
        output_scores=True,
        return_dict_in_generate=True,
    )
    ref = model.generate(ids, **kw)
    rt.patch_model(model)
    with rlk.use_backend("reference"):
        out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(
        torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-5
    )


def test_rotary_table_does_not_depend_on_the_modules_device_values():
    """transformers computes inv_freq on the device the model is created on, and a GPU's pow
    can differ from the CPU's in the last bit (seen on an H200: Megatron's rotary, built on the
    CPU, then disagreed with a model built on the GPU). The table is built by a CPU twin from
    the config, so a module whose inv_freq differs by an ulp gives the same rows."""
    from rlk_integrations.models.rotary import RotaryTable

    hf = zoo.load_model("tiny", dtype=torch.float32)
    rotary = rt.decoder(hf).rotary_emb
    pos = torch.arange(0, 40)[None]
    want = RotaryTable.for_module(rotary).gather(pos)
    rotary.inv_freq.copy_(torch.nextafter(rotary.inv_freq, torch.full_like(rotary.inv_freq, 2.0)))
    got = RotaryTable.for_module(rotary).gather(pos)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    stale = rotary(torch.empty(1), pos)  # the module itself does change, so the test can fail
    assert not torch.equal(stale[0][0], want[0][0])


def test_checkpoint_directory_must_hold_safetensors(tmp_path):
    """A pickled ``pytorch_model.bin`` is refused (unpickling can run code); safetensors load."""
    model = zoo.load_model("tiny", dtype=torch.float32)
    model.save_pretrained(tmp_path / "st")
    loaded = zoo.load_model(str(tmp_path / "st"), dtype=torch.float32)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    pickled = tmp_path / "bin"
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        zoo.load_model(str(pickled), dtype=torch.float32)
