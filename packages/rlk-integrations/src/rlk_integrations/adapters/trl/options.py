"""What :class:`~rlk_integrations.adapters.trl.RLKGRPOTrainer` cannot honour, checked before
anything is loaded: ``GRPOConfig`` options (the ``use_vllm`` ones included), trainer arguments
and model properties, each refused with a sentence that names it; and the ``generate_paged``
arguments the trainer sets itself (not ``rollout_kwargs``)."""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOConfig

#: ``generate_paged`` arguments that the trainer sets itself (not through ``rollout_kwargs``).
_ROLLOUT_OWN = (
    "model", "prompts", "max_new_tokens", "seeds", "temperature", "top_k", "top_p", "eos_token_id",
)  # fmt: skip


def unsupported_options(args: GRPOConfig, trainer_args: dict[str, Any]) -> list[str]:
    """The options of ``args`` and of the trainer's arguments that :class:`RLKGRPOTrainer`
    cannot honour, one sentence each (empty: all supported). ``trainer_args`` are
    ``GRPOTrainer.__init__``'s arguments by name."""
    bad = []
    if args.use_vllm:
        bad += _unsupported_vllm_options(args)
    if args.use_transformers_continuous_batching:
        bad.append(
            "use_transformers_continuous_batching (or use_transformers_paged): rlk's paged "
            "rollout is the continuous batching"
        )
    if args.min_p not in (None, 0.0):
        bad.append(f"min_p={args.min_p}: rlk.sample has temperature, top_k and top_p only")
    if args.repetition_penalty != 1.0:
        bad.append(f"repetition_penalty={args.repetition_penalty}: rlk.sample has none")
    if args.generation_kwargs:
        bad.append("generation_kwargs: they configure transformers' generate, which rlk replaces")
    if args.cache_implementation is not None:
        bad.append("cache_implementation: rlk's rollout has its own paged KV cache")
    if args.cast_lm_head_to_fp32:
        bad.append(
            "cast_lm_head_to_fp32=True: rlk computes the LM head in the weights' dtype on both "
            "sides (load the model in float32 for fp32 logits)"
        )
    if args.use_liger_kernel:
        bad.append("use_liger_kernel=True: rlk replaces the same layers (patch_model)")
    if args.torch_compile:
        bad.append("torch_compile=True: the rlk-patched model runs eagerly")
    if not args.temperature > 0:
        bad.append(f"temperature={args.temperature}: GRPO samples, temperature must be > 0")
    if args.max_completion_length is None:
        bad.append("max_completion_length=None: the rollout needs a token budget")
    if args.world_size > 1 or args.deepspeed or args.fsdp:
        bad.append(
            "more than one process (DDP, FSDP, DeepSpeed): the rlk trainer runs in one process"
        )
    for name in ("tools", "environment_factory", "rollout_func", "peft_config"):
        if trainer_args.get(name):
            bad.append(f"{name}: not supported by rlk's GRPO trainer")
    if trainer_args.get("quantization_config") is not None:
        bad.append("quantization_config: rlk's ops run unquantized weights")
    return bad


def _unsupported_vllm_options(args: GRPOConfig) -> list[str]:
    """The ``use_vllm`` options rlk's model in vLLM cannot honour (:func:`unsupported_options`)."""
    bad = []
    if args.vllm_mode != "colocate":
        bad.append(
            f"vllm_mode={args.vllm_mode!r}: rlk builds the colocated engine "
            "(vllm_mode='colocate'); TRL's server (trl vllm-serve) starts vLLM's own model classes"
        )
    if args.vllm_enable_sleep_mode:
        bad.append(
            "vllm_enable_sleep_mode=True: sleep level 2 discards the engine's buffers (rlk's "
            "rotary table), which TRL's weight sync does not push back"
        )
    if args.vllm_model_impl not in ("auto", "vllm"):
        bad.append(
            f"vllm_model_impl={args.vllm_model_impl!r}: rlk's model is a vLLM model class "
            "('auto' or 'vllm')"
        )
    if args.vllm_structured_outputs_regex is not None:
        bad.append(
            "vllm_structured_outputs_regex: the grammar masks the logits in place, so vLLM's "
            "log-probabilities would no longer be the ones the trainer recomputes"
        )
    if args.vllm_tensor_parallel_size != 1:
        bad.append(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: the rlk trainer runs "
            "in one process"
        )
    return bad


def _unsupported_model(model: Any, processing_class: Any) -> list[str]:
    """The model or processing-class properties the rlk trainer refuses (see
    :func:`unsupported_options`)."""
    from transformers import ProcessorMixin

    bad = []
    if isinstance(processing_class, ProcessorMixin):
        bad.append("a processor as processing_class (multimodal input): rlk runs text models")
    if isinstance(model, torch.nn.Module):
        if hasattr(model, "peft_config"):
            bad.append("a PEFT model: patch_model runs the base layers only")
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            bad.append("a quantized model: rlk's ops run unquantized weights")
    return bad
