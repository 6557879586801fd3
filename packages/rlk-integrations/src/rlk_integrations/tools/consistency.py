"""``rlk consistency``: rollout vs training log-probability mismatch, stock transformers vs rlk.

For each side the same model (same weights) samples responses to a batch of random prompts
(left-padded batch, KV cache, one decode step per token) and records the log-probability of each
sampled token; then a training pass recomputes those log-probabilities on packed micro-batches of
another composition (another order and size) with gradients on, and runs backward.

- stock: transformers as shipped (SDPA attention, torch ops), ``torch.multinomial`` sampling,
  ``log_softmax`` of the logits on both sides;
- rlk: the model patched by :func:`rlk_integrations.models.transformers.patch_model`, ``rlk.sample``
  and ``rlk.logprobs`` in the rollout, ``rlk.linear_logprobs`` in training.

Rollout modes (``rollout_modes``/``--rollout-mode``) are the rollout engines of
:mod:`rlk_integrations.engine.engines`, run through its protocol alone: ``padded`` is the
left-padded batch above; ``paged`` is :class:`rlk_integrations.engine.paged.PagedRollout` (paged KV
cache, continuous batching, ``rlk.paged_attention``). The rlk side gets one row per engine, each
with its own rollout and training recompute; by default every registered engine that can run here,
and the report names the others with the reason. The stock side runs the padded batch with
torch sampling (``PaddedRollout(sampler="torch")``), and beside it each rlk engine's stock
counterpart where it has one (``RolloutEngine.stock_twin``: for ``vllm``, vLLM's own model
classes and kernels).

Training engines (``train_engine``/``--train-engine``): ``transformers`` recomputes with the
same (patched) transformers model; ``megatron`` recomputes the rlk rows in Megatron-core's
``GPTModel`` built with rlk's layer spec (:mod:`rlk_integrations.adapters.megatron`, weights
converted by ``hf_to_megatron``; Megatron's process groups are set up in this process and torn down
after), while the rollout stays transformers + rlk. ``transformers-graphs`` recomputes the rlk rows
with the transformers model through :class:`rlk_integrations.engine.training.GraphedLogprobs`, its
bucket the largest micro-batch: on a GPU the pass and its backward replay as CUDA graphs, on CPU
the same padded bucket runs eagerly. The stock row always trains with stock transformers.

``leaves`` (``--leaves N``): the rlk side runs ``o_proj``/``down_proj`` (the row-parallel
linears) on :func:`rlk.parallel.tree_linear` with ``N`` K-leaves in the rollout and the
transformers recompute, and Megatron's row/column-parallel linears on :mod:`rlk.parallel`'s
tree-ordered linears with the same ``N``: the bits that tensor parallelism keeps.

The report has one row per side: tokens compared, max and mean ``|dlogp|``, the fraction of
tokens whose log-probability differs at all, the k3 KL estimate of KL(rollout || training), and
rollout and training (forward + backward) tokens per second.

``ep`` (``--ep N``, a mixture-of-experts model): the rlk row's padded rollout and training
recompute (transformers, or Megatron-core in its EP group) run in ``N`` spawned processes whose
model holds ``1/N`` of every MoE layer's experts (:func:`rlk_integrations.models.ep.shard_ep`);
each rank samples, then recomputes, its own share of the sequences (another share: the
recompute's order), the tokens reaching their experts by all-to-all
(:class:`~rlk_integrations.tools.recompute.ExpertParallel`).
``--ep 1`` runs that code path in one spawned process (one GPU); without ``--ep`` the rlk row
runs on the unsharded model in this process.

``steps`` (``--steps N``, with ``--rollout-engine vllm``): the RL loop instead of one rollout
(:func:`run_loop`): N GRPO steps per side, vLLM sampling and the weights of each update pushed
back into the running engine; a row per side and step.

A run's settings are one frozen :class:`ConsistencyConfig` (the engines' ``RolloutOptions``
inside), validated once where it is built and passed whole to :func:`run`.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import rlk
import rlk.parallel
from rlk_integrations.engine import engines, tp_workers, training
from rlk_integrations.engine.engines import RolloutEngine, RolloutOptions
from rlk_integrations.engine.rollout import PaddedRollout
from rlk_integrations.models import moe
from rlk_integrations.models.architectures import architecture
from rlk_integrations.models.transformers import patch_model, unpatch_model
from rlk_integrations.tools import zoo
from rlk_integrations.tools.consistency_report import (
    SideResult,
    compare,
    format_table,
    ok,
    write_json,
)
from rlk_integrations.tools.recompute import ExpertParallel, MegatronTP, recompute_here, sync
from rlk_integrations.tools.zoo import CONFIGS

#: The command's API: what :mod:`rlk_integrations_cli` and callers use, the report's parts
#: (:mod:`~rlk_integrations.tools.consistency_report`) and the recompute engines
#: (:mod:`~rlk_integrations.tools.recompute`) included.
__all__ = [
    "ConsistencyConfig", "ExpertParallel", "MegatronTP", "SIDES", "SideResult", "TRAIN_ENGINES",
    "UsageError", "compare", "format_table", "ok", "random_prompts", "run", "run_loop",
    "run_side", "sync", "train_groups", "write_json",
]  # fmt: skip

SIDES = ("stock", "rlk")
TRAIN_ENGINES = ("transformers", "megatron", "transformers-graphs")


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in lens]


def run_side(
    side: str,
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    engine: RolloutEngine,
    micro_batch: int,
    seed: int = 0,
    temperature: float = 1.0,
    train_model: torch.nn.Module | None = None,
    recompute: Callable[..., tuple[list[torch.Tensor], float]] | None = None,
    warm_passes: int = 0,
    train_graphs: bool = False,
    progress: Callable[[str], None] | None = None,
) -> SideResult:
    """Rollout with ``engine`` (a :class:`~rlk_integrations.engine.engines.RolloutEngine`; its name
    is the row's rollout mode), then training recompute (forward + backward) on one side; ``model``
    is patched or unpatched by the caller to match ``side``. ``train_model``: an rlk Megatron
    ``GPTModel`` with ``model``'s weights (rlk only) that does the training recompute instead
    of ``model``. ``recompute(samples, groups, temperature, logits_dtype) -> (log-probs per
    sample, seconds)``: a training recompute done elsewhere (TP ranks), rlk only.
    ``warm_passes``: untimed training passes before the timed one (on a GPU the training
    shapes' kernels compile in the first). ``train_graphs``: the transformers recompute through
    ``training.GraphedLogprobs`` (rlk only)."""
    use_rlk = side == "rlk"
    if (train_model is not None or recompute is not None) and not use_rlk:
        raise ValueError("the Megatron and tensor-parallel paths run on rlk only")
    if train_graphs and (not use_rlk or train_model is not None or recompute is not None):
        raise ValueError("train_graphs is rlk's transformers recompute in this process")
    trainer = model if train_model is None else train_model
    train_engine = "transformers" if train_model is None and recompute is None else "megatron"
    train_engine = "transformers-graphs" if train_graphs else train_engine
    train_engine = getattr(recompute, "engine", train_engine)  # a recompute elsewhere names its own
    say = progress or (lambda msg: None)
    device = next(model.parameters()).device
    seeds = [seed * 100003 + i for i in range(len(prompts))]
    say(f"[{side}] {engine.name} rollout: {len(prompts)} prompts x {new_tokens} new tokens")
    # An MoE model's expert choices are logged where both passes run in this process (a
    # padded rollout; the eager recompute, or Megatron's, whose own log reads its routers).
    here = engine.name == "padded" and recompute is None
    routes = moe.routing_logs(model, here and not train_graphs)
    if train_model is not None and isinstance(routes[0], moe.RoutingLog):
        from rlk_integrations.adapters import megatron  # optional: imported where it runs

        routes = (routes[0], megatron.RoutingLog(train_model))
    with routes[0]:
        ro = engine.generate(
            model, prompts, new_tokens, seeds, temperature=temperature, progress=progress
        )
    # Training sees the samples in another order and another batch composition.
    groups = train_groups(len(prompts), micro_batch, seed)
    say(
        f"[{side}] training ({train_engine}): {len(groups)} packed micro-batches of <= "
        f"{micro_batch} sequences"
    )
    if recompute is not None:
        train_lps, train_s = recompute(ro.samples, groups, temperature, ro.logits_dtype)
        train_tokens = sum(len(s.tokens) for s in ro.samples)
    else:
        graphed = None
        if train_graphs:
            graphed = _bucket(model, ro.samples, groups, temperature, ro.logits_dtype, device)
        with routes[1]:
            train_lps, train_tokens, train_s = recompute_here(
                model, trainer, train_model, ro, groups, temperature, use_rlk, device,
                warm_passes, graphed,
            )  # fmt: skip
    m = compare([s.logprobs for s in ro.samples], train_lps)  # type: ignore[arg-type]
    m["expert_differ"] = moe.expert_differ(*routes, groups)
    logged = getattr(recompute, "routing", None)
    if logged is not None:  # (rollout, recompute) routing logged by ranks elsewhere (EP)
        m["expert_differ"] = moe.routing_differ(*logged)[0]
    return SideResult(
        side=side,
        rollout_mode=engine.name,
        train_engine=train_engine,
        rollout_tok_s=ro.new_tokens / ro.seconds if ro.seconds > 0 else math.inf,
        train_tok_s=train_tokens / train_s if train_s > 0 else math.inf,
        **m,
    )


def _bucket(model, samples, groups, temperature, logits_dtype, device):
    """A :class:`~rlk_integrations.engine.training.GraphedLogprobs` whose bucket holds the largest
    of ``groups`` (captured on a GPU, eager on CPU)."""
    return training.GraphedLogprobs.for_batches(
        model,
        [[samples[i] for i in g] for g in groups],
        temperature=temperature,
        logits_dtype=logits_dtype,
        capture=device.type == "cuda",
    )


def train_groups(n: int, micro_batch: int, seed: int) -> list[list[int]]:
    """The training recompute's packed micro-batches of ``n`` samples: another order than the
    rollout's (seeded by ``seed``), ``micro_batch`` samples each."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    return training.micro_batches(n, micro_batch, order)


class UsageError(ValueError):
    """An argument of :func:`run` that cannot work, found before anything runs."""


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ConsistencyConfig:
    """One ``rlk consistency`` run, validated once where it is built and passed whole.

    ``model``: a built-in config of :mod:`rlk_integrations.tools.zoo` or a local checkpoint
    directory, loaded with ``dtype`` on ``device`` (None: cuda if present, else cpu) and
    ``seed``. ``prompts`` random prompts of ``prompt_len`` = (min, max) tokens; ``new_tokens``
    sampled after each at ``temperature`` (0: greedy); training micro-batches of
    ``micro_batch`` sequences. ``sides``: ``stock`` and/or ``rlk``; ``backend``: the rlk
    backend (None: the selected one). ``rollout_modes``: engines of
    :mod:`rlk_integrations.engine.registry`, each of which must be able to run here (None:
    every one that can); ``rollout``: their options, also the run's ``leaves`` (the rlk side's
    tree-ordered row-parallel linears, rollout and training) and the rollout's tensor-parallel
    size ``rollout.tp``. ``train_engine``: one of :data:`TRAIN_ENGINES`, at tensor-parallel
    size ``train_tp``. ``ep``: the rlk row's expert-parallel size (a mixture-of-experts model:
    :class:`ExpertParallel`, the padded rollout and the transformers or Megatron recompute, in
    ``ep`` spawned processes, 1 included; None: no expert parallelism).
    ``warmup``: untimed passes first (None: on a GPU). ``steps``: run that many GRPO steps
    of the vLLM loop instead (:func:`run_loop`; ``rollout_modes`` ``("vllm",)``, the
    transformers or Megatron trainer).

    A value that cannot work raises :class:`UsageError` naming it (or
    :class:`rlk.BackendError` for ``backend``) when the config is built, before a model is:
    a bad argument must not cost the stock half of the run. The rules that are rlk's (leaves a
    power of two, a tensor-parallel size a power of two dividing them) are asked of
    :func:`rlk.parallel.check_leaves`.

    Example::

        config = ConsistencyConfig.of("tiny", leaves=8, rollout_tp=2)   # the flat options
        report = run(config)
    """

    model: str = "tiny"
    backend: str | None = None
    prompts: int = 8
    new_tokens: int = 16
    prompt_len: tuple[int, int] = (4, 12)
    micro_batch: int = 3
    seed: int = 0
    temperature: float = 1.0
    device: str | None = None
    dtype: torch.dtype = torch.bfloat16
    warmup: bool | None = None
    sides: tuple[str, ...] = SIDES
    rollout_modes: tuple[str, ...] | None = None
    rollout: RolloutOptions = RolloutOptions()
    train_engine: str = "transformers"
    train_tp: int = 1
    ep: int | None = None
    steps: int | None = None

    @classmethod
    def of(
        cls,
        model: str = "tiny",
        *,
        page_size: int = 16,
        max_batch: int | None = None,
        leaves: int | None = None,
        rollout_tp: int = 1,
        **fields: Any,
    ) -> ConsistencyConfig:
        """The config of ``rlk consistency``'s options, the rollout's given flat as the command
        line takes them (``page_size``, ``max_batch``, ``leaves``, ``rollout_tp``); ``fields``:
        the other fields."""
        rollout = RolloutOptions(page_size=page_size, max_batch=max_batch, leaves=leaves,
                                 tp=rollout_tp)  # fmt: skip
        return cls(model, rollout=rollout, **fields)

    @property
    def leaves(self) -> int | None:
        return self.rollout.leaves

    @property
    def torch_device(self) -> torch.device:
        """``device`` as a torch device; None: cuda if present, else cpu."""
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def __post_init__(self) -> None:
        if self.model not in CONFIGS and not os.path.isdir(self.model):
            raise UsageError(
                f"unknown model {self.model!r}: a built-in config ({', '.join(CONFIGS)}) "
                "or a local checkpoint directory"
            )
        for name in ("prompts", "new_tokens", "micro_batch", "train_tp"):
            _positive(name, getattr(self, name))
        _positive("ep", self.ep, allow_none=True)
        _positive("page_size", self.rollout.page_size)
        _positive("max_batch", self.rollout.max_batch, allow_none=True)
        _positive("rollout_tp", self.rollout.tp)
        lo, hi = self.prompt_len
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise UsageError(f"prompt_len must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t)) or t < 0:
            raise UsageError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.rollout_modes is not None and (
            not self.rollout_modes or any(m not in engines.names() for m in self.rollout_modes)
        ):
            raise UsageError(
                f"rollout modes must be among {engines.names()}, got {self.rollout_modes!r}"
            )
        if self.train_engine not in TRAIN_ENGINES:
            raise UsageError(
                f"train_engine must be one of {TRAIN_ENGINES}, got {self.train_engine!r}"
            )
        if self.train_engine == "transformers-graphs" and self.train_tp > 1:
            raise UsageError("train_engine 'transformers-graphs' runs unsharded (train_tp = 1)")
        self._check_leaves()
        self._check_moe()
        self._check_loop()
        self._check_machine()

    def _check_loop(self) -> None:
        if self.steps is None:
            return
        _positive("steps", self.steps)
        if self.rollout_modes != ("vllm",):
            raise UsageError("steps runs the GRPO loop on vLLM: rollout mode 'vllm' alone")
        if self.train_engine not in ("transformers", "megatron"):
            raise UsageError(
                f"steps trains with transformers or megatron, not {self.train_engine!r}"
            )
        if self.train_tp > 1 and self.train_engine != "megatron":
            raise UsageError("steps with train_tp > 1 trains with megatron (train_engine)")
        if self.rollout.tp != 1:
            raise UsageError("steps samples with vLLM at rollout_tp = 1")
        if not self.temperature > 0:
            raise UsageError(f"steps samples at a temperature > 0, got {self.temperature}")

    def _model_config(self) -> Any:
        if self.model in CONFIGS:
            return zoo.make_config(self.model)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model, local_files_only=True)

    def _check_moe(self) -> None:
        """What a mixture of experts runs: no ``leaves`` (nor the tensor parallelism that needs
        them), and ``ep`` on MoE models alone, where the run can honour it."""
        if self.leaves is None and self.ep is None:
            return  # nothing to ask of the model's config
        cfg = self._model_config()
        try:
            arch = architecture(cfg)
        except NotImplementedError as e:
            raise UsageError(str(e)) from None
        name = f"{self.model} ({cfg.model_type})"
        if arch.moe and self.leaves is not None:
            raise UsageError(
                f"leaves (and train_tp/rollout_tp > 1, which need it) has no mixture-of-experts "
                f"layout: {name} is an MoE model; shard its experts with ep instead"
            )
        if self.ep is None:
            return
        if not arch.moe:
            raise UsageError(f"ep = {self.ep} shards experts: {name} is a dense model")
        experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        if experts % self.ep:
            raise UsageError(f"ep = {self.ep} must divide {name}'s {experts} experts")
        if self.prompts % self.ep:
            raise UsageError(
                f"ep = {self.ep} must divide prompts = {self.prompts} (every rank samples and "
                "recomputes the same number of sequences)"
            )
        if self.train_engine not in ("transformers", "megatron"):
            raise UsageError(
                f"ep recomputes with train_engine 'transformers' or 'megatron', not "
                f"{self.train_engine!r}"
            )
        if self.rollout_modes not in (None, ("padded",)):
            raise UsageError(
                f"ep samples with rollout mode 'padded' alone (every rank must run the same "
                f"number of forwards), not {self.rollout_modes!r}"
            )
        if self.steps is not None:
            raise UsageError("ep does not run the GRPO loop (steps)")

    def _check_leaves(self) -> None:
        leaves = self.leaves
        if leaves is not None:
            try:
                rlk.parallel.check_leaves(leaves)
            except (TypeError, ValueError) as e:
                raise UsageError(str(e)) from None
        for name, tp in (("train_tp", self.train_tp), ("rollout_tp", self.rollout.tp)):
            if tp == 1:
                continue
            if not leaves:
                raise UsageError(f"{name} > 1 needs leaves (tree-ordered row-parallel linears)")
            try:
                rlk.parallel.check_leaves(leaves, tp)
            except ValueError:
                raise UsageError(
                    f"{name} must be a power of two dividing leaves = {leaves}"
                ) from None

    def _check_machine(self) -> None:
        """What this machine must have: the device, the GPUs, each engine asked for by name,
        the backend."""
        try:
            dev = torch.device(self.device) if self.device is not None else None
        except (RuntimeError, TypeError) as e:
            raise UsageError(f"device {self.device!r} is not a torch device ({e})") from None
        if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"device {self.device!r}: this torch sees no CUDA/ROCm GPU")
        if dev is not None and dev.type not in ("cpu", "cuda"):
            raise UsageError(f"device {self.device!r}: rlk consistency runs on cpu or cuda")
        on_gpu = self.torch_device.type == "cuda"
        if self.rollout_modes is not None:  # asked for by name: each must run here
            _, skipped = engines.available(self.rollout_modes, self.torch_device, self.rollout)
            if skipped:
                raise UsageError("; ".join(f"rollout engine {n!r} cannot run here: {why}"
                                           for n, why in skipped.items()))  # fmt: skip
        tp = max(self.train_tp, self.rollout.tp)
        if on_gpu and tp > torch.cuda.device_count():
            raise UsageError(
                f"tensor-parallel size {tp} needs {tp} GPUs, this machine has "
                f"{torch.cuda.device_count()}"
            )
        if on_gpu and (self.ep or 1) > torch.cuda.device_count():
            raise UsageError(
                f"ep = {self.ep} needs {self.ep} GPUs, this machine has {torch.cuda.device_count()}"
            )
        if self.backend is not None:
            with rlk.use_backend(self.backend):
                rlk.current_backend(dev)


def run(
    model: str | ConsistencyConfig = "tiny",
    *,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run both sides on one model; returns the report (``rows`` holds a dict per side and
    rollout mode: the stock side once, padded; the rlk side once per engine of
    ``rollout_modes``; engines that cannot run here in ``rollout_skipped`` with the reason).
    ``model``: a :class:`ConsistencyConfig`, or the model's name and ``options`` the config's
    fields as :meth:`ConsistencyConfig.of` takes them (``page_size=``, ``leaves=``,
    ``rollout_tp=``, ``train_engine=``, ...), checked before anything runs. ``progress`` gets a
    line now and then (None: silent).

    Example::

        report = run("tiny", rollout_modes=("paged",), leaves=8, train_engine="megatron")
        assert ok(report)
    """
    if isinstance(model, ConsistencyConfig):
        if options:
            raise TypeError(
                f"run takes a ConsistencyConfig or options, not both: {sorted(options)}"
            )
        config = model
    else:
        config = ConsistencyConfig.of(model, **options)
    if config.steps is not None:
        return run_loop(config, progress)
    teardown = None
    if (
        config.train_engine == "megatron"
        and config.train_tp == 1
        and config.ep is None
        and "rlk" in config.sides
    ):
        # Megatron-core is optional (rlk-integrations[megatron]): imported where it runs.
        from rlk_integrations.adapters import megatron

        teardown = megatron.init_single_process()
    try:
        return _run(config, progress)
    finally:
        if teardown is not None:
            teardown()


def _run(config: ConsistencyConfig, progress: Callable[[str], None] | None) -> dict[str, Any]:
    c = config
    say = progress or (lambda msg: None)
    dev = c.torch_device
    warmup = dev.type == "cuda" if c.warmup is None else c.warmup
    say(f"loading {c.model} ({c.dtype}, {dev})")
    model = zoo.load_model(c.model, dtype=c.dtype, device=dev, seed=c.seed)
    vocab = model.config.vocab_size
    batch = random_prompts(c.prompts, vocab, c.prompt_len[0], c.prompt_len[1], c.seed)
    rlk_engines, skipped = engines.available(c.rollout_modes, dev, c.rollout)
    if c.ep is not None:  # EP runs the padded rollout alone (a fixed number of forwards per rank)
        why = f"ep = {c.ep} samples with the padded rollout alone"
        skipped.update({e.name: why for e in rlk_engines if e.name != "padded"})
        rlk_engines = [e for e in rlk_engines if e.name == "padded"]
    # (the warm-up engine, the timed one) per row: the stock row samples with torch.
    rollouts = {"stock": [(PaddedRollout(sampler="torch"),) * 2]}
    rollouts["rlk"] = [(e, e) for e in rlk_engines]
    for e in rlk_engines:  # an engine's own stock counterpart, beside the padded baseline
        twin = e.stock_twin(model, dev)
        if isinstance(twin, str):
            skipped[f"{e.name}-stock"] = twin
        elif twin is not None:
            rollouts["stock"].append((twin, twin))
    train_model = recompute = None
    leaves, rollout_tp, train_tp = c.leaves, c.rollout.tp, c.train_tp
    if rollout_tp > 1 and "rlk" in c.sides:
        say(f"rlk rollout at TP={rollout_tp}: {rollout_tp} spawned processes")
        rollouts["rlk"] = [
            (e, tp_workers.TPRollout(e.name, c.rollout, rollout_tp, leaves, c.backend, warmup))
            for e in rlk_engines
        ]
    if c.ep is not None and "rlk" in c.sides:
        say(f"rlk rollout and training at EP={c.ep}: {c.ep} spawned processes")
        groups = train_groups(c.prompts, c.micro_batch, c.seed)
        recompute = ExpertParallel(c.rollout, c.ep, groups, c.backend, warmup, c.train_engine)
        rollouts["rlk"] = [(e, recompute) for e in rlk_engines]
    elif train_tp > 1 and "rlk" in c.sides and c.train_engine == "transformers":
        say(f"transformers training at TP={train_tp}: {train_tp} spawned processes")
        recompute = tp_workers.TransformersTP(model, train_tp, leaves, c.backend, warmup)
    elif train_tp > 1 and "rlk" in c.sides:
        comm = "NCCL" if dev.type == "cuda" else "gloo"
        say(f"Megatron-core training at TP={train_tp}: {train_tp} spawned {comm} processes")
        recompute = MegatronTP(model, train_tp, leaves, c.backend)  # type: ignore[arg-type]
    elif c.train_engine == "megatron" and "rlk" in c.sides:
        # Megatron-core is optional (rlk-integrations[megatron]): imported where it runs.
        from rlk_integrations.adapters import megatron

        say(f"building the Megatron-core GPTModel (rlk spec, leaves={leaves})")
        train_model = megatron.build_gpt_model(model.config, dtype=c.dtype, leaves=leaves)
        megatron.load_hf_weights(train_model, model.state_dict(), model.config)
        train_model.to(dev)
    rows = []
    chosen = None
    for side in c.sides:
        use = side == "rlk" and c.backend
        with rlk.use_backend(c.backend) if use else contextlib.nullcontext():
            if side == "rlk":
                patch_model(model, leaves=leaves)
                chosen = rlk.current_backend(dev.type)
            else:
                unpatch_model(model)
            for warm_engine, engine in rollouts[side]:
                kw: dict[str, Any] = dict(warm_passes=1 if warmup else 0)
                if side == "rlk":
                    kw.update(train_model=train_model, recompute=recompute)
                    kw["train_graphs"] = c.train_engine == "transformers-graphs"
                if warmup:
                    # In this process only: spawned TP workers warm up themselves.
                    say(f"[{side}] warm-up")
                    here = dict(kw, warm_passes=0, engine=warm_engine)
                    if side == "rlk":
                        here.update(recompute=None)
                    run_side(side, model, batch, 2, micro_batch=c.micro_batch, seed=c.seed + 7,
                             **here)  # fmt: skip
                rows.append(
                    run_side(
                        side,
                        model,
                        batch,
                        c.new_tokens,
                        engine=engine,
                        micro_batch=c.micro_batch,
                        seed=c.seed,
                        temperature=c.temperature,
                        progress=say,
                        **kw,
                    )
                )
    unpatch_model(model)
    return _report(c, model.config.model_type, chosen, [e.name for e in rlk_engines], skipped,
                   rows)  # fmt: skip


def _report(c: ConsistencyConfig, model_type: str, backend: str | None,
            rollout_modes: list[str], skipped: dict[str, str], rows: list[SideResult],
            **extra: Any) -> dict[str, Any]:  # fmt: skip
    """The report of a run of ``c``: its settings, then ``extra``, then the rows."""
    return {
        "model": c.model,
        "model_type": model_type,
        "backend": backend,
        "device": str(c.torch_device),
        "dtype": str(c.dtype).replace("torch.", ""),
        "prompts": c.prompts,
        "new_tokens": c.new_tokens,
        "prompt_len": list(c.prompt_len),
        "micro_batch": c.micro_batch,
        "rollout_modes": rollout_modes,
        "rollout_skipped": skipped,
        "page_size": c.rollout.page_size,
        "max_batch": c.rollout.max_batch,
        "train_engine": c.train_engine,
        "leaves": c.leaves,
        "train_tp": c.train_tp,
        "rollout_tp": c.rollout.tp,
        "ep": c.ep,
        "seed": c.seed,
        "temperature": c.temperature,
        **extra,
        "rows": [asdict(r) for r in rows],
    }


#: The loop's completions per prompt (GRPO's group) and its SGD learning rate (large: most
#: bf16 weights of a random tiny model move every step).
LOOP_GROUP = 4
LOOP_LR = 1.0


def run_loop(config: ConsistencyConfig, progress: Callable[[str], None] | None = None) -> dict:
    """``config.steps`` GRPO steps per side with vLLM as the rollout engine
    (:func:`rlk_integrations.adapters.vllm.loop.grpo_loop`): vLLM samples :data:`LOOP_GROUP`
    completions of each prompt at ``config.temperature``, the trainer recomputes their
    log-probabilities and updates by SGD (:data:`LOOP_LR`), the new weights go into the running
    engine, and so on. The rlk side: rlk's vLLM models (``leaves`` as the trainer's), the
    transformers trainer on rlk or Megatron-core's (``train_engine``, at ``train_tp``), weights
    pushed by rlk's update path. The stock side: stock vLLM, the stock transformers trainer,
    vLLM's own ``reload_weights``. The report has a row per side and step (``step``); the rlk
    rows compare the rollout with the recompute of the weights that sampled it."""
    # vLLM and Megatron-core are optional: imported where they run.
    from rlk_integrations.adapters.vllm import loop
    from rlk_integrations.adapters.vllm.engine import VLLMRollout, start_llm

    c, say = config, progress or (lambda msg: None)
    dev = c.torch_device
    say(f"loading {c.model} ({c.dtype}, {dev})")
    cfg = zoo.load_model(c.model, dtype=c.dtype, seed=c.seed).config
    batch = random_prompts(c.prompts, cfg.vocab_size, c.prompt_len[0], c.prompt_len[1], c.seed)
    max_len = max(max(len(p) for p in batch) + c.new_tokens + 1, 512)
    step_tokens = LOOP_GROUP * sum(len(p) + 1 for p in batch)
    rows, skipped, chosen = [], {}, None
    for side in c.sides:
        stock = side == "stock"
        model = zoo.load_model(c.model, dtype=c.dtype, device=dev, seed=c.seed)  # each its own
        why = VLLMRollout(c.rollout).stock_twin(model, dev) if stock else None
        if isinstance(why, str):
            skipped["vllm-stock"] = why
            continue
        leaves = None if stock else c.leaves
        with tempfile.TemporaryDirectory(prefix="rlk-loop-") as tmp:
            say(f"[{side}] starting vLLM ({'stock' if stock else 'rlk'} model classes)")
            llm = start_llm(model, tmp, max_len=max_len, step_tokens=step_tokens, stock=stock,
                            page_size=c.rollout.page_size, leaves=leaves)  # fmt: skip
            trainer: Any = None
            use = c.backend if not stock else None
            try:
                with rlk.use_backend(use) if use else contextlib.nullcontext():
                    trainer = _loop_trainer(c, model, stock, say)
                    chosen = chosen if stock else rlk.current_backend(dev.type)
                    steps = loop.grpo_loop(llm, trainer, batch, c.steps, n=LOOP_GROUP,
                                           new_tokens=c.new_tokens, temperature=c.temperature,
                                           seed=c.seed, stock=stock)  # fmt: skip
                    for st in steps:
                        rows.append(_loop_row(side, trainer.name, st))
                        say(f"[{side}] step {st.step}: max |dlogp| {rows[-1].max_abs_dlogp:.3e}")
            finally:
                if trainer is not None:
                    trainer.close()
                llm.llm_engine.engine_core.shutdown()
    return _report(c, cfg.model_type, chosen, ["vllm"], skipped, rows, steps=c.steps,
                   group_size=LOOP_GROUP)  # fmt: skip


def _loop_trainer(c: ConsistencyConfig, model: torch.nn.Module, stock: bool, say) -> Any:
    """The loop's trainer of one side (``model`` unpatched)."""
    from rlk_integrations.adapters.vllm import loop

    kw = dict(lr=LOOP_LR, micro_batch=c.micro_batch)
    if stock:
        return loop.TransformersTrainer(model, use_rlk=False, **kw)
    if c.train_engine == "megatron":
        say(f"[rlk] Megatron-core trainer at TP={c.train_tp}")
        return loop.MegatronTrainer(model, tp=c.train_tp, leaves=c.leaves, **kw)
    return loop.TransformersTrainer(patch_model(model, leaves=c.leaves), **kw)


def _loop_row(side: str, train_engine: str, st: Any) -> SideResult:
    """A report row of one loop step (a :class:`~rlk_integrations.adapters.vllm.loop.LoopStep`)."""
    new = sum(len(s.response) for s in st.samples)
    tokens = sum(len(s.tokens) for s in st.samples)
    return SideResult(
        side=side,
        rollout_mode="vllm-stock" if side == "stock" else "vllm",
        train_engine=train_engine,
        step=st.step,
        rollout_tok_s=new / st.rollout_s if st.rollout_s > 0 else math.inf,
        train_tok_s=tokens / st.train_s if st.train_s > 0 else math.inf,
        **compare([s.logprobs for s in st.samples], st.recomputed),
    )
