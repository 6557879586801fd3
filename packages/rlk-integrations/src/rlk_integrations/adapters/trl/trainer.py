"""rlk's GRPO trainer for TRL: :class:`RLKGRPOTrainer`, ``trl.GRPOTrainer`` with rlk's paged
rollout (or TRL's colocated vLLM on rlk's model classes) and rlk's log-probabilities (see
:mod:`rlk_integrations.adapters.trl`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from rlk_integrations.adapters.trl.check import _LogprobCheck
from rlk_integrations.adapters.trl.generation import (
    _first_eos,
    _llm_built_by,
    _vllm_model,
    rollout_seeds,
)
from rlk_integrations.adapters.trl.options import (
    _ROLLOUT_OWN,
    _unsupported_model,
    unsupported_options,
)
from rlk_integrations.adapters.trl.release import _check_trl_version
from rlk_integrations.engine.engines import Sample
from rlk_integrations.engine.paged import PagedEngine, generate_paged
from rlk_integrations.engine.training import GraphedLogprobs, bucket_of, packed_logprobs, pad_rows
from rlk_integrations.models.transformers import is_patched, patch_model


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
