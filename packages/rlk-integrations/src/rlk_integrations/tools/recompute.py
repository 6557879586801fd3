"""Where ``rlk consistency``'s training recompute runs: in this process
(:func:`recompute_here`, forward + backward over packed micro-batches), in Megatron-core ranks
at tensor parallelism (:class:`MegatronTP`), or in the ranks of an expert-parallel group that
also sample (:class:`ExpertParallel`). The last two spawn their processes
(:func:`torch.multiprocessing.spawn`, :func:`~rlk_integrations.engine.tp_workers.spawn`) and
hand back the log-probabilities per sample and the time of the recompute, as
:func:`rlk_integrations.tools.consistency.run_side`'s ``recompute`` takes them.

Example::

    tp = MegatronTP(model, 2, 8, None)             # Megatron-core at TP 2, 8 leaves
    lps, seconds = tp(samples, groups, 1.0, torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlk
from rlk_integrations.engine import engines, tp_workers, training
from rlk_integrations.engine.engines import RolloutOptions, RolloutResult
from rlk_integrations.models import moe


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing elsewhere): timings end here."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def recompute_here(model, trainer, train_model, ro, groups, temperature, use_rlk, device,
                    warm_passes=0, graphed=None):  # fmt: skip
    """Training recompute (forward + backward) in this process: (log-probs, tokens, seconds).
    ``warm_passes`` untimed passes first (the training shapes' kernels compile there; a
    ``graphed`` recompute captures there)."""

    def one_pass():
        lps_out: list[torch.Tensor | None] = [None] * len(ro.samples)
        tokens = 0
        with torch.enable_grad():
            for group in groups:
                batch = [ro.samples[i] for i in group]
                if graphed is not None:
                    lps = graphed(batch)
                elif train_model is None:
                    lps = training.packed_logprobs(
                        model,
                        batch,
                        temperature=temperature,
                        use_rlk=use_rlk,
                        logits_dtype=ro.logits_dtype,
                    )
                else:
                    # Megatron-core is optional (rlk-integrations[megatron]): imported here.
                    from rlk_integrations.adapters import megatron

                    lps = megatron.packed_logprobs(
                        train_model, batch, temperature=temperature, logits_dtype=ro.logits_dtype
                    )
                loss = -torch.cat(lps).sum() / max(ro.new_tokens, 1)
                loss.backward()
                tokens += sum(len(s.tokens) for s in batch)
                for i, lp in zip(group, lps):
                    lps_out[i] = lp.detach()
        trainer.zero_grad(set_to_none=True)
        return lps_out, tokens

    trainer.zero_grad(set_to_none=True)
    for _ in range(warm_passes):
        one_pass()
    sync(device)
    start = time.perf_counter()
    train_lps, train_tokens = one_pass()
    sync(device)
    return train_lps, train_tokens, time.perf_counter() - start


class MegatronTP:
    """Training recompute in Megatron-core at tensor parallelism ``world``: spawns ``world``
    processes (NCCL, rank r on ``cuda:r``, when ``model`` is on a CUDA device; gloo on CPU)
    that each build the rlk ``GPTModel`` (``leaves`` tree-ordered linears) from their
    :func:`~rlk_integrations.adapters.megatron.shard_for_tp` shard of ``model``'s weights, run the
    micro-batches forward + backward, and rank 0 hands back the log-probs and the time of the
    forward/backward loop. Usable as ``run_side``'s ``recompute``."""

    def __init__(self, model: torch.nn.Module, world: int, leaves: int, backend: str | None):
        self.config = model.config
        self.device = next(model.parameters()).device.type
        if self.device == "cuda" and torch.cuda.device_count() < world:
            raise RuntimeError(
                f"train_tp = {world} needs {world} GPUs, {torch.cuda.device_count()} visible"
            )
        self.state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        self.world, self.leaves, self.backend = world, leaves, backend
        self.engine = f"megatron-tp{world}"

    def __call__(self, samples, groups, temperature, logits_dtype):
        # The workers need the tokens only; CPU copies keep CUDA tensors out of the pickles.
        samples = [dataclasses.replace(s, logprobs=s.logprobs.detach().cpu()) for s in samples]
        with tempfile.TemporaryDirectory(prefix="rlk-tp-") as tmp:
            weights, out = os.path.join(tmp, "weights.pt"), os.path.join(tmp, "out.pt")
            torch.save(self.state, weights)
            rendezvous = os.path.join(tmp, "rendezvous")
            args = (self.world, rendezvous, self.device, self.config, weights, self.leaves)
            args += (self.backend, samples, groups, temperature, logits_dtype, out)
            mp.spawn(_megatron_tp_worker, args=args, nprocs=self.world, join=True)
            res = torch.load(out, weights_only=True)
        return res["logprobs"], res["seconds"]


def _megatron_tp_worker(
    rank, world, init_file, device, config, weights, leaves, backend, samples, groups,
    temperature, logits_dtype, out,
):  # fmt: skip
    # Spawned: importing rlk_integrations.tools.recompute imported rlk first, which picks Triton's
    # CPU interpreter (on a machine without a GPU) before Megatron imports triton.
    # Megatron-core is optional (rlk-integrations[megatron]): imported where it runs.
    from rlk_integrations.adapters import megatron

    dev, teardown = megatron.init_distributed(rank, world, init_file, device)
    try:
        with rlk.use_backend(backend) if backend else contextlib.nullcontext():
            state = torch.load(weights, weights_only=True)
            dtype = next(iter(state.values())).dtype
            mg = megatron.build_gpt_model(config, dtype=dtype, leaves=leaves)
            megatron.load_hf_weights(mg, state, config, rank=rank, world_size=world)
            del state
            mg.to(dev)
            lps: list[torch.Tensor | None] = [None] * len(samples)
            total = max(sum(len(s.response) for s in samples), 1)
            sync(dev)
            dist.barrier()
            start = time.perf_counter()
            with torch.enable_grad():
                for group in groups:
                    batch = [samples[i] for i in group]
                    got = megatron.packed_logprobs(
                        mg, batch, temperature=temperature, logits_dtype=logits_dtype
                    )
                    (-torch.cat(got).sum() / total).backward()
                    for i, lp in zip(group, got):
                        lps[i] = lp.detach()
            sync(dev)
            dist.barrier()
            seconds = time.perf_counter() - start
        if rank == 0:
            torch.save({"logprobs": [lp.cpu() for lp in lps], "seconds": seconds}, out)
    finally:
        teardown()


def _rank_share(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s indices of ``n`` (``world`` must divide it): a contiguous equal share, so
    that every rank runs the same number of forwards (the all-to-alls pair them up)."""
    per = n // world
    return range(rank * per, (rank + 1) * per)


def _gather(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, obj)
    return parts


class ExpertParallel:
    """The padded rollout and the training recompute (``train_engine``: the transformers model
    or Megatron-core's ``GPTModel``, both on rlk) at expert parallelism ``world``, in one spawn
    of ``world`` processes (gloo on CPU, NCCL on GPUs) whose models hold ``1/world`` of every MoE
    layer's experts (:func:`~rlk_integrations.models.ep.shard_ep`; Megatron's EP group): as in
    an RL step, the ranks that sample then recompute. Rank r samples prompts ``r*P/world ..
    (r+1)*P/world`` with their seeds (the padded engine built from ``options``); then, the
    samples exchanged, it recomputes (forward + backward) its contiguous share of the order of
    ``groups`` (so another share than it sampled) in packed micro-batches as large as the
    largest of ``groups``. The tokens reach their experts by all-to-all; times are the slowest
    rank's.

    The object is :func:`run_side`'s rollout engine (``padded-ep<world>``; :meth:`generate` runs
    both passes) and its ``recompute`` (``<train_engine>-ep<world>``; the call hands back the
    recompute of the samples :meth:`generate` returned, for the ``groups`` it was built with).
    ``routing`` (after a call): the experts each token was routed to in the rollout and in the
    recompute, two ``{(sample, position): experts per layer}``.

    Example::

        groups = [[3, 0], [2, 1]]                  # the recompute's micro-batches
        ep = ExpertParallel(RolloutOptions(), 2, groups, None, False, "megatron")
        ro = ep.generate(model, prompts, 8, seeds)
        lps, seconds = ep(ro.samples, groups, 1.0, ro.logits_dtype)
    """

    def __init__(self, options: RolloutOptions, world: int, groups: list[list[int]],
                 backend: str | None, warmup: bool,
                 train_engine: str = "transformers") -> None:  # fmt: skip
        if train_engine not in ("transformers", "megatron"):
            raise ValueError(f"train_engine must be transformers or megatron, got {train_engine!r}")
        self.options, self.world, self.groups = options, world, groups
        self.backend, self.warmup, self.train_engine = backend, warmup, train_engine
        self.name, self.engine = f"padded-ep{world}", f"{train_engine}-ep{world}"
        self.routing: tuple[dict, dict] | None = None
        self._done: tuple[Any, Any] | None = None

    def stock_twin(self, model, device) -> None:
        return None  # the stock side runs on one device

    def unavailable(self, device: torch.device) -> str | None:
        if device.type == "cuda" and torch.cuda.device_count() < self.world:
            return f"EP={self.world} needs {self.world} GPUs, found {torch.cuda.device_count()}"
        return None

    def generate(self, model, prompts, new_tokens, seeds, *, temperature=1.0, top_k=0,
                 top_p=1.0, eos_token_id=None, progress=None) -> RolloutResult:  # fmt: skip
        if eos_token_id is not None:  # a rank that stops early would leave the others waiting
            raise ValueError("ExpertParallel samples a fixed number of tokens: eos_token_id None")
        if len(prompts) % self.world or sorted(i for g in self.groups for i in g) != list(
            range(len(prompts))
        ):
            raise ValueError(
                f"EP={self.world} must divide the {len(prompts)} prompts, and groups hold each "
                "prompt's sample once"
            )
        p = next(model.parameters())
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        with tempfile.TemporaryDirectory(prefix="rlk-ep-") as tmp:
            weights = os.path.join(tmp, "weights.pt")
            tp_workers.save_weights(model, weights)
            ro, lps, seconds, self.routing = tp_workers.spawn(
                _ep_worker, self.world, p.device.type, model.config, weights, p.dtype,
                self.options, prompts, new_tokens, seeds, kw, self.groups, self.warmup,
                self.train_engine, backend=self.backend,
            )  # fmt: skip
        for smp in ro.samples:
            smp.logprobs = smp.logprobs.to(p.device)
        self._done = (ro.samples, ([lp.to(p.device) for lp in lps], seconds))
        return ro

    def __call__(self, samples, groups, temperature, logits_dtype):
        if self._done is None or samples is not self._done[0] or groups != self.groups:
            raise ValueError(
                "ExpertParallel recomputes the samples of its last generate, for its groups"
            )
        return self._done[1]


def _ep_worker(rank, world, device, config, weights, dtype, options, prompts, new_tokens,
               seeds, sample_kw, groups, warmup, train_engine):  # fmt: skip
    """A rank of :class:`ExpertParallel`: ``(rollout, log-probs per sample, seconds, (rollout
    routing, recompute routing))``, every rank's gathered."""
    model = tp_workers.build_sharded(config, weights, dtype, device, None, ep=True)
    mine = _rank_share(len(prompts), rank, world)
    args = ([prompts[i] for i in mine], new_tokens, [seeds[i] for i in mine])
    engine = engines.create("padded", options)
    if warmup:  # untimed: the kernels compile here
        engine.generate(model, args[0], 2, args[2], **sample_kw)
    with moe.RoutingLog(model) as log:
        ro = engine.generate(model, *args, **sample_kw)
    for s in ro.samples:
        s.logprobs = s.logprobs.cpu()
    routed = {(mine[b], pos): e for (b, pos), e in moe.padded_routing(log).items()}
    parts = _gather((ro, routed), world)
    ro = RolloutResult(
        samples=[s for r, _ in parts for s in r.samples],
        seconds=max(r.seconds for r, _ in parts),
        new_tokens=sum(r.new_tokens for r, _ in parts),
        logits_dtype=ro.logits_dtype,
    )
    rollout_routing = {k: v for _, r in parts for k, v in r.items()}
    # The recompute: this rank's share of the groups' order, in micro-batches of their size.
    order = [i for g in groups for i in g]
    share = [order[i] for i in _rank_share(len(order), rank, world)]
    mine_groups = training.micro_batches(len(share), max(len(g) for g in groups), share)
    trainer, teardown = model, None
    try:
        if train_engine == "megatron":
            # Megatron-core is optional (rlk-integrations[megatron]): imported where it runs.
            from rlk_integrations.adapters import megatron

            teardown = megatron.init_model_parallel(1, world)  # EP over this process group
            trainer = megatron.build_gpt_model(config, dtype=dtype)
            megatron.load_hf_weights(trainer, torch.load(weights, weights_only=True), config,
                                     ep_rank=rank, ep_world_size=world)  # fmt: skip
            trainer.to(device)
            log = megatron.RoutingLog(trainer)
        else:
            log = moe.RoutingLog(model)
        with log:
            lps, _, seconds = recompute_here(model, trainer, None if trainer is model else trainer,
                                             ro, mine_groups, sample_kw["temperature"], True,
                                              device, 1 if warmup else 0)  # fmt: skip
    finally:
        if teardown is not None:
            teardown()
    routed = moe.packed_routing(log, mine_groups)
    parts = _gather(([None if lp is None else lp.cpu() for lp in lps], routed, seconds), world)
    lps = [next(p[0][i] for p in parts if p[0][i] is not None) for i in range(len(order))]
    train_routing = {k: v for p in parts for k, v in p[1].items()}
    return ro, lps, max(p[2] for p in parts), (rollout_routing, train_routing)
