"""What rlk's vLLM plugin refuses, and how it says so (no vLLM needed: the checks read vLLM's
config objects, stood in for here by namespaces with the same fields)."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import rlk_integrations.adapters.vllm as rv  # noqa: E402
from rlk_integrations.adapters.vllm.model import check_config  # noqa: E402


def _config(**changes):
    fields = dict(
        quantization=None,
        lora=None,
        spec=None,
        tp=1,
        pp=1,
        cache_dtype="auto",
        logprobs_mode="raw_logprobs",
        v2=False,
        pcp=1,
        dcp=1,
        runner="generate",
        prompt_embeds=False,
    )
    fields.update(changes)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            quantization=fields["quantization"],
            logprobs_mode=fields["logprobs_mode"],
            runner_type=fields["runner"],
            enable_prompt_embeds=fields["prompt_embeds"],
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=fields["tp"],
            pipeline_parallel_size=fields["pp"],
            prefill_context_parallel_size=fields["pcp"],
            decode_context_parallel_size=fields["dcp"],
        ),
        cache_config=SimpleNamespace(cache_dtype=fields["cache_dtype"]),
        lora_config=fields["lora"],
        speculative_config=fields["spec"],
        use_v2_model_runner=fields["v2"],
    )


def test_supported_config_passes():
    check_config(_config())
    check_config(_config(logprobs_mode="processed_logprobs"))


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(quantization="fp8"), "quantization='fp8'"),
        (dict(lora=object()), "LoRA"),
        (dict(spec=object()), "speculative decoding"),
        (dict(tp=2), "tensor_parallel_size=2"),
        (dict(pp=2), "pipeline_parallel_size=2"),
        (dict(cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
        (dict(logprobs_mode="raw_logits"), "logprobs_mode='raw_logits'"),
        (dict(logprobs_mode="processed_logits"), "logprobs_mode='processed_logits'"),
        (dict(v2=True), "V2 model runner"),
        (dict(pcp=2), "prefill_context_parallel_size=2"),
        (dict(dcp=2), "decode_context_parallel_size=2"),
        (dict(runner="pooling"), "runner='pooling'"),
        (dict(prompt_embeds=True), "enable_prompt_embeds=True"),
    ],
)
def test_unsupported_option_is_named(change, named):
    with pytest.raises(NotImplementedError, match="rlk's vLLM models do not support") as e:
        check_config(_config(**change))
    assert named in str(e.value)


def test_tensor_parallelism_needs_leaves():
    """TP > 1 runs on the tree-ordered linears only (the bits of one device); never on MoE."""
    tp2 = _config(tp=2)
    tp2.model_config.hf_config = SimpleNamespace(rlk_leaves=8)
    check_config(tp2)
    tp2.model_config.hf_config.num_experts = 16
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2 with a mixture"):
        check_config(tp2)
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2 without leaves"):
        check_config(_config(tp=2))


def test_engine_args_tensor_parallel_with_leaves(monkeypatch):
    monkeypatch.setattr(rv, "installed_vllm", lambda: rv.TESTED_VLLM)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored after the test
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    args = rv.engine_args(tensor_parallel_size=2, leaves=8)
    assert args["tensor_parallel_size"] == 2
    cfg = SimpleNamespace(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    assert args["hf_overrides"](cfg).rlk_leaves == 8
    if not torch.cuda.is_available():  # one share of the cores per rank, unset at TP 1
        assert len(os.environ["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
        rv.engine_args()
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2 without leaves"):
        rv.engine_args(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="leaves"):
        rv.engine_args(tensor_parallel_size=4, leaves=2)


def test_several_unsupported_options_are_all_named():
    with pytest.raises(NotImplementedError) as e:
        check_config(_config(quantization="awq", tp=4))
    assert "quantization='awq'" in str(e.value) and "tensor_parallel_size=4" in str(e.value)


def test_architectures_are_mapped_and_others_refused():
    cfg = SimpleNamespace(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    assert rv.rlk_architectures(cfg).architectures == ["RLKQwen2ForCausalLM"]
    assert rv.rlk_architectures(cfg).architectures == ["RLKQwen2ForCausalLM"]  # idempotent
    mistral = SimpleNamespace(model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(NotImplementedError, match="MistralForCausalLM"):
        rv.rlk_architectures(mistral)
    # vLLM probes the callable with a dummy config to see whether it changes model_type.
    dummy = SimpleNamespace(model_type="dummy_qwen2", architectures=[""])
    assert rv.rlk_architectures(dummy) is dummy and dummy.architectures == [""]


def test_another_vllm_release_is_refused(monkeypatch):
    monkeypatch.setattr(rv, "installed_vllm", lambda: "0.31.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only.*found 0\.31\.1"):
        rv.check_vllm()
    with pytest.raises(RuntimeError, match="supports vLLM"):
        rv.engine_args()
    monkeypatch.setattr(rv, "installed_vllm", lambda: None)
    with pytest.raises(RuntimeError, match="needs vLLM"):
        rv.check_vllm()


@pytest.mark.parametrize(
    "kw",
    [
        dict(quantization="awq"),
        dict(enable_lora=True),
        dict(speculative_config={"method": "ngram"}),
        dict(tensor_parallel_size=2),
        dict(kv_cache_dtype="fp8"),
        dict(logprobs_mode="processed_logits"),
        dict(pipeline_parallel_size=2),
        dict(decode_context_parallel_size=2),
        dict(runner="pooling"),
        dict(enable_prompt_embeds=True),
        dict(hf_overrides={"architectures": ["Qwen2ForCausalLM"]}),
    ],
)
def test_engine_args_refuses_an_unsupported_option_at_once(monkeypatch, kw):
    monkeypatch.setattr(rv, "installed_vllm", lambda: rv.TESTED_VLLM)
    (name,) = kw
    with pytest.raises(NotImplementedError, match=f"do not support {name}="):
        rv.engine_args(**kw)
    assert rv.engine_args(block_size=16)["block_size"] == 16  # a supported option passes


def test_engine_args_sets_the_worker_extension_and_takes_processed_logprobs(monkeypatch):
    monkeypatch.setattr(rv, "installed_vllm", lambda: rv.TESTED_VLLM)
    args = rv.engine_args(logprobs_mode="processed_logprobs")
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == rv.WORKER_EXTENSION
    if not torch.cuda.is_available():  # the interpreter's engine start: eager (seconds)
        assert args["enforce_eager"] is True
        assert rv.engine_args(enforce_eager=False)["enforce_eager"] is False
    module, _, name = rv.WORKER_EXTENSION.rpartition(".")
    assert hasattr(importlib.import_module(module), name)


def test_a_checkpoints_tensors_are_the_models_pieces(tmp_path):
    """Qwen3-MoE: the checkpoint stores each expert's gate/up/down projection; the model fuses
    them (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``). Every tensor
    name of a saved checkpoint is one piece of the model, and lands in its slice."""
    from safetensors import safe_open

    from rlk_integrations.adapters.vllm.model import _pieces, _target
    from rlk_integrations.tools import zoo

    model = zoo.load_model("tiny-qwen3-moe")
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(_pieces(params).values()) == saved
    keys, dest = _target(params, "model.layers.1.mlp.experts.3.up_proj.weight")
    fused = params["model.layers.1.mlp.experts.gate_up_proj"]
    half = fused.shape[1] // 2
    assert dest.data_ptr() == fused[3, half:].data_ptr() and dest.shape == (half, fused.shape[2])
    assert keys < _target(params, "model.layers.1.mlp.experts.gate_up_proj")[0]
    assert _target(params, f"model.layers.1.mlp.experts.{fused.shape[0]}.up_proj.weight") is None
    assert _target(params, "model.layers.1.mlp.experts.3.gate_up_proj.weight") is None


def test_a_bucket_that_cannot_travel_is_refused_by_name():
    from rlk_integrations.adapters.vllm.worker import pack, unpack

    t = torch.ones(2, dtype=torch.bfloat16)
    got = dict(unpack(pack([("a", t), ("b", t * 2)])))  # a file's order is not the bucket's
    assert set(got) == {"a", "b"} and torch.equal(got["b"], t * 2) and got["a"].dtype == t.dtype
    with pytest.raises(ValueError, match=r"names a tensor twice: \['a'\]"):
        pack([("a", t), ("a", t)])
    with pytest.raises(TypeError, match="a: a list, not a torch.Tensor"):
        unpack([("a", [1.0, 2.0])])  # what vLLM's message queues make of a bare tensor
    with pytest.raises(TypeError, match="bucket must be safetensors bytes"):
        unpack({"a": t})


def bare_model(name: str = "tiny"):
    """An RLKForCausalLM around a transformers model, without vLLM's engine (only the weight
    bookkeeping runs: load_weights, stale_parameters, the forward's check)."""
    from torch import nn

    from rlk_integrations.adapters.vllm.model import RLKForCausalLM
    from rlk_integrations.tools import zoo

    model = RLKForCausalLM.__new__(RLKForCausalLM)
    nn.Module.__init__(model)
    hf = zoo.load_model(name)
    object.__setattr__(model, "hf", hf)
    model.model, model.lm_head, model._pushed = hf.model, hf.lm_head, None
    model._tp, model._shard_dim, model._views = (0, 1), {}, {}  # one device
    return model


def test_load_weights_checks_the_whole_bucket_then_copies_and_tracks_staleness():
    model = bare_model()
    named = [(n, p.detach().clone() + 1) for n, p in model.hf.named_parameters()]
    before = {n: p.detach().clone() for n, p in model.hf.named_parameters()}
    bad = named[:2] + [
        ("model.layers.9.mlp.up_proj.weight", named[0][1]),
        (named[2][0], named[2][1][:1]),
        (named[3][0], named[3][1].to(torch.int32)),
    ]
    with pytest.raises(ValueError, match="no weight changed, the bucket has 3 bad entries") as e:
        model.load_weights(bad)
    for named_in in ("'model.layers.9.mlp.up_proj.weight' is no parameter", "shape", "dtype"):
        assert named_in in str(e.value)
    for n, p in model.hf.named_parameters():
        assert torch.equal(p, before[n]), n  # nothing copied
    assert model.stale_parameters() == []
    model._check_fresh()

    assert model.load_weights(named[:3]) == {n for n, _ in named[:3]}
    total = len(named)
    assert len(model.stale_parameters()) == total - 3
    with pytest.raises(RuntimeError, match=f"{total - 3} of {total} tensors are stale"):
        model._check_fresh()
    model.load_weights(named[3:])  # the rest: complete
    assert model.stale_parameters() == []
    model._check_fresh()
    for n, p in model.hf.named_parameters():
        assert torch.equal(p, dict(named)[n]), n

    model.load_weights(named[:1])
    assert model.declare_partial_update() == total - 1
    model._check_fresh()


def test_load_weights_rounds_fp32_master_weights_as_the_trainer_casts_them():
    """verl's and TRL's sync send fp32 master weights into a bf16 rollout model: the copy is the
    trainer's own cast (round to nearest even), bit for bit."""
    model = bare_model()
    model.hf.to(torch.bfloat16)
    master = [
        (n, torch.randn(p.shape, dtype=torch.float32)) for n, p in model.hf.named_parameters()
    ]
    model.load_weights(master)
    for n, p in model.hf.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, dict(master)[n].to(torch.bfloat16)), n
    name, p = next(iter(model.hf.named_parameters()))
    assert not torch.equal(p.float(), dict(master)[name])  # rounded, not stored in fp32
