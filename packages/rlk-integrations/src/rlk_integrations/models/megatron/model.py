"""rlk's ``GPTModel``: the layer and block specs on the modules of
:mod:`rlk_integrations.models.megatron.modules` (and, for a Qwen3-MoE or Qwen2-MoE model's
sparse layers, :mod:`rlk_integrations.models.megatron.moe`), rotary from the transformers
model's own table (:mod:`rlk_integrations.models.rotary`), and :func:`build_gpt_model` from a
transformers config.

Example::

    mg = build_gpt_model(hf_model.config, dtype=torch.bfloat16, leaves=8)
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_integrations.models.megatron.config import _rope, _tied, megatron_config
from rlk_integrations.models.megatron.modules import (
    RlkCoreAttention,
    RlkRMSNorm,
    _make_linears,
    _make_mlp,
    _make_self_attention,
    _mlp_spec,
)
from rlk_integrations.models.megatron.moe import moe_spec
from rlk_integrations.models.rotary import RotaryTable


def rotary_table(hf_config: Any) -> Any:
    """The fp32 cos/sin table of the transformers model, computed by transformers' own rotary
    module in the transformers integration's fixed chunks: the rollout's rotary bits."""
    return RotaryTable.for_config(hf_config)


def layer_spec(
    rotary: Any, *, qk_layernorm: bool = False, leaves: int | None = None, moe: bool = False
):
    """A ``TransformerLayer`` spec on rlk ops (see the module docstring).

    ``rotary``: :func:`rotary_table`'s object. ``leaves``: None for TP=1 on :func:`rlk.linear`;
    a power of two for :mod:`rlk.parallel`'s tree-ordered linears, whose bits do not depend on
    the TP size (the rollout must then run o_proj/down_proj as ``tree_linear`` with the same
    ``leaves``). ``moe``: a sparse layer (:func:`rlk_integrations.models.megatron.moe.moe_spec`;
    no ``leaves``: the rollout has no tree-ordered MoE layout).
    """
    if moe and leaves is not None:
        raise NotImplementedError(
            "leaves (tree-ordered row-parallel linears) has no MoE layout: the rollout's MoE "
            "model refuses it too"
        )
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    col_cls, row_cls = _make_linears()
    col = ModuleSpec(module=col_cls, params={"rlk_leaves": leaves})
    row = ModuleSpec(module=row_cls, params={"rlk_leaves": leaves})
    qk_norm = RlkRMSNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RlkRMSNorm,
            self_attention=ModuleSpec(
                module=_make_self_attention(),
                params={"attn_mask_type": AttnMaskType.causal, "rlk_rotary": rotary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=col,
                    core_attention=RlkCoreAttention,
                    linear_proj=row,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RlkRMSNorm,
            mlp=(
                moe_spec(col, row)
                if moe
                else _mlp_spec(_make_mlp(), MLPSubmodules(linear_fc1=col, linear_fc2=row))
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(config: Any, rotary: Any, *, leaves: int | None = None):
    """A ``TransformerBlock`` spec: :func:`layer_spec` for every layer (sparse where
    ``config.moe_layer_freq`` says so) and an rlk final norm (``GPTModel`` would otherwise build
    the final norm from Megatron's global norm class)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    pattern = _moe_pattern(config)
    specs = {
        moe: layer_spec(rotary, qk_layernorm=config.qk_layernorm, leaves=leaves, moe=moe)
        for moe in set(pattern)
    }
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[specs[moe] for moe in pattern], layer_norm=RlkRMSNorm
        ),
    )


def _moe_pattern(config: Any) -> list[bool]:
    """Which layers of a Megatron config are sparse (its ``moe_layer_freq``, a list from
    :func:`megatron_config`, or Megatron's int form: every n-th layer from the first)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    if len(freq) != config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {config.num_layers} layers")
    return [bool(f) for f in freq]


def build_gpt_model(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    use_rlk: bool = True,
    leaves: int | None = None,
    **config_overrides: Any,
):
    """A Megatron-core ``GPTModel`` with the transformers config's architecture.

    ``use_rlk=True``: :func:`block_spec` (rotary inside the attention, so
    ``position_embedding_type="none"``). ``use_rlk=False``: Megatron's stock local spec with its
    own RoPE (default rope type only; llama3 scaling maps to ``rope_scaling``), for reference.
    Needs Megatron's model-parallel state initialised.
    """
    from megatron.core.models.gpt import GPTModel

    config = megatron_config(hf_config, dtype=dtype, **config_overrides)
    rope = _rope(hf_config)
    common = dict(
        config=config,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        share_embeddings_and_output_weights=_tied(hf_config),
    )
    if use_rlk:
        spec = block_spec(config, rotary_table(hf_config), leaves=leaves)
        model = GPTModel(transformer_layer_spec=spec, position_embedding_type="none", **common)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        kind = rope.get("rope_type", "default")
        if kind not in ("default", "llama3"):
            raise NotImplementedError(f"stock Megatron RoPE for rope_type {kind!r}")
        if config.num_moe_experts:  # sparse and dense layers by moe_layer_freq
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            spec = get_gpt_decoder_block_spec(config, False, normalization="RMSNorm")
        else:
            spec = get_gpt_layer_local_spec(
                normalization="RMSNorm", qk_layernorm=config.qk_layernorm
            )
        model = GPTModel(
            transformer_layer_spec=spec,
            position_embedding_type="rope",
            rotary_base=rope.get("rope_theta", 10000.0),
            rope_scaling=kind == "llama3",
            rope_scaling_factor=rope.get("factor", 8.0),
            **common,
        )
        # Megatron's local norms ignore params_dtype (training wraps the model in
        # Float16Module, which casts it whole): cast here so that every weight has ``dtype``.
        model.to(dtype)
    model._rlk_hf_config = hf_config
    return model
