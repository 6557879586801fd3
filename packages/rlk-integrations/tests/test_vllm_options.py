"""What rlk's vLLM plugin refuses, and how it says so (no vLLM needed: the checks read vLLM's
config objects, stood in for here by namespaces with the same fields)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(quantization="fp8"), "quantization='fp8'"),
        (dict(lora=object()), "LoRA"),
        (dict(spec=object()), "speculative decoding"),
        (dict(tp=2), "tensor_parallel_size=2"),
        (dict(pp=2), "pipeline_parallel_size=2"),
        (dict(cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
        (dict(logprobs_mode="processed_logprobs"), "logprobs_mode='processed_logprobs'"),
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
        dict(logprobs_mode="processed_logprobs"),
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
