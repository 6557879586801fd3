"""Rollout engines and the training side, over :mod:`rlk_integrations.models`.

- :mod:`~rlk_integrations.engine.registry`: the engines by name (torch-free: the command line
  reads it); :mod:`~rlk_integrations.engine.engines`: the protocol (``RolloutEngine``,
  ``RolloutOptions``, ``Sample``, ``RolloutResult``) and ``create`` / ``available``.
- :mod:`~rlk_integrations.engine.rollout` (``padded``), :mod:`~rlk_integrations.engine.paged`
  and :mod:`~rlk_integrations.engine.paged_step` (``paged``, continuous batching), with the
  fused projections of :mod:`~rlk_integrations.engine.fused`.
- :mod:`~rlk_integrations.engine.training` (packed log-probabilities, CUDA graphs, compiled,
  GRPO and PPO steps), :mod:`~rlk_integrations.engine.critic` (the value head) and
  :mod:`~rlk_integrations.engine.tp_workers` (tensor-parallel processes).

This module imports nothing, so that importing the registry does not import torch; each engine
module imports rlk itself before anything that imports triton.
"""
