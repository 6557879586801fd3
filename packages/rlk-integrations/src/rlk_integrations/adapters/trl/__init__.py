"""rlk inside TRL's ``GRPOTrainer``: sampling log-probabilities equal the trainer's, bit for bit.

:class:`RLKGRPOTrainer` is a drop-in subclass of ``trl.GRPOTrainer`` (TRL 1.16, see
:data:`TESTED_TRL`). It patches the policy (and the reference model, with ``beta != 0``) with
:func:`rlk_integrations.models.transformers.patch_model`, then:

- generates the completions with a :class:`rlk_integrations.engine.paged.PagedEngine` that it keeps
  between generation rounds (continuous batching on a paged KV cache, CUDA graphs of the decode
  steps on a GPU, captured once, :func:`rlk.sample` with
  ``GRPOConfig``'s ``temperature``, ``top_k`` and ``top_p``; each completion's seed is
  :func:`rollout_seeds` of ``args.seed``, the generation round, the process and the row) and
  hands TRL the completion ids and their sampling log-probabilities;
- computes every per-token log-probability TRL asks for (old, current, reference) and the
  entropies with :func:`rlk.linear_logprobs` on the patched model, each micro-batch of rows
  packed into one ``[1, T]`` row (:func:`rlk_integrations.engine.training.packed_logprobs`) at the
  rollout's temperature and logits dtype (``graph_logprobs=True``: through
  :class:`rlk_integrations.engine.training.GraphedLogprobs`, CUDA graphs on a GPU, the same bits).

With ``GRPOConfig(use_vllm=True, vllm_mode="colocate")`` vLLM generates instead, on rlk's model
classes (:mod:`rlk_integrations.adapters.vllm`): the trainer hooks the ``vllm.LLM`` that TRL
builds (TRL 1.16 has no argument for more engine arguments) and adds
:func:`rlk_integrations.adapters.vllm.engine_args` and the trainer's weight dtype to TRL's own
(``external_launcher``, ``logprobs_mode="processed_logprobs"``, ...). TRL's weight sync is
unchanged: before the first generation and the first after each optimizer step it calls the
engine model's ``load_weights`` once per parameter (rlk's model takes any subset per call and
refuses to generate until every tensor has come) and resets the prefix cache. vLLM's
``processed_logprobs`` on rlk's model are ``log_softmax(logits / temperature)`` over the whole
vocabulary, TRL's ``sampling_per_token_logps``; rlk recomputes them bit for bit, so TRL's own
``sampling/sampling_logp_difference/max`` is 0 at every step. As in stock TRL the engine loads
the checkpoint at the model's ``name_or_path`` (with its tokenizer); an engine argument rlk's
vLLM models refuse raises ``NotImplementedError`` naming it, and an engine that does not run
rlk's model (the plugin did not load), or no engine built where TRL 1.16 builds it,
``RuntimeError``. On 2 CPU cores it starts in about 10 s
(eager: ``engine_args`` sets ``enforce_eager`` without CUDA).

So wherever the weights are those that sampled (the old log-probabilities, and the current ones
in the first iteration over a batch), TRL's log-probabilities are the sampling ones bit for bit,
and the importance ratio ``exp(logp - old_logp)`` of that iteration is exactly 1: the
importance-sampling correction that TRL applies to vLLM rollouts has nothing to correct. The
trainer checks it: each such comparison is logged under TRL's names
(``sampling/sampling_logp_difference/{mean,max}``,
``sampling/importance_sampling_ratio/{min,mean,max}``), and a difference raises
``RuntimeError`` (``check_logprobs=False`` only logs it).

TRL options (``GRPOConfig`` fields and trainer arguments):

- supported: every ``loss_type`` (``dapo``, ``grpo``, ``bnpo``, ``dr_grpo``, ``luspo``,
  ``cispo``, ``sapo``, ``vespo``), ``beta`` (the reference model is patched too),
  ``use_bias_correction_kl``, ``sync_ref_model``, ``num_iterations``,
  ``gradient_accumulation_steps``, ``steps_per_generation`` / ``generation_batch_size``,
  ``epsilon``, ``epsilon_high``, ``delta``, ``importance_sampling_level``, ``scale_rewards``,
  ``multi_objective_aggregation``, ``reward_weights``, reward functions (callables, async, reward
  models), ``mask_truncated_completions``, ``off_policy_mask_threshold`` (fed the sampling
  log-probabilities), ``top_entropy_quantile``, ``entropy_coef`` / ``use_adaptive_entropy``
  (entropies from :func:`rlk.linear_logprobs`), ``temperature`` (> 0), ``top_k``, ``top_p``,
  ``max_completion_length``, ``num_generations`` / ``num_generations_eval``, several EOS ids
  (a completion ends at the first), ``pad_to_multiple_of``, ``gradient_checkpointing``,
  ``disable_dropout``, ``bf16`` / ``fp16`` when the weights are in that dtype, conversational and
  plain-text prompts, evaluation.
- ``use_vllm=True`` with ``vllm_mode="colocate"``, ``vllm_gpu_memory_utilization``,
  ``vllm_max_model_length``; ``vllm_importance_sampling_correction`` and
  ``vllm_importance_sampling_mode`` and its clip bounds are TRL's (the ratio they correct is 1;
  TRL logs it). Without vLLM they have no effect, as in stock TRL without vLLM.
- rejected with a ``ValueError`` naming the option: ``vllm_mode="server"`` (TRL's server builds
  vLLM's own model classes), ``vllm_enable_sleep_mode`` (sleep level 2 drops buffers that TRL's
  sync does not push back), ``vllm_model_impl`` other than ``auto``/``vllm``,
  ``vllm_structured_outputs_regex`` (the grammar masks the logits the values come from),
  ``vllm_tensor_parallel_size > 1``, ``rollout_kwargs`` with ``use_vllm``;
  ``use_transformers_continuous_batching`` (``use_transformers_paged``),
  ``min_p``, ``repetition_penalty != 1``, ``generation_kwargs``, ``cache_implementation``,
  ``cast_lm_head_to_fp32``, ``use_liger_kernel``, ``torch_compile``, ``temperature <= 0``,
  ``max_completion_length=None``, ``bf16``/``fp16`` mixed precision over weights of another
  dtype, multimodal input (a processor as ``processing_class``, ``image``/``images`` columns),
  ``tools``, ``environment_factory``, ``rollout_func``, ``peft_config`` and PEFT models,
  ``quantization_config`` and quantized models, more than one process (DDP, FSDP, DeepSpeed),
  and MoE auxiliary losses. Architectures other than Llama, Qwen2 and Qwen3 are refused by
  ``patch_model`` (``NotImplementedError``).

:class:`StockGRPOTrainer` is TRL's trainer unchanged (transformers' ``generate``, TRL's own
log-probabilities) that also records the sampling log-probabilities of ``generate``'s logits and
logs the same comparison: the baseline that shows the mismatch rlk removes.

Example::

    from rlk_integrations.adapters.trl import RLKGRPOTrainer

    trainer = RLKGRPOTrainer(model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds)
    trainer.train()  # sampling/sampling_logp_difference/max is 0 at every step

Install: ``pip install "rlk[trl]"`` (TRL 1.16).

Modules: :mod:`~.trainer` (:class:`RLKGRPOTrainer`), :mod:`~.stock`
(:class:`StockGRPOTrainer`), :mod:`~.check` (the log-probability comparison both run),
:mod:`~.generation` (seeds, EOS, the ``use_vllm`` hook), :mod:`~.options` (what is refused),
:mod:`~.release` (:data:`TESTED_TRL`), :mod:`~.tokenizer` (:func:`char_tokenizer`).
"""

from __future__ import annotations

# TRL first, so that its absence is this message; the modules below import it themselves.
try:
    import trl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    from trl.models.utils import unwrap_model_for_generation  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        f'rlk_integrations.adapters.trl needs TRL ({e}): pip install "rlk[trl]"'
    ) from e

# The public names of the modules below.
from rlk_integrations.adapters.trl.generation import rollout_seeds
from rlk_integrations.adapters.trl.options import unsupported_options
from rlk_integrations.adapters.trl.release import TESTED_TRL
from rlk_integrations.adapters.trl.stock import StockGRPOTrainer
from rlk_integrations.adapters.trl.tokenizer import CHARS, char_tokenizer
from rlk_integrations.adapters.trl.trainer import RLKGRPOTrainer

__all__ = [
    "CHARS",
    "TESTED_TRL",
    "RLKGRPOTrainer",
    "StockGRPOTrainer",
    "char_tokenizer",
    "rollout_seeds",
    "unsupported_options",
]
