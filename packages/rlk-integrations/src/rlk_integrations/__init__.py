"""Engines running on rlk ops.

- :mod:`rlk_integrations.transformers`: patch a transformers Llama/Qwen2/Qwen3 model so every op
  of its decoder runs through rlk (``patch_model`` / ``unpatch_model``).
- :mod:`rlk_integrations.rollout`: batched generation with ``rlk.sample`` and the rollout's
  log-probabilities.
- :mod:`rlk_integrations.paged`: the same rollout with continuous batching on a paged KV cache
  (``generate_paged``, attention by ``rlk.paged_attention``); the same bits as the padded batch.
- :mod:`rlk_integrations.engines`: the rollout-engine protocol (``RolloutEngine``) and the
  lookups of its registry, through which ``rlk consistency`` and the e2e bench run every engine.
- :mod:`rlk_integrations.training`: recompute the same log-probabilities in packed micro-batches
  with ``rlk.linear_logprobs``, and a GRPO step.
- :mod:`rlk_integrations.trl`: TRL's ``GRPOTrainer`` on rlk (``RLKGRPOTrainer``: the paged
  rollout and ``rlk.linear_logprobs``, sampling log-probabilities equal to the trainer's).
- :mod:`rlk_integrations.models`: built-in random-init configs (``tiny``, ``qwen2-0.5b``, ...).

Also :mod:`~rlk_integrations.architectures` (the module classes replaced per architecture),
:mod:`~rlk_integrations.rotary`, :mod:`~rlk_integrations.megatron`, :mod:`~rlk_integrations.tp`
and :mod:`~rlk_integrations.tp_workers` (tensor parallelism), :mod:`~rlk_integrations.consistency`
(``rlk consistency``; its arguments are declared by the module ``rlk_integrations_cli``) and
:mod:`~rlk_integrations.e2e_bench` (``rlk bench``'s e2e and e2e-long families).

Each module imports ``transformers`` lazily: ``pip install "rlk[transformers]"``;
:mod:`~rlk_integrations.trl` needs TRL: ``pip install "rlk[trl]"``.
"""

# rlk first: on a machine without a GPU it makes Triton run its interpreter, which must happen
# before transformers or Megatron-core import triton.
import rlk  # noqa: F401
