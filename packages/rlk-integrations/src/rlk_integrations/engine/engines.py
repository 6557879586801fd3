"""Rollout engines: one protocol, one registry.

A rollout engine samples responses to prompts and returns, per sequence, the sampled token ids
and the float32 log-probability the rollout gave each of them (a :class:`RolloutResult` of
:class:`Sample` s); the training recompute (:mod:`rlk_integrations.engine.training`) must give
the same bits. ``rlk consistency`` and ``rlk bench``'s e2e family run every engine of the
registry through :class:`RolloutEngine` alone, without knowing which engine it is.

The registry is :data:`rlk_integrations.engine.registry.ROLLOUT_ENGINES` (name ->
``"module:Class"``): torch-free, so that ``rlk consistency --help`` lists the names without
importing torch, and :func:`create` imports an engine's module only when the engine is asked
for. The engines of this package:

- ``padded``: :class:`rlk_integrations.engine.rollout.PaddedRollout` (a left-padded batch through
  the model with a ``DynamicCache``);
- ``paged``: :class:`rlk_integrations.engine.paged.PagedRollout` (continuous batching on a paged KV
  cache; it keeps its :class:`~rlk_integrations.engine.paged.PagedEngine` across calls).

An engine that cannot run on this machine (its library is not installed, it needs a GPU) says
why in :meth:`RolloutEngine.unavailable`: :func:`available` sets it aside with that reason,
which the report prints, and asking for it by name is an error carrying the reason.

Example::

    engine = create("paged", RolloutOptions(page_size=16))
    if (why := engine.unavailable(torch.device("cpu"))) is None:
        ro = engine.generate(model, prompts, 64, seeds=[11, 12])
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlk_integrations.engine.registry import ROLLOUT_ENGINES


@dataclass
class Sample:
    """One request: its prompt, the sampled response, the rollout's log-probabilities and (with
    a value head, :mod:`rlk_integrations.engine.critic`) the critic's values of its tokens'
    states."""

    prompt: list[int]
    response: list[int]
    logprobs: torch.Tensor  # float32 [len(response)]
    seed: int = 0
    values: torch.Tensor | None = None  # float32 [len(response)]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


@dataclass
class RolloutResult:
    """What :meth:`RolloutEngine.generate` returns: the samples in prompt order, the wall time
    of the sampling, the number of sampled tokens, the dtype the logits had (which the recompute
    uses) and engine-specific extras."""

    samples: list[Sample]
    seconds: float = 0.0
    new_tokens: int = 0
    logits_dtype: torch.dtype = torch.float32
    extra: dict = field(default_factory=dict)


def logprob_temperature(temperature: float) -> float:
    """The temperature a sampled token's log-probability is taken at: ``temperature``, except
    for a greedy sample (``temperature == 0``, the argmax), whose log-probability is that of
    the unscaled softmax (temperature 1). Every rollout and every recompute asks this one rule,
    so that they agree on greedy samples.

    Example::

        rlk.logprobs(logits, tokens, temperature=logprob_temperature(0.0))   # temperature 1
    """
    return temperature if temperature > 0 else 1.0


@dataclass(frozen=True)
class RolloutOptions:
    """The rollout settings of the command line; each engine reads those that concern it.

    ``page_size``: tokens per KV page (``paged``). ``max_batch``: requests running at once
    (``paged``; None: every prompt of the call). ``leaves`` and ``tp``: the tensor-parallel
    layout of rlk's ops the run asks for (``--leaves``, ``--rollout-tp``); an engine that cannot
    sample with it says so in :meth:`RolloutEngine.unavailable`. ``fuse_projections``: q/k/v
    and gate/up as one GEMM each (``paged``;
    :class:`~rlk_integrations.engine.paged.PagedEngine`)."""

    page_size: int = 16
    max_batch: int | None = None
    leaves: int | None = None
    tp: int = 1
    fuse_projections: bool = True


class RolloutEngine(Protocol):
    """What ``rlk consistency`` and the e2e bench need of a rollout engine.

    An engine is built by its class from :class:`RolloutOptions` alone (cheap: no model, no
    device memory); what it builds for a model (a KV cache, CUDA graphs, another process that
    loads the weights from a checkpoint) it builds in :meth:`generate` and may keep for the next
    call with the same model. The tensor-parallel rollout
    (:class:`rlk_integrations.engine.tp_workers.TPRollout`) builds the engine again in each spawned
    process from its name and options, and hands it that rank's shard of the model.
    """

    #: The registry name; a row's ``rollout`` column.
    name: str

    def unavailable(self, device: torch.device) -> str | None:
        """None when the engine can run on ``device`` on this machine; else why not, one line
        (e.g. ``"vllm is not installed"``)."""
        ...

    def generate(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        new_tokens: int,
        seeds: list[int],
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> RolloutResult:
        """Sample up to ``new_tokens`` tokens after each prompt (token id lists) with
        ``model``'s current weights: ``model`` is the transformers causal LM that the training
        recompute runs (patched by :func:`rlk_integrations.models.transformers.patch_model` on the
        rlk side); an engine in another process or library takes its weights from it. ``seeds[i]``
        keys request ``i``'s sampling; the token at position ``p`` uses RNG offset ``p``
        (:func:`rlk.sample`), so that a request's tokens do not depend on the batch. A response
        stops after ``eos_token_id``. ``progress`` gets a line now and then (None: silent).

        Returns the samples in prompt order: prompt, response token ids, float32
        log-probabilities ``[len(response)]`` under ``softmax(logits / temperature)`` on the
        CPU or ``model``'s device, and the seed; ``seconds`` (wall time of the sampling),
        ``new_tokens`` and ``logits_dtype`` (the dtype the logits had, which the recompute
        uses)."""
        ...

    def stock_twin(
        self, model: torch.nn.Module, device: torch.device
    ) -> RolloutEngine | str | None:
        """The stock side's counterpart of this engine for ``model`` on ``device`` (the same
        engine with its library's own model and kernels, not rlk's), which ``rlk consistency``
        runs beside the stock padded rollout (the baseline of every engine); a string: why it
        cannot run here (reported as ``<name>-stock``); None: the engine has none."""
        ...


def names() -> tuple[str, ...]:
    """The registered engines' names, in registry order."""
    return tuple(ROLLOUT_ENGINES)


def create(name: str, options: RolloutOptions | None = None) -> RolloutEngine:
    """The engine registered as ``name``, built from ``options`` (default settings when None).
    Imports its module; an unknown name is a ``ValueError`` listing the registered ones."""
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; registered: {', '.join(names())}")
    if options is not None and not isinstance(options, RolloutOptions):
        raise TypeError(f"options must be a RolloutOptions, got {type(options).__name__}")
    module, _, attr = ROLLOUT_ENGINES[name][0].partition(":")
    engine = getattr(importlib.import_module(module), attr)(options or RolloutOptions())
    if getattr(engine, "name", None) != name:
        raise TypeError(f"{ROLLOUT_ENGINES[name][0]} is registered as {name!r} but is named "
                        f"{getattr(engine, 'name', None)!r}")  # fmt: skip
    return engine


def available(
    wanted: tuple[str, ...] | None, device: torch.device, options: RolloutOptions | None = None
) -> tuple[list[RolloutEngine], dict[str, str]]:
    """The engines of ``wanted`` (None: every registered one) that can run on ``device``, and
    ``{name: why not}`` for the others."""
    engines, skipped = [], {}
    for name in names() if wanted is None else wanted:
        engine = create(name, options)
        why = engine.unavailable(device)
        if why is None:
            engines.append(engine)
        else:
            skipped[name] = why
    return engines, skipped


__all__ = [
    "RolloutEngine",
    "RolloutOptions",
    "RolloutResult",
    "Sample",
    "available",
    "create",
    "logprob_temperature",
    "names",
]
