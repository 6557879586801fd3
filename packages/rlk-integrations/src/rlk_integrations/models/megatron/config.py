"""Megatron's ``TransformerConfig`` of a transformers Llama / Qwen2 / Qwen3 config, and the
config facts the other modules read (head sizes, biases, RoPE parameters, tied embeddings).

Example::

    cfg = megatron_config(hf_model.config, dtype=torch.bfloat16)
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_integrations.models.architectures import architecture


def _dims(cfg: Any) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv, head_dim


def _check_supported(cfg: Any) -> None:
    if architecture(cfg, "Megatron").moe:
        raise NotImplementedError(
            f"rlk's Megatron integration has no mixture-of-experts layers ({cfg.model_type}); "
            "run the model through rlk_integrations.models.transformers.patch_model"
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


def _qkv_bias(cfg: Any) -> bool:
    return cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))


def _rope(cfg: Any) -> dict[str, Any]:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if not rope:  # older transformers configs
        rope = dict(getattr(cfg, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return rope


def _tied(cfg: Any) -> bool:
    return bool(getattr(cfg, "tie_word_embeddings", False))


def megatron_config(hf_config: Any, *, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A ``TransformerConfig`` with the transformers model's sizes (no dropout, no fusions,
    CPU initialisation, ``softmax_scale = head_dim ** -0.5`` as in transformers)."""
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
        qk_layernorm=hf_config.model_type == "qwen3",
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
    kw.update(overrides)
    return TransformerConfig(**kw)
