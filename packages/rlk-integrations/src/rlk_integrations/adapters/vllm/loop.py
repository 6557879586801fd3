"""The GRPO loop with vLLM as the rollout engine: vLLM samples, a trainer recomputes the
log-probabilities and updates, and the new weights go back into the running engine; then vLLM
samples again. On rlk's vLLM models the trainer's recompute equals the rollout's
log-probabilities bit for bit at every step (importance ratio exactly 1); with stock vLLM and a
stock trainer it does not.

Pieces:

- :func:`sample`: vLLM's ``generate`` as :class:`~rlk_integrations.engine.engines.Sample` per
  completion (vLLM's own log-probabilities; ``logprobs_mode="processed_logprobs"`` for a
  temperature other than 1);
- trainers, each with ``step(samples, rewards, group_size, temperature)`` (one
  :func:`~rlk_integrations.engine.training.grpo_update` by SGD; returns the recomputed
  log-probabilities, taken before the update) and ``weights()`` (``(checkpoint name, tensor)``
  pairs, a tied head under ``lm_head.weight`` too): :class:`TransformersTrainer` (the
  transformers model, patched on rlk or stock) and :class:`MegatronTrainer` (Megatron-core's
  ``GPTModel`` on rlk at tensor parallelism 1 in this process, or ``tp`` spawned gloo/NCCL
  ranks whose shards are joined and converted back to the checkpoint's names);
- :func:`push`: rlk's update path (:func:`rlk_integrations.adapters.vllm.update_weights`,
  buckets through ``collective_rpc``, prefix cache reset) or, for stock vLLM, vLLM's own
  ``reload_weights`` from a safetensors file;
- :func:`grpo_loop`: the steps, yielding a :class:`LoopStep` each.

Example (``llm`` started with ``engine_args(logprobs_mode="processed_logprobs")``)::

    trainer = TransformersTrainer(patch_model(model), lr=1.0)
    for step in grpo_loop(llm, trainer, prompts, steps=3, temperature=0.7):
        assert all(torch.equal(s.logprobs, lp) for s, lp in zip(step.samples, step.recomputed))
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import rlk_integrations.adapters.vllm as rv
from rlk_integrations.engine import tp_workers, training
from rlk_integrations.engine.engines import Sample


def as_sample(out: Any, j: int = 0) -> Sample:
    """Completion ``j`` of a vLLM ``RequestOutput`` (requested with ``logprobs=0``) as a
    :class:`Sample` whose ``logprobs`` (float32 ``[len(response)]``) are vLLM's."""
    c = out.outputs[j]
    lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
    return Sample(list(out.prompt_token_ids), list(c.token_ids), torch.tensor(lps))


def sample(llm: Any, prompts: list[list[int]], params: Any) -> list[list[Sample]]:
    """``llm.generate`` on token-id prompts with ``params`` (one ``SamplingParams`` or one per
    prompt); per prompt its ``n`` completions as :class:`Sample`."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[as_sample(o, j) for j in range(len(o.outputs))] for o in outs]


def parity_rewards(samples: list[Sample]) -> torch.Tensor:
    """The loop's stand-in reward: the count of even token ids in each response (float32
    ``[len(samples)]``), so that completions of a prompt differ and GRPO's advantages do."""
    return torch.tensor([float(sum(t % 2 == 0 for t in s.response)) for s in samples])


class TransformersTrainer:
    """A transformers causal LM trained by SGD (``lr``) with GRPO: patched by
    :func:`~rlk_integrations.models.transformers.patch_model` (``use_rlk=True``, the
    recompute is :func:`rlk.linear_logprobs`' bits) or stock (``use_rlk=False``, the negative
    control). ``micro_batch``: samples per packed training micro-batch."""

    def __init__(self, model: torch.nn.Module, *, lr: float, micro_batch: int = 3,
                 use_rlk: bool = True) -> None:  # fmt: skip
        self.model, self.micro_batch, self.use_rlk = model, micro_batch, use_rlk
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        self.name = "transformers"

    def step(self, samples: list[Sample], rewards: torch.Tensor, group_size: int,
             temperature: float) -> list[torch.Tensor]:  # fmt: skip
        def recompute(batch: list[Sample]) -> list[torch.Tensor]:
            return training.packed_logprobs(self.model, batch, temperature=temperature,
                                            use_rlk=self.use_rlk)  # fmt: skip

        device = next(self.model.parameters()).device
        with torch.enable_grad():
            _, lps = training.grpo_update(recompute, self.optimizer, samples, rewards,
                                          group_size, self.micro_batch, device=device)  # fmt: skip
        return lps

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        # A tied head under its own name too: vLLM's reload of stock models needs it.
        named = self.model.named_parameters(remove_duplicate=False)
        return [(n, p.detach()) for n, p in named]

    def close(self) -> None:
        pass


class MegatronTrainer:
    """Megatron-core's ``GPTModel`` with rlk's layer spec, built from a transformers model's
    config and weights and trained by SGD (``lr``) with GRPO, at tensor parallelism ``tp``:

    - ``tp == 1``: in this process (Megatron's state set up here; :meth:`close` tears it down);
    - ``tp > 1``: each :meth:`step` spawns ``tp`` ranks (gloo on the CPU, NCCL on
      ``cuda:0..tp-1``) that load their :func:`~rlk_integrations.adapters.megatron.shard_for_tp`
      shard of the current weights, recompute and update; the updated shards come back,
      joined (:func:`unshard_tp`). SGD keeps no state between steps, so a fresh group per
      step is the same update as a persistent one; it costs a spawn, a process group and a
      model build every step (about 25 s a step on 2 CPU cores), which a persistent group
      would not: this trainer is for checking bits, not for speed.

    ``leaves``: the row/column-parallel linears on rlk's tree-ordered linears (needed at
    ``tp > 1``; vLLM's model then runs ``o_proj``/``down_proj`` with the same leaves:
    ``engine_args(leaves=...)``). :meth:`weights` are the checkpoint's names
    (:func:`~rlk_integrations.adapters.megatron.megatron_to_hf`)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, micro_batch: int = 3, tp: int = 1,
                 leaves: int | None = None) -> None:  # fmt: skip
        # Megatron-core is optional (rlk-integrations[megatron]): imported where it runs.
        from rlk_integrations.adapters import megatron

        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {tp!r}")
        if tp > 1 and not leaves:
            raise ValueError(f"tp = {tp} needs leaves (tree-ordered parallel linears)")
        self.config, self.lr, self.micro_batch = model.config, lr, micro_batch
        self.tp, self.leaves = tp, leaves
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.name = "megatron" if tp == 1 else f"megatron-tp{tp}"
        self._teardown = None
        self._state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if tp == 1:
            self._teardown = megatron.init_single_process()
            self.mg = megatron.build_gpt_model(self.config, dtype=self.dtype, leaves=leaves)
            megatron.load_hf_weights(self.mg, self._state, self.config)
            self.mg.to(self.device)
            self.optimizer = torch.optim.SGD(self.mg.parameters(), lr=lr)

    def step(self, samples: list[Sample], rewards: torch.Tensor, group_size: int,
             temperature: float) -> list[torch.Tensor]:  # fmt: skip
        if self.tp == 1:
            with torch.enable_grad():
                _, lps = _megatron_update(self.mg, self.optimizer, samples, rewards, group_size,
                                          self.micro_batch, temperature)  # fmt: skip
            return lps
        samples = [Sample(s.prompt, s.response, s.logprobs.detach().cpu()) for s in samples]
        with tempfile.TemporaryDirectory(prefix="rlk-megatron-") as tmp:
            path = os.path.join(tmp, "weights.pt")
            torch.save(self._state, path)
            lps, self._state = tp_workers.spawn(
                _megatron_tp_step, self.tp, self.device.type, self.config, path, self.dtype,
                self.leaves, self.lr, samples, rewards.cpu(), group_size, self.micro_batch,
                temperature,
            )  # fmt: skip
        return [lp.to(self.device) for lp in lps]

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        from rlk_integrations.adapters import megatron

        if self.tp == 1:
            return list(megatron.megatron_to_hf(self.mg.state_dict(), self.config).items())
        return list(self._state.items())

    def close(self) -> None:
        if self._teardown is not None:
            self._teardown()
            self._teardown = None


def _megatron_update(mg, optimizer, samples, rewards, group_size, micro_batch, temperature):
    from rlk_integrations.adapters import megatron

    def recompute(batch: list[Sample]) -> list[torch.Tensor]:
        return megatron.packed_logprobs(mg, batch, temperature=temperature)

    device = next(mg.parameters()).device
    return training.grpo_update(recompute, optimizer, samples, rewards, group_size, micro_batch,
                                device=device)  # fmt: skip


def _megatron_tp_step(rank, world, device, config, weights, dtype, leaves, lr, samples, rewards,
                      group_size, micro_batch, temperature):  # fmt: skip
    """A rank of :class:`MegatronTrainer`'s step at TP = ``world`` (in a process group set up
    by :func:`~rlk_integrations.engine.tp_workers.spawn`): rank 0 returns the recomputed
    log-probabilities and the updated weights under the checkpoint's names."""
    import torch.distributed as dist

    from rlk_integrations.adapters import megatron

    teardown = megatron.init_model_parallel(world)
    try:
        mg = megatron.build_gpt_model(config, dtype=dtype, leaves=leaves)
        megatron.load_hf_weights(mg, torch.load(weights, weights_only=True), config, rank=rank,
                                 world_size=world)  # fmt: skip
        mg.to(device)
        optimizer = torch.optim.SGD(mg.parameters(), lr=lr)
        with torch.enable_grad():
            _, lps = _megatron_update(mg, optimizer, samples, rewards, group_size, micro_batch,
                                      temperature)  # fmt: skip
        shard = {k: v.detach().cpu() for k, v in mg.state_dict().items()
                 if not k.endswith("_extra_state")}  # fmt: skip
        shards: list[Any] = [None] * world
        dist.all_gather_object(shards, shard)
    finally:
        teardown()
    if rank != 0:
        return None
    full = megatron.megatron_to_hf(unshard_tp(shards), config)
    return [lp.cpu() for lp in lps], full


def unshard_tp(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`rlk_integrations.adapters.megatron.shard_for_tp`: the TP=1
    Megatron state dict from every rank's shard (``shards[r]``: rank r's ``state_dict()``), for
    :func:`~rlk_integrations.adapters.megatron.megatron_to_hf`. A replicated tensor (a norm)
    must be bitwise the same on every rank (``ValueError`` naming it otherwise: the ranks'
    updates diverged)."""
    world = len(shards)
    out = {}
    for key, first in shards[0].items():
        if key.endswith("_extra_state"):
            continue
        parts = [sd[key] for sd in shards]
        if key.endswith(("linear_qkv.weight", "linear_qkv.bias")) or key in (
            "embedding.word_embeddings.weight",
            "output_layer.weight",
        ):
            out[key] = torch.cat(parts, 0)
        elif key.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[key] = torch.cat(parts, 1)
        elif all(torch.equal(first, p) for p in parts[1:]):
            out[key] = first
        else:
            raise ValueError(f"unshard_tp: the replicated {key} differs between the {world} ranks")
    return out


def push(llm: Any, weights: Iterable[tuple[str, torch.Tensor]], *, stock: bool = False,
         bucket_size: int = 8) -> None:  # fmt: skip
    """New weights (checkpoint names) into a running ``vllm.LLM``: on rlk's models through
    :func:`rlk_integrations.adapters.vllm.update_weights` (buckets of ``bucket_size``
    tensors, prefix cache reset; ``RuntimeError`` if a tensor stays stale); with ``stock``
    through vLLM's own ``reload_weights`` from a safetensors file, then the prefix-cache
    reset."""
    if not stock:
        stale = rv.update_weights(llm, weights, bucket_size=bucket_size)
        if stale:
            raise RuntimeError(f"the update left {stale} tensors of the vLLM model stale")
        return
    from safetensors.torch import save_file

    tmp = tempfile.mkdtemp(prefix="rlk-vllm-weights-")
    try:
        save_file({n: t.detach().cpu().contiguous().clone() for n, t in weights},
                  os.path.join(tmp, "model.safetensors"))  # fmt: skip
        llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache after the weight reload")


@dataclass
class LoopStep:
    """One step of :func:`grpo_loop`: the rollout's samples (vLLM's log-probabilities), the
    trainer's recompute of them before its update, and the seconds each phase took."""

    step: int
    samples: list[Sample]
    recomputed: list[torch.Tensor]
    rollout_s: float
    train_s: float
    push_s: float

    @property
    def max_abs_dlogp(self) -> float:
        return max(float((s.logprobs - lp.cpu()).abs().max()) for s, lp in
                   zip(self.samples, self.recomputed))  # fmt: skip


def grpo_loop(llm: Any, trainer: Any, prompts: list[list[int]], steps: int, *, n: int = 4,
              new_tokens: int = 4, temperature: float = 0.7, seed: int = 0,
              stock: bool = False, bucket_size: int = 8) -> Iterator[LoopStep]:  # fmt: skip
    """``steps`` GRPO steps: vLLM samples ``n`` completions of ``new_tokens`` tokens per prompt
    at ``temperature`` (seeded per step from ``seed``), ``trainer.step`` recomputes and updates
    (:func:`parity_rewards`, groups of ``n``), :func:`push` sends ``trainer.weights()`` into
    ``llm`` (``stock``: vLLM's own reload). Yields a :class:`LoopStep` per step, after the push."""
    from vllm import SamplingParams

    for name, v in (("steps", steps), ("n", n), ("new_tokens", new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (vLLM samples greedily at 0), got {temperature}")
    for step in range(steps):
        sp = SamplingParams(temperature=temperature, n=n, max_tokens=new_tokens, logprobs=0,
                            seed=seed * 1000 + step, ignore_eos=True)  # fmt: skip
        t0 = time.perf_counter()
        samples = [s for group in sample(llm, prompts, sp) for s in group]
        t1 = time.perf_counter()
        lps = trainer.step(samples, parity_rewards(samples), n, temperature)
        t2 = time.perf_counter()
        push(llm, trainer.weights(), stock=stock, bucket_size=bucket_size)
        yield LoopStep(step, samples, lps, t1 - t0, t2 - t1, time.perf_counter() - t2)


__all__ = [
    "LoopStep",
    "MegatronTrainer",
    "TransformersTrainer",
    "as_sample",
    "grpo_loop",
    "parity_rewards",
    "push",
    "sample",
    "unshard_tp",
]
