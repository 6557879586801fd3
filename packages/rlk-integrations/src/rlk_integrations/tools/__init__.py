"""Tools over every other layer: ``rlk consistency`` (:mod:`~rlk_integrations.tools.consistency`;
its report, :mod:`~rlk_integrations.tools.consistency_report`; its training recomputes,
:mod:`~rlk_integrations.tools.recompute`),
``rlk bench``'s e2e families (:mod:`~rlk_integrations.tools.e2e_bench`,
:mod:`~rlk_integrations.tools.e2e_compile`) and the built-in random-weight model configs
(:mod:`~rlk_integrations.tools.zoo`: ``tiny``, ``qwen2-0.5b``, ...).
"""

# rlk first: on a machine without a GPU it makes Triton run its interpreter, which must happen
# before transformers, Megatron-core or vLLM import triton.
import rlk  # noqa: F401
