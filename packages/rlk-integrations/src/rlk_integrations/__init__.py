"""rlk in training and rollout engines, in four layers whose imports run one way (each imports
only the layers below it):

- :mod:`rlk_integrations.models`: transformers models patched onto rlk ops
  (:func:`~rlk_integrations.models.transformers.patch_model`; architectures, rotary, MoE,
  tensor-parallel shards) and Megatron-core's model on rlk
  (:mod:`~rlk_integrations.models.megatron`).
- :mod:`rlk_integrations.engine`: the rollout engines (``padded``: :mod:`~.engine.rollout`;
  ``paged``: :mod:`~.engine.paged`, with :mod:`~.engine.fused` projections), their protocol and
  registry (:mod:`~.engine.engines`, :mod:`~.engine.registry`), and the training side
  (:mod:`~.engine.training`: packed log-probabilities, CUDA graphs, compiled, GRPO/PPO steps;
  :mod:`~.engine.critic`; :mod:`~.engine.tp_workers`).
- :mod:`rlk_integrations.adapters`: other frameworks on rlk: vLLM (:mod:`~.adapters.vllm`),
  verl's actor engine (:mod:`~.adapters.verl`), TRL (:mod:`~.adapters.trl`), Megatron-core's
  training glue (:mod:`~.adapters.megatron`).
- :mod:`rlk_integrations.tools`: ``rlk consistency`` (:mod:`~.tools.consistency`), ``rlk
  bench``'s e2e families (:mod:`~.tools.e2e_bench`) and the built-in random-weight configs
  (:mod:`~.tools.zoo`).

The ``rlk consistency`` command's arguments live beside the package in the module
``rlk_integrations_cli``, which imports :mod:`rlk_integrations.engine.registry` alone at
import time.

This module and :mod:`rlk_integrations.engine` import nothing (the command line reads the
engine registry without torch); ``models``, ``adapters`` and ``tools`` import rlk first.
Transformers is imported lazily; :mod:`~rlk_integrations.adapters.trl` needs TRL
(``pip install "rlk[trl]"``), :mod:`~rlk_integrations.adapters.vllm` vLLM,
:mod:`~rlk_integrations.adapters.verl` verl.
"""
