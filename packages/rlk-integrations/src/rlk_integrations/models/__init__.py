"""Models on rlk ops, the bottom layer: imports nothing else of rlk_integrations.

- :mod:`~rlk_integrations.models.transformers`: patch a transformers Llama / Qwen2 / Qwen3 /
  Qwen3-MoE model so every op of its decoder runs through rlk (``patch_model``).
- :mod:`~rlk_integrations.models.architectures` (the module classes replaced per
  architecture), :mod:`~rlk_integrations.models.rotary` (the chunked cos/sin table),
  :mod:`~rlk_integrations.models.moe` (the MoE block on rlk and its routing log),
  :mod:`~rlk_integrations.models.tp` (a patched model's tensor-parallel shard).
- :mod:`~rlk_integrations.models.megatron`: Megatron-core's ``GPTModel`` on rlk (config, layer
  specs, modules, weight conversion); the training glue is
  :mod:`rlk_integrations.adapters.megatron`.
"""

# rlk first: on a machine without a GPU it makes Triton run its interpreter, which must happen
# before transformers, Megatron-core or vLLM import triton.
import rlk  # noqa: F401
