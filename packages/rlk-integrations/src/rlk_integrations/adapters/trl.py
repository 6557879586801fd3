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
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        f'rlk_integrations.adapters.trl needs TRL ({e}): pip install "rlk[trl]"'
    ) from e

from rlk_integrations.engine.engines import Sample
from rlk_integrations.engine.paged import PagedEngine, generate_paged
from rlk_integrations.engine.training import GraphedLogprobs, bucket_of, packed_logprobs, pad_rows
from rlk_integrations.models.transformers import is_patched, patch_model

#: The oldest and newest TRL releases (major.minor) this integration is tested with; the extra
#: ``rlk[trl]`` declares the same range. The trainer overrides TRL methods that are not public
#: API, so another release is warned about, and one whose methods changed shape is refused.
TESTED_TRL = ((1, 16), (1, 16))

#: The TRL methods :class:`RLKGRPOTrainer` overrides, with the parameters it relies on.
_OVERRIDDEN = {
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations"),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),  # fmt: skip
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
}

#: ``generate_paged`` arguments that the trainer sets itself (not through ``rollout_kwargs``).
_ROLLOUT_OWN = (
    "model", "prompts", "max_new_tokens", "seeds", "temperature", "top_k", "top_p", "eos_token_id",
)  # fmt: skip

_MASK64 = (1 << 64) - 1
_version_warned = False


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rollout_seeds(seed: int, round_: int, rank: int, n: int) -> list[int]:
    """The ``n`` sampling seeds of one generation round: row ``i`` gets a SplitMix64 hash of
    ``(seed, round_, rank, i)`` in ``[0, 2**63)``.

    Each completion of a group (TRL repeats a prompt ``num_generations`` times) gets its own
    seed, each round and each process new ones, and a run with the same ``args.seed`` draws the
    same completions again. Example: ``rollout_seeds(42, 0, 0, 4)`` -> four distinct ints.
    """
    for name, v in (("seed", seed), ("round_", round_), ("rank", rank), ("n", n)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    out = []
    for i in range(n):
        h = 0
        for part in (seed, round_, rank, i):
            h = _splitmix64(h ^ (part & _MASK64))
        out.append(h >> 1)
    return out


def _check_trl_version() -> None:
    """Warn once outside :data:`TESTED_TRL`; raise if an overridden method changed its
    parameters (the override would then not be called the way it expects)."""
    global _version_warned
    (lo, hi), found = TESTED_TRL, trl.__version__
    m = re.match(r"(\d+)\.(\d+)", found)
    if m and not (lo <= (int(m[1]), int(m[2])) <= hi) and not _version_warned:
        _version_warned = True
        warnings.warn(
            f"rlk's TRL integration is tested with TRL {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, this "
            f"is {found}: check that sampling/sampling_logp_difference/max logs 0",
            RuntimeWarning,
            stacklevel=3,
        )
    problems = []
    for name, needs in _OVERRIDDEN.items():
        method = getattr(GRPOTrainer, name, None)
        if method is None:
            problems.append(f"GRPOTrainer has no {name}")
            continue
        params = inspect.signature(method).parameters
        missing = [p for p in needs if p not in params]
        if missing:
            problems.append(f"GRPOTrainer.{name} takes no {', '.join(missing)}")
    if problems:
        raise RuntimeError(
            f"TRL {found} changed the methods rlk's GRPOTrainer overrides (tested: "
            f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}): " + "; ".join(problems)
        )


def unsupported_options(args: GRPOConfig, trainer_args: dict[str, Any]) -> list[str]:
    """The options of ``args`` and of the trainer's arguments that :class:`RLKGRPOTrainer`
    cannot honour, one sentence each (empty: all supported). ``trainer_args`` are
    ``GRPOTrainer.__init__``'s arguments by name."""
    bad = []
    if args.use_vllm:
        bad += _unsupported_vllm_options(args)
    if args.use_transformers_continuous_batching:
        bad.append(
            "use_transformers_continuous_batching (or use_transformers_paged): rlk's paged "
            "rollout is the continuous batching"
        )
    if args.min_p not in (None, 0.0):
        bad.append(f"min_p={args.min_p}: rlk.sample has temperature, top_k and top_p only")
    if args.repetition_penalty != 1.0:
        bad.append(f"repetition_penalty={args.repetition_penalty}: rlk.sample has none")
    if args.generation_kwargs:
        bad.append("generation_kwargs: they configure transformers' generate, which rlk replaces")
    if args.cache_implementation is not None:
        bad.append("cache_implementation: rlk's rollout has its own paged KV cache")
    if args.cast_lm_head_to_fp32:
        bad.append(
            "cast_lm_head_to_fp32=True: rlk computes the LM head in the weights' dtype on both "
            "sides (load the model in float32 for fp32 logits)"
        )
    if args.use_liger_kernel:
        bad.append("use_liger_kernel=True: rlk replaces the same layers (patch_model)")
    if args.torch_compile:
        bad.append("torch_compile=True: the rlk-patched model runs eagerly")
    if not args.temperature > 0:
        bad.append(f"temperature={args.temperature}: GRPO samples, temperature must be > 0")
    if args.max_completion_length is None:
        bad.append("max_completion_length=None: the rollout needs a token budget")
    if args.world_size > 1 or args.deepspeed or args.fsdp:
        bad.append(
            "more than one process (DDP, FSDP, DeepSpeed): the rlk trainer runs in one process"
        )
    for name in ("tools", "environment_factory", "rollout_func", "peft_config"):
        if trainer_args.get(name):
            bad.append(f"{name}: not supported by rlk's GRPO trainer")
    if trainer_args.get("quantization_config") is not None:
        bad.append("quantization_config: rlk's ops run unquantized weights")
    return bad


def _unsupported_vllm_options(args: GRPOConfig) -> list[str]:
    """The ``use_vllm`` options rlk's model in vLLM cannot honour (:func:`unsupported_options`)."""
    bad = []
    if args.vllm_mode != "colocate":
        bad.append(
            f"vllm_mode={args.vllm_mode!r}: rlk builds the colocated engine "
            "(vllm_mode='colocate'); TRL's server (trl vllm-serve) starts vLLM's own model classes"
        )
    if args.vllm_enable_sleep_mode:
        bad.append(
            "vllm_enable_sleep_mode=True: sleep level 2 discards the engine's buffers (rlk's "
            "rotary table), which TRL's weight sync does not push back"
        )
    if args.vllm_model_impl not in ("auto", "vllm"):
        bad.append(
            f"vllm_model_impl={args.vllm_model_impl!r}: rlk's model is a vLLM model class "
            "('auto' or 'vllm')"
        )
    if args.vllm_structured_outputs_regex is not None:
        bad.append(
            "vllm_structured_outputs_regex: the grammar masks the logits in place, so vLLM's "
            "log-probabilities would no longer be the ones the trainer recomputes"
        )
    if args.vllm_tensor_parallel_size != 1:
        bad.append(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: the rlk trainer runs "
            "in one process"
        )
    return bad


def _unsupported_model(model: Any, processing_class: Any) -> list[str]:
    """The model or processing-class properties the rlk trainer refuses (see
    :func:`unsupported_options`)."""
    from transformers import ProcessorMixin

    bad = []
    if isinstance(processing_class, ProcessorMixin):
        bad.append("a processor as processing_class (multimodal input): rlk runs text models")
    if isinstance(model, torch.nn.Module):
        if hasattr(model, "peft_config"):
            bad.append("a PEFT model: patch_model runs the base layers only")
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            bad.append("a quantized model: rlk's ops run unquantized weights")
    return bad


#: The characters of :func:`char_tokenizer`, ids 3.. in this order (0 pad, 1 eos, 2 unk).
CHARS = "".join(chr(c) for c in range(32, 127))


def char_tokenizer(vocab_size: int) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built locally (nothing downloaded), for
    examples and tests with the random-weight models of :mod:`rlk_integrations.tools.zoo`.

    Ids: 0 ``<pad>``, 1 ``<eos>``, 2 ``<unk>``, then the printable ASCII characters
    (:data:`CHARS`), then placeholders ``<x{id}>`` up to ``vocab_size`` so that every id the
    model can sample decodes. Left padding, as TRL requires. Example::

        tok = char_tokenizer(512)
        tok("1+2=")["input_ids"]  # [20, 14, 21, 32]
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    if vocab_size < len(specials) + len(CHARS):
        raise ValueError(f"vocab_size must be >= {len(specials) + len(CHARS)}, got {vocab_size}")
    names = specials + list(CHARS)
    names += [f"<x{i}>" for i in range(len(names), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def _first_eos(tokens: list[int], eos: Sequence[int]) -> int:
    """The length of ``tokens`` up to and including the first of ``eos`` (all if none)."""
    stops = set(eos)
    return next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))


@contextlib.contextmanager
def _llm_built_by(build: Callable[[Callable[..., Any], dict[str, Any]], Any]):
    """While in the block, the ``vllm.LLM`` that TRL's colocated generation
    (``trl.generation.vllm_generation``) builds is ``build(vllm.LLM, its_kwargs)``: TRL 1.16 has
    no argument for more engine arguments."""
    from trl.generation import vllm_generation

    stock = vllm_generation.LLM
    built = []

    def llm(**kwargs: Any) -> Any:
        built.append(True)
        return build(stock, kwargs)

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = stock
    if not built:  # else TRL would sample on vLLM's own model classes
        raise RuntimeError(
            "TRL built no vllm.LLM through trl.generation.vllm_generation.LLM, so rlk could not "
            f"put it on rlk's model classes (TRL {trl.__version__}; tested: TRL 1.16)"
        )


def _vllm_model(llm: Any) -> Any:
    """The model of a colocated ``vllm.LLM`` (one process, ``external_launcher``), where TRL's
    weight sync calls ``load_weights`` one parameter at a time."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


class _LogprobCheck:
    """The comparison of TRL's log-probabilities with the sampling ones, where the weights are
    those that sampled; mixed into :class:`RLKGRPOTrainer` and :class:`StockGRPOTrainer`.

    ``_rlk_sampled_at[mode]`` is the ``global_step`` of the last generation of that mode: the
    weights change only when ``global_step`` does, so a batch's current log-probabilities are
    compared while it is unchanged (the first iteration over the batch)."""

    #: Raise on a difference (the rlk trainer), or only log it (the stock baseline).
    _raise_on_mismatch = False

    def _init_check(self) -> None:
        self._rlk_sampled_at: dict[str, int] = {}
        self._rlk_current: torch.Tensor | None = None

    def _compare(
        self, what: str, logps: torch.Tensor, inputs: dict[str, Any], log: bool = True
    ) -> None:
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is None:
            raise RuntimeError(
                "TRL did not pass the rollout's log-probabilities on (no "
                "sampling_per_token_logps): the generation override was not called"
            )
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"].bool()
        diff = (logps.detach() - sampling)[mask]
        ratio = torch.exp(diff)
        zero = torch.zeros((), device=sampling.device)
        d = diff.abs()
        stats = {
            "sampling/sampling_logp_difference/mean": d.mean() if d.numel() else zero,
            "sampling/sampling_logp_difference/max": d.max() if d.numel() else zero,
            "sampling/importance_sampling_ratio/min": ratio.min() if d.numel() else zero + 1,
            "sampling/importance_sampling_ratio/mean": ratio.mean() if d.numel() else zero + 1,
            "sampling/importance_sampling_ratio/max": ratio.max() if d.numel() else zero + 1,
        }
        for key, value in stats.items():
            if log:
                self._metrics[mode][key].append(float(value))
        worst = float(stats["sampling/sampling_logp_difference/max"])
        if self._raise_on_mismatch and worst != 0.0:
            raise RuntimeError(
                f"{what} differ from the sampling log-probabilities by up to {worst:.3e} under "
                "the weights that sampled: rlk's contract is equality. Was the model changed "
                "between the rollout and the recompute (dtype, patched modules, autocast)? "
                "check_logprobs=False logs the difference instead of raising"
            )

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        out = super()._generate_and_score_completions(inputs)
        self._rlk_sampled_at[mode] = self.state.global_step
        if out.get("old_per_token_logps") is not None:
            # With vLLM's importance-sampling correction TRL logs this comparison itself.
            logged = self.use_vllm and self.vllm_importance_sampling_correction
            self._compare("TRL's old_per_token_logps", out["old_per_token_logps"], out, not logged)
        return out

    def _compute_loss(self, model, inputs):
        self._rlk_current = None
        loss = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        if self._rlk_current is not None and self._rlk_sampled_at.get(mode) == (
            self.state.global_step
        ):
            self._compare("TRL's per_token_logps", self._rlk_current, inputs)
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, *args, **kwargs
        )
        self._rlk_current = logps.detach()  # read by _compute_loss (its one call is the policy)
        return logps, entropies, aux


class RLKGRPOTrainer(_LogprobCheck, GRPOTrainer):
    """``trl.GRPOTrainer`` with rlk's rollout and rlk's log-probabilities (see the module).

    Takes ``GRPOTrainer``'s arguments, plus:

    - ``rollout_kwargs``: more arguments of :func:`rlk_integrations.engine.paged.generate_paged`
      (``page_size``, ``max_batch``, ``num_pages``, ``kv_memory_fraction``,
      ``max_step_tokens``, ``prefill_chunk``, ``cuda_graphs``, ``progress``); the seeds,
      sampling settings, EOS and length come from the config.
    - ``keep_rollout_engine`` (default True): keep one
      :class:`~rlk_integrations.engine.paged.PagedEngine` from one generation round to the next, so
      that its KV cache is allocated and its decode graphs are captured once, not every round.
      Its cache then stays allocated through the training steps, as a colocated serving
      engine's does (``num_pages`` or ``kv_memory_fraction`` in ``rollout_kwargs`` bound it).
      The engine's ``max_len`` is ``max_completion_length`` plus room for the prompts: a power
      of two, at least 64, doubled (and the engine built again) when a longer prompt comes.
      False: a fresh engine per round, freed after it. The completions are the same bits
      either way.
    - ``check_logprobs`` (default True): raise ``RuntimeError`` when a log-probability computed
      under the weights that sampled differs from the sampling one (False: log it only).
    - ``graph_logprobs`` (default False): compute the log-probabilities through
      :class:`~rlk_integrations.engine.training.GraphedLogprobs`, one per model (policy, reference)
      and entropy setting, kept across steps: on a GPU each micro-batch's forward and backward
      replay as CUDA graphs, for small models whose eager pass is bound by the host. Its bucket
      is sized in powers of two to the micro-batches seen, and built again, larger, when one
      does not fit. The bits are those of the eager recompute. A call that needs gradients
      for more than one micro-batch at once (``batch_size`` below the rows) runs eagerly: a
      graphed call's backward must come before the next call.

    With ``use_vllm=True`` (colocate) TRL's engine samples on rlk's model in vLLM and TRL syncs
    the weights into it (see the module); ``rollout_kwargs`` and ``keep_rollout_engine`` then
    do not apply (``rollout_kwargs`` is refused).

    The model (an instance, or a name TRL loads) must be a Llama, Qwen2 or Qwen3 causal LM; it
    is patched in place. An option the trainer cannot honour is a ``ValueError`` naming it,
    before anything is loaded (:func:`unsupported_options`).

    Shapes (TRL's): completions are lists of token ids; the log-probabilities TRL receives are
    float32 ``[B, C]`` (``C`` = the longest completion, zeros past each one's end).

    Example::

        trainer = RLKGRPOTrainer(model, reward_funcs=reward, args=GRPOConfig(
            output_dir="out", num_generations=4, max_completion_length=64, num_iterations=2,
            bf16=True), train_dataset=ds, processing_class=tokenizer)
        trainer.train()
    """

    _raise_on_mismatch = True

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        *more: Any,
        rollout_kwargs: dict[str, Any] | None = None,
        check_logprobs: bool = True,
        keep_rollout_engine: bool = True,
        graph_logprobs: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_trl_version()
        for name, flag in (
            ("check_logprobs", check_logprobs),
            ("keep_rollout_engine", keep_rollout_engine),
            ("graph_logprobs", graph_logprobs),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        rollout_kwargs = dict(rollout_kwargs or {})
        own = sorted(set(rollout_kwargs) & set(_ROLLOUT_OWN))
        if own:
            raise ValueError(
                f"rollout_kwargs may not set {', '.join(own)}: the trainer derives them from "
                "GRPOConfig (temperature, top_k, top_p, max_completion_length, args.seed)"
            )
        unknown = sorted(set(rollout_kwargs) - set(inspect.signature(generate_paged).parameters))
        if unknown:
            raise ValueError(f"rollout_kwargs has no generate_paged argument {', '.join(unknown)}")
        if args is None:  # TRL's default config, built here to be checked first
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        bound = inspect.signature(GRPOTrainer.__init__).bind(
            self, model, reward_funcs, args, *more, **kwargs
        )
        bad = unsupported_options(args, bound.arguments)
        bad += _unsupported_model(model, bound.arguments.get("processing_class"))
        if args.use_vllm and rollout_kwargs:
            bad.append("rollout_kwargs with use_vllm=True: vLLM generates, not rlk's paged rollout")
        if bad:
            raise ValueError("RLKGRPOTrainer cannot run with: " + "; ".join(bad))

        if args.use_vllm:
            import rlk_integrations.adapters.vllm as rv

            rv.check_vllm()  # before TRL loads anything: the release rlk's vLLM models need
            with _llm_built_by(self._build_vllm):
                super().__init__(model, reward_funcs, args, *more, **kwargs)
        else:
            super().__init__(model, reward_funcs, args, *more, **kwargs)
        self._raise_on_mismatch = check_logprobs
        # TRL draws its own progress bar: no second one for each generation unless asked.
        self._rlk_rollout_kwargs = {"progress": False, **rollout_kwargs}
        self._rlk_round = 0
        self._rlk_keep_engine = keep_rollout_engine
        self._rlk_engine: PagedEngine | None = None
        self._rlk_graph_logprobs = graph_logprobs
        self._rlk_graphs: dict[tuple[int, bool], GraphedLogprobs] = {}
        self._init_check()

        bad = _unsupported_model(self.model, self.processing_class)
        if self._is_vlm:
            bad.append("a vision-language model: rlk runs text models")
        if self.aux_loss_enabled:
            bad.append("router_aux_loss_coef (an MoE auxiliary loss)")
        dtype = self.model.get_output_embeddings().weight.dtype
        for flag, want in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if getattr(self.args, flag) and dtype != want:
                bad.append(
                    f"{flag}=True over {dtype} weights: rlk runs the model in its weights' dtype "
                    f"(no autocast); load it in {want} or set {flag}=False"
                )
        if bad:
            raise ValueError("RLKGRPOTrainer cannot run with: " + "; ".join(bad))
        patch_model(self.model)
        if self.ref_model is not None:
            patch_model(self.accelerator.unwrap_model(self.ref_model))
        #: The rollout's logits dtype (the lm_head's), also the recompute's ``logits_dtype``.
        self.logits_dtype = dtype

    # -- generation ------------------------------------------------------------------------

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """rlk's paged rollout of ``prompt_ids`` (one completion per entry: TRL has already
        repeated each prompt ``num_generations`` times). Returns the completion ids (each ends
        at its first EOS id, included) and their float32 sampling log-probabilities."""
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("RLKGRPOTrainer cannot run with: multimodal input (images)")
        if self.use_vllm:  # TRL's weight sync and generate, on rlk's model in vLLM
            return super()._generate_single_turn(prompt_ids, None, {}, num_generations)
        seeds = rollout_seeds(
            self.args.seed, self._rlk_round, self.accelerator.process_index, len(prompt_ids)
        )
        self._rlk_round += 1
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
        ):
            prompts = [list(p) for p in prompt_ids]
            # The rollout stops at the first EOS id; any other ends the completion below (the
            # tokens before it are the same: a request's tokens never depend on when it stops).
            eos = self.eos_token_ids[0] if self.eos_token_ids else None
            kw = dict(self._rlk_rollout_kwargs)
            progress = kw.pop("progress")
            sampling = dict(temperature=self.temperature, top_k=self.top_k or 0, top_p=self.top_p)
            if self._rlk_keep_engine:
                engine = self._rollout_engine(model, prompts, sampling, kw)
                ro = engine.generate(
                    prompts, self.max_completion_length, seeds=seeds, eos_token_id=eos,
                    progress=progress,
                )  # fmt: skip
            else:
                ro = generate_paged(
                    model, prompts, self.max_completion_length, seeds=seeds, eos_token_id=eos,
                    progress=progress, **sampling, **kw,
                )  # fmt: skip
        if ro.logits_dtype != self.logits_dtype:
            raise RuntimeError(
                f"the rollout's logits are {ro.logits_dtype}, the lm_head's weights "
                f"{self.logits_dtype}: the model changed after RLKGRPOTrainer was built"
            )
        completion_ids, logprobs = [], []
        for s in ro.samples:
            n = _first_eos(s.response, self.eos_token_ids)
            completion_ids.append(s.response[:n])
            logprobs.append(s.logprobs[:n].tolist())  # float32 -> float -> float32: exact
        return completion_ids, logprobs

    def _build_vllm(self, make_llm: Callable[..., Any], trl_kwargs: dict[str, Any]) -> Any:
        """The ``vllm.LLM`` TRL builds for ``use_vllm`` (``make_llm(**kwargs)``), on rlk's model
        classes: TRL's keyword arguments (``trl_kwargs``) plus
        :func:`rlk_integrations.adapters.vllm.engine_args` (``hf_overrides``, eager on CPU, the
        worker extension) and ``dtype``, the trainer's weights' (the engine computes in the dtype
        the recompute does). An argument rlk's vLLM models refuse raises
        ``NotImplementedError`` naming it; an engine whose model is not rlk's, ``RuntimeError``."""
        import rlk_integrations.adapters.vllm as rv

        dtype = self.model.get_output_embeddings().weight.dtype
        llm = make_llm(**rv.engine_args(**trl_kwargs, dtype=str(dtype).removeprefix("torch.")))
        model = _vllm_model(llm)
        if not hasattr(model, "stale_parameters"):
            raise RuntimeError(
                f"the vLLM engine TRL built runs {type(model).__name__}, not one of rlk's vLLM "
                "models: rlk's vLLM plugin (rlk_integrations.adapters.vllm.register) did not run"
            )
        return llm

    def _rollout_engine(self, model, prompts, sampling, kw) -> PagedEngine:
        """The kept engine, built (again) when there is none, when ``model`` is another object,
        or when the longest prompt of ``prompts`` does not fit its ``max_len``."""
        longest = max((len(p) for p in prompts), default=1)
        engine = self._rlk_engine
        if (
            engine is None
            or engine.model is not model
            or longest + self.max_completion_length > engine.max_len
        ):
            self._rlk_engine = engine = None  # the old cache is freed before the new one
            room = 1 << max(6, (longest - 1).bit_length())
            engine = PagedEngine(model, max_len=room + self.max_completion_length, **sampling, **kw)
            self._rlk_engine = engine
        return engine

    # -- log-probabilities -----------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's per-token log-probabilities (and entropies) of the completion tokens with
        :func:`rlk.linear_logprobs`.

        ``input_ids``/``attention_mask`` ``[B, P + C]``: left-padded prompts, right-padded
        completions (``logits_to_keep = C``). Each group of ``batch_size`` rows (default all)
        is one packed forward of its real tokens. Returns float32 ``[B, C]`` log-probabilities
        (zeros past a completion's end), the entropies likewise or None, and None (no MoE).
        """
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"RLKGRPOTrainer cannot run with: multimodal inputs ({given})")
        if compute_aux_loss:
            raise ValueError("RLKGRPOTrainer cannot run with: an MoE auxiliary loss")
        model = self.accelerator.unwrap_model(model)
        if not is_patched(model):
            raise RuntimeError("the model is not patched by rlk (patch_model)")
        b, width = input_ids.shape
        p = width - logits_to_keep
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        samples = []
        for r in range(b):
            n = int(mask[r, p:].sum())
            if not bool(mask[r, p : p + n].all()):
                raise ValueError("completion_mask must be a prefix of ones in each row")
            prompt = ids[r, :p][mask[r, :p]].tolist()
            samples.append(Sample(prompt, ids[r, p : p + n].tolist(), torch.empty(0)))
        lps, ents = [], []
        step = batch_size or b
        groups = [samples[start : start + step] for start in range(0, b, step)]
        recompute = self._rlk_recompute(model, groups, compute_entropy)
        # The rollout ran without autocast: so does the recompute (the weights' own dtype).
        with torch.autocast(input_ids.device.type, enabled=False):
            for group in groups:
                # A group without completion tokens (mask_truncated_completions) still runs:
                # its empty result keeps the loss in the graph, zero gradients as in TRL.
                out = recompute(group)
                lp, ent = out if compute_entropy else (out, None)
                lps += lp
                ents += ent if ent is not None else []
        logps = pad_rows(lps, logits_to_keep)[0]
        entropies = pad_rows(ents, logits_to_keep)[0] if compute_entropy else None
        self._rlk_current = logps.detach()
        return logps, entropies, None

    def _rlk_recompute(self, model, groups: list[list[Sample]], entropy: bool) -> Callable:
        """What computes one group's log-probabilities: :func:`packed_logprobs`, or with
        ``graph_logprobs`` this model's :class:`GraphedLogprobs`, its bucket grown to hold
        every group (each size a power of two, never below the old one)."""
        kw = dict(
            temperature=self.temperature, logits_dtype=self.logits_dtype, return_entropy=entropy
        )
        if not self._rlk_graph_logprobs or (torch.is_grad_enabled() and len(groups) > 1):
            return lambda group: packed_logprobs(model, group, **kw)
        key = (id(model), entropy)
        old = self._rlk_graphs.get(key)
        need = bucket_of(groups)
        have = {} if old is None or old.model is not model else old.bucket
        if have and all(need[k] <= have[k] for k in need):
            return old
        self._rlk_graphs.pop(key, None)  # the old graphs' memory goes before the new capture
        grow = {k: max(1 << (n - 1).bit_length(), have.get(k, 0)) for k, n in need.items()}
        grow["max_seq_len"] = min(grow["max_seq_len"], grow["max_tokens"])
        graphed = GraphedLogprobs(
            model, **grow, capture=next(model.parameters()).device.type == "cuda", **kw
        )
        self._rlk_graphs[key] = graphed
        return graphed


class StockGRPOTrainer(_LogprobCheck, GRPOTrainer):
    """``trl.GRPOTrainer`` unchanged, plus the sampling log-probabilities of its own rollout.

    Generation is TRL's (transformers' ``generate``); each sampled token's log-probability is
    ``log_softmax(logits / temperature)`` in float32 of the raw logits ``generate`` returns
    (``output_logits=True``), which TRL then carries as ``sampling_per_token_logps`` (it changes
    TRL's training only through ``off_policy_mask_threshold``, which reads them). The
    comparison with TRL's log-probabilities is logged under the same names as
    :class:`RLKGRPOTrainer`'s, never raised: the baseline of ``examples/trl_grpo.py`` and the
    tests.

    Example::

        StockGRPOTrainer(model, reward_funcs=reward, args=config, train_dataset=ds).train()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_trl_version()
        super().__init__(*args, **kwargs)
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError(
                "StockGRPOTrainer records transformers' generate: use_vllm and "
                "use_transformers_continuous_batching must be False"
            )
        self._init_check()

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        model = self.accelerator.unwrap_model(self.model_wrapped)
        steps: list[torch.Tensor] = []
        generate: Callable[..., Any] = model.generate

        def recording_generate(*args: Any, generation_config: Any, **kwargs: Any) -> torch.Tensor:
            config = copy.deepcopy(generation_config)
            config.output_logits = config.return_dict_in_generate = True
            out = generate(*args, generation_config=config, **kwargs)
            steps.extend(out.logits)  # one [B, V] tensor per new token
            return out.sequences

        model.generate = recording_generate
        try:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            del model.generate
        if not steps:
            return completion_ids, [[] for _ in completion_ids]
        # Gathered on the device, one copy to the host: [B, steps] of the sampled tokens.
        width = len(steps)
        ids = torch.tensor(
            [c[:width] + [0] * (width - len(c[:width])) for c in completion_ids],
            device=steps[0].device,
        )
        picked = torch.stack(
            [
                torch.log_softmax(logits.float() / self.temperature, dim=-1)
                .gather(1, ids[:, t : t + 1])
                .squeeze(1)
                for t, logits in enumerate(steps)
            ],
            dim=1,
        ).cpu()
        return completion_ids, [picked[i, : len(c)].tolist() for i, c in enumerate(completion_ids)]
