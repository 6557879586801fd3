"""Train with Megatron-core's ``GPTModel`` on rlk ops, with the rollout's bits.

Three pieces:

- **Weights.** :func:`hf_to_megatron` / :func:`megatron_to_hf` convert between a transformers
  Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE ``*ForCausalLM`` state dict and the state dict of
  Megatron-core's ``GPTModel`` (the local, non-TransformerEngine, layer spec; TP size 1).
  Only views, ``cat`` and ``split``: the round trip is bitwise. Megatron's fused QKV is grouped
  per KV head: for each of the ``num_query_groups`` groups, that group's q heads, then its k
  head, then its v head (weight rows and, for Qwen2, the bias). ``linear_fc1`` is
  ``cat(gate, up)``. :func:`shard_for_tp` cuts the TP=1 state dict into a rank's shard (fc1's
  shard is ``cat(gate_r, up_r)``, as Megatron lays it out).
- **Ops.** :func:`layer_spec` / :func:`block_spec` build a ``TransformerBlock`` spec whose
  modules run on rlk: column/row-parallel linears on :func:`rlk.linear` (TP=1) or on
  :mod:`rlk.parallel`'s tree-ordered linears (``leaves`` set, any power-of-two TP), RMSNorm on
  :func:`rlk.rms_norm` (q/k norm too), SwiGLU on :func:`rlk.silu_and_mul`, rotary on
  :func:`rlk.apply_rotary` with the *transformers* model's cos/sin table (the same chunked table
  as :mod:`rlk_integrations.models.transformers`, so the rollout's rotary bits), and core attention
  on :func:`rlk.attention` over packed sequences (``PackedSeqParams`` cu_seqlens, ``thd``) or one
  sequence per batch row (``sbhd``). :func:`build_gpt_model` makes such a ``GPTModel`` (or a
  stock one, ``use_rlk=False``) from a transformers config, and :func:`packed_logprobs` is the
  Megatron twin of :func:`rlk_integrations.engine.training.packed_logprobs`.
- **Mixture of experts.** A Qwen3-MoE or Qwen2-MoE model's sparse layers are Megatron's
  ``MoELayer`` with its ``TopKRouter``, ``SequentialMLP`` experts and (Qwen2-MoE) gated
  ``SharedExpertMLP`` (their parameter names), run on :func:`rlk.moe_route` and
  :func:`rlk.moe_experts`: rlk's own sparse block's bits
  (:mod:`rlk_integrations.models.megatron.moe`). At expert parallelism > 1 (Megatron's EP
  group, :func:`init_distributed` ``expert_parallel=``, :func:`shard_for_ep`) the experts run
  as :func:`rlk.parallel.expert_parallel_moe_experts`, one device's bits; tensor parallelism
  stays 1. The Megatron MoE options rlk cannot honour are refused by name
  (:func:`check_moe_options`, :data:`MOE_FIXED`); :class:`RoutingLog` records each token's
  experts.

:func:`init_single_process` (or :func:`init_model_parallel` on an initialised TP group) sets
up Megatron's model-parallel state and RNG tracker for these models and returns the teardown;
:func:`init_distributed` does it for one spawned TP rank (NCCL on ``cuda:<rank>``, gloo on
CPU), and :func:`load_hf_weights` loads a rank's shard (``rank=``, ``world_size=``).

The rlk model is built with ``position_embedding_type="none"``: rotary is applied inside
:class:`RlkSelfAttention` from per-token positions (restarting at each packed sequence), so
Megatron's own ``RotaryEmbedding`` (which is CUDA-only in 0.16 and computes its tables its own
way) is not used. The residual adds stay Megatron's (``bias_dropout_add`` with no bias and no
dropout: ``residual + out`` rounded once, the same bits as the transformers integration's fused
``rms_norm(..., residual=)``).

Modules: the model side is :mod:`rlk_integrations.models.megatron` (``config``, ``modules``,
``model``, ``weights``); the training glue is here: :mod:`.groups` (process groups) and
:mod:`.logprobs` (the training recompute). This package re-exports the public names of both.

Versions: written against megatron-core 0.16.1 (Python 3.11) and meant for 0.19.x (Python
3.12). Version-sensitive spots are marked "mcore API".

Example::

    mg = build_gpt_model(hf_model.config, dtype=torch.bfloat16)
    load_hf_weights(mg, hf_model.state_dict(), hf_model.config)
    lps = packed_logprobs(mg, samples)          # == training.packed_logprobs(hf_model, samples)
"""

from __future__ import annotations

from rlk_integrations.adapters.megatron.groups import (
    init_distributed,
    init_model_parallel,
    init_single_process,
)
from rlk_integrations.adapters.megatron.logprobs import (
    hidden_states,
    output_weight,
    packed_logprobs,
    packed_seq_params,
)
from rlk_integrations.models.megatron.config import (
    MOE_FIXED,
    SUPPORTED_MODEL_TYPES,
    check_moe_options,
    megatron_config,
)
from rlk_integrations.models.megatron.model import (
    block_spec,
    build_gpt_model,
    layer_spec,
    rotary_table,
)
from rlk_integrations.models.megatron.modules import RlkCoreAttention, RlkRMSNorm
from rlk_integrations.models.megatron.moe import RoutingLog
from rlk_integrations.models.megatron.weights import (
    hf_to_megatron,
    load_hf_weights,
    megatron_to_hf,
    shard_for_ep,
    shard_for_tp,
)

__all__ = [
    "MOE_FIXED",
    "SUPPORTED_MODEL_TYPES",
    "RlkCoreAttention",
    "RlkRMSNorm",
    "RoutingLog",
    "block_spec",
    "build_gpt_model",
    "check_moe_options",
    "hf_to_megatron",
    "hidden_states",
    "init_distributed",
    "init_model_parallel",
    "init_single_process",
    "layer_spec",
    "load_hf_weights",
    "megatron_config",
    "megatron_to_hf",
    "output_weight",
    "packed_logprobs",
    "packed_seq_params",
    "rotary_table",
    "shard_for_ep",
    "shard_for_tp",
]
