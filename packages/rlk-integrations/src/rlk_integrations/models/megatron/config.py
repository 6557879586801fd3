"""Megatron's ``TransformerConfig`` of a transformers Llama / Qwen2 / Qwen3 / Qwen3-MoE /
Qwen2-MoE config, and the config facts the other modules read (head sizes, biases, RoPE
parameters, tied embeddings, which layers are mixtures of experts).

A Qwen3-MoE or Qwen2-MoE config maps to Megatron's MoE fields: ``num_experts`` ->
``num_moe_experts``, ``num_experts_per_tok`` -> ``moe_router_topk``, ``moe_intermediate_size``
-> ``moe_ffn_hidden_size``, ``norm_topk_prob`` -> ``moe_router_pre_softmax = not norm_topk_prob``
(Megatron's softmax over the top k logits is transformers' renormalised top-k probabilities),
``mlp_only_layers`` / ``decoder_sparse_step`` -> a ``moe_layer_freq`` list, and Qwen2-MoE's
``shared_expert_intermediate_size`` -> ``moe_shared_expert_intermediate_size`` with
``moe_shared_expert_gate`` (its sigmoid gate). The Megatron MoE options rlk's MoE layer cannot
honour are refused by name (:func:`check_moe_options`).

Example::

    cfg = megatron_config(hf_model.config, dtype=torch.bfloat16)
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_integrations.models.architectures import architecture

#: The transformers ``model_type`` s that :func:`megatron_config` (and so ``build_gpt_model``)
#: takes.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")


def _dims(cfg: Any) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv, head_dim


def _check_supported(cfg: Any) -> None:
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"rlk's Megatron integration supports {SUPPORTED_MODEL_TYPES}, "
            f"not model_type={model_type!r}"
        )
    architecture(cfg, "Megatron")
    if getattr(cfg, "output_router_logits", False):
        raise NotImplementedError(
            "output_router_logits=True (the auxiliary load-balancing loss) is not supported: "
            "rlk's MoE layer computes no auxiliary loss"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"needs hidden_act='silu', got {cfg.hidden_act!r}")
    if getattr(cfg, "mlp_bias", False):
        raise NotImplementedError("MLP biases are not supported")
    if cfg.model_type == "llama" and getattr(cfg, "attention_bias", False):
        # Llama's attention_bias also puts a bias on o_proj, which the local spec would need
        # add_bias_linear for (and then on every linear).
        raise NotImplementedError("Llama attention_bias=True is not supported")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise NotImplementedError("sliding-window layers are not supported")


def _qk_norm(cfg: Any) -> bool:
    return cfg.model_type in ("qwen3", "qwen3_moe")


def _qkv_bias(cfg: Any) -> bool:
    if cfg.model_type == "qwen2_moe":
        return bool(cfg.qkv_bias)
    return cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))


def _rope(cfg: Any) -> dict[str, Any]:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if not rope:  # older transformers configs
        rope = dict(getattr(cfg, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return rope


def _tied(cfg: Any) -> bool:
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _moe(cfg: Any) -> bool:
    return architecture(cfg, "Megatron").moe != ()


def moe_layers(cfg: Any) -> list[bool]:
    """Which decoder layers of a transformers config are sparse (transformers' rule: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``); all False when dense."""
    n = cfg.num_hidden_layers
    if not _moe(cfg) or not getattr(cfg, "num_experts", 0):
        return [False] * n
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def _shared_expert(cfg: Any) -> dict[str, Any]:
    """Megatron's shared-expert fields of a transformers MoE config: Qwen2-MoE's sigmoid-gated
    shared expert, or none."""
    size = getattr(cfg, "shared_expert_intermediate_size", None) or None
    return dict(moe_shared_expert_intermediate_size=size, moe_shared_expert_gate=size is not None)


def _moe_fields(cfg: Any) -> dict[str, Any]:
    return dict(
        **_shared_expert(cfg),
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_layer_freq=[int(sparse) for sparse in moe_layers(cfg)],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )


#: Megatron MoE options and the one value each may take here (the value rlk's MoE layer
#: computes): anything else changes the forward or the gradients in a way
#: :func:`rlk.moe_route` / :func:`rlk.moe_experts` do not, or asks for a fused Megatron kernel
#: rlk's layer would not run.
MOE_FIXED: dict[str, Any] = {
    "moe_router_enable_expert_bias": False,  # aux-loss-free load balancing's bias
    "moe_router_force_load_balancing": False,
    "moe_expert_capacity_factor": None,  # token dropping
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_dropping": False,
    "moe_shared_expert_overlap": False,
    "moe_grouped_gemm": False,
    "moe_use_legacy_grouped_gemm": False,
    "moe_router_dtype": None,  # the router's logits in the model's dtype, as transformers
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_limited_devices": None,
    "moe_z_loss_coeff": None,
    "moe_input_jitter_eps": None,
    "moe_apply_probs_on_input": False,
    "moe_latent_size": None,
    "moe_enable_routing_replay": False,
    "moe_router_padding_for_fp8": False,
    "moe_router_padding_for_quantization": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    "moe_layer_recompute": False,
    "moe_enable_deepep": False,
}


def check_moe_options(config: Any) -> None:
    """Refuse the Megatron ``TransformerConfig`` MoE options rlk's MoE layer cannot honour
    (:data:`MOE_FIXED`, a non-zero auxiliary-loss coefficient, a ``flex`` dispatcher, expert
    tensor parallelism, recomputing the MoE layer), each by name. ``NotImplementedError``.
    Expert parallelism (``expert_model_parallel_size``) is honoured: see
    :mod:`rlk_integrations.models.megatron.moe`."""
    for name, want in MOE_FIXED.items():
        got = getattr(config, name, want)  # mcore API: a field a release does not have
        if got != want and not (want is None and got == 0):
            raise NotImplementedError(
                f"Megatron's {name}={got!r} is not supported by rlk's MoE layer (needs {want!r})"
            )
    coeff = config.moe_aux_loss_coeff
    if any(c for c in (coeff if isinstance(coeff, list) else [coeff])):
        raise NotImplementedError(
            f"Megatron's moe_aux_loss_coeff={coeff!r}: rlk's MoE layer computes no auxiliary "
            "load-balancing loss (needs 0)"
        )
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise NotImplementedError(
            f"Megatron's moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} is not "
            "supported by rlk's MoE layer (allgather or alltoall)"
        )
    if config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ()):
        raise NotImplementedError(
            "Megatron's recompute_modules with 'moe': rlk's MoE layer does not recompute itself"
        )
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if etp not in (None, 1):
        raise NotImplementedError(
            f"Megatron's expert_tensor_parallel_size={etp}: rlk's experts are not split by "
            "tensor parallelism (needs 1)"
        )


def megatron_config(hf_config: Any, *, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A ``TransformerConfig`` with the transformers model's sizes (no dropout, no fusions,
    CPU initialisation, ``softmax_scale = head_dim ** -0.5`` as in transformers); a Qwen3-MoE
    config gets Megatron's MoE fields (the module docstring) and :func:`check_moe_options`
    refuses ``overrides`` that rlk's MoE layer cannot honour."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_supported(hf_config)
    heads, kv, head_dim = _dims(hf_config)
    kw: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=kv,
        kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=_qkv_bias(hf_config),
        qk_layernorm=_qk_norm(hf_config),
        softmax_scale=head_dim**-0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    if _moe(hf_config):
        kw.update(_moe_fields(hf_config))
    kw.update(overrides)
    config = TransformerConfig(**kw)
    if config.num_moe_experts:
        check_moe_options(config)
        for name, want in _shared_expert(hf_config).items():
            if getattr(config, name) != want:
                raise NotImplementedError(
                    f"Megatron's {name}={getattr(config, name)!r}: the checkpoint's shared "
                    f"expert needs {want!r}"
                )
    return config
