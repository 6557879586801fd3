"""Other frameworks on rlk, over :mod:`rlk_integrations.engine` and
:mod:`rlk_integrations.models`: vLLM (:mod:`~rlk_integrations.adapters.vllm`), TRL
(:mod:`~rlk_integrations.adapters.trl`) and Megatron-core's training glue
(:mod:`~rlk_integrations.adapters.megatron`). Each imports its framework only where it is used
(an optional dependency: ``rlk-integrations[vllm]``, ``[trl]``, ``[megatron]``).
"""

# rlk first: on a machine without a GPU it makes Triton run its interpreter, which must happen
# before transformers, Megatron-core or vLLM import triton.
import rlk  # noqa: F401
