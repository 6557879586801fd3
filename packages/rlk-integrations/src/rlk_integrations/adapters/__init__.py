"""Other frameworks on rlk, over :mod:`rlk_integrations.engine` and
:mod:`rlk_integrations.models`: vLLM (:mod:`~rlk_integrations.adapters.vllm`), verl's actor
engine (:mod:`~rlk_integrations.adapters.verl`), TRL (:mod:`~rlk_integrations.adapters.trl`) and
Megatron-core's training glue (:mod:`~rlk_integrations.adapters.megatron`), each an optional
dependency (``rlk-integrations[vllm]``, ``[verl]``, ``[trl]``, ``[megatron]``); TRL and verl
are imported by the modules that subclass their classes, vLLM and Megatron-core where used.
"""

# rlk first: on a machine without a GPU it makes Triton run its interpreter, which must happen
# before transformers, Megatron-core or vLLM import triton.
import rlk  # noqa: F401
