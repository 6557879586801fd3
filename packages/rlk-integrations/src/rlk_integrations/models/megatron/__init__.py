"""Megatron-core's ``GPTModel`` on rlk ops, the model side: :mod:`.config` (a transformers
config as Megatron's ``TransformerConfig``), :mod:`.modules` (the rlk linears, norms and core
attention), :mod:`.moe` (Qwen3-MoE's and Qwen2-MoE's sparse layers on rlk's MoE ops),
:mod:`.model` (layer / block specs and ``build_gpt_model``) and :mod:`.weights` (transformers
<-> Megatron state dicts, TP shards).

The process groups and the training recompute are the adapter's
(:mod:`rlk_integrations.adapters.megatron`, which re-exports the public names of both). Megatron-
core is an optional dependency (``rlk-integrations[megatron]``): each module imports it inside
the functions that use it, so that importing this package does not need it.
"""
