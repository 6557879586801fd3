"""Processes of a tensor-parallel group running the transformers integration.

:func:`spawn` runs a function in ``t`` processes (gloo on CPU, NCCL on GPUs, rank ``r`` on
``cuda:r``) and returns rank 0's result; ``rlk consistency --rollout-tp/--train-tp`` use it
through :func:`rollout_worker` and :func:`train_worker`, whose ranks build their shard of the
model with :func:`build_sharded` (:func:`rlk_integrations.models.tp.shard_tp`): :class:`TPRollout`
is a rollout engine of :mod:`rlk_integrations.engine.engines` run that way, and
:class:`TransformersTP` the training recompute.

Example::

    save_weights(model, path)
    lps, seconds = spawn(train_worker, 2, "cpu", model.config, path, torch.float32, 8, samples,
                         groups, 1.0, None, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import rlk
from rlk_integrations.engine import engines, training
from rlk_integrations.engine.engines import RolloutOptions, RolloutResult, Sample
from rlk_integrations.models.ep import shard_ep
from rlk_integrations.models.tp import shard_tp
from rlk_integrations.models.transformers import patch_model

#: Seconds a collective of :func:`spawn`'s ranks may wait for the others before it raises: a
#: rank that stalls or skips a collective fails the run instead of holding the rest for gloo's
#: default 30 minutes.
COLLECTIVE_TIMEOUT_S = 600.0


def _entry(rank, world, init_file, out, device_type, backend, timeout_s, fn, args):
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        with rlk.use_backend(backend) if backend else contextlib.nullcontext():
            result = fn(rank, world, device, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def spawn(fn: Any, world: int, device_type: str, *args: Any, backend: str | None = None,
          timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Any:  # fmt: skip
    """Run ``fn(rank, world, device, *args)`` in ``world`` new processes (gloo on CPU; NCCL on
    CUDA with rank r on ``cuda:r``) under ``rlk.use_backend(backend)``; returns rank 0's result.
    ``fn`` must be importable (a module-level function) and return tensors, plain Python data or
    rollout records (the result comes back through ``torch.load(weights_only=True)``). A
    collective that waits more than ``timeout_s`` seconds for the other ranks raises in its
    rank, and the run fails with that rank's error."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(
            f"TP={world} on CUDA needs {world} GPUs, found {torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory(prefix="rlk-tp-") as tmp:
        out = os.path.join(tmp, "out.pt")
        args = (world, os.path.join(tmp, "rendezvous"), out, device_type, backend,
                float(timeout_s), fn, args)  # fmt: skip
        mp.spawn(_entry, args=args, nprocs=world, join=True)
        # weights_only: tensors and plain data only, plus the rollout's records by name
        # (add_safe_globals, unlike the safe_globals context manager, exists since torch 2.4).
        torch.serialization.add_safe_globals([RolloutResult, Sample])
        return torch.load(out, weights_only=True)


def build_sharded(config, weights: str, dtype, device, leaves: int | None, stock_allreduce=False,
                  ep: bool = False):  # fmt: skip
    """This rank's model: built from ``config``, the weights of the file ``weights`` (a full
    state dict), patched with ``leaves`` and sharded over the default process group: tensor
    parallel (:func:`~rlk_integrations.models.tp.shard_tp`), or with ``ep`` its experts
    (:func:`~rlk_integrations.models.ep.shard_ep`)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        # (patch_model sets the attention; the pickled config may carry it already)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    patch_model(model, leaves=leaves)
    return shard_ep(model) if ep else shard_tp(model, stock_allreduce=stock_allreduce)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout_worker(rank, world, device, config, weights, dtype, leaves, name, options,
                   prompts, new_tokens, seeds, sample_kw, warmup):  # fmt: skip
    """A rank of a TP rollout: the engine ``name`` of :mod:`rlk_integrations.engine.engines`, built
    from ``options``, samples with this rank's shard; returns the
    :class:`~rlk_integrations.engine.engines.RolloutResult` (samples on the CPU). ``sample_kw``: the
    sampling keywords of :meth:`~rlk_integrations.engine.engines.RolloutEngine.generate`."""
    model = build_sharded(config, weights, dtype, device, leaves)
    engine = engines.create(name, options)
    if warmup:
        engine.generate(model, prompts, 2, seeds, **sample_kw)
    ro = engine.generate(model, prompts, new_tokens, seeds, **sample_kw)
    for s in ro.samples:
        s.logprobs = s.logprobs.cpu()
    return ro


def train_worker(rank, world, device, config, weights, dtype, leaves, samples, groups,
                 temperature, logits_dtype, warmup, stock_allreduce=False):  # fmt: skip
    """A rank of a TP training recompute (forward + backward per packed micro-batch):
    returns ``(log-probs per sample, seconds)``."""
    model = build_sharded(config, weights, dtype, device, leaves, stock_allreduce)
    total = max(sum(len(s.response) for s in samples), 1)

    def step(batch):
        lps = training.packed_logprobs(model, batch, temperature=temperature,
                                       logits_dtype=logits_dtype)  # fmt: skip
        (-torch.cat(lps).sum() / total).backward()
        return lps

    if warmup:  # one untimed pass: the training shapes' kernels compile here
        with torch.enable_grad():
            for group in groups:
                step([samples[i] for i in group])
        model.zero_grad(set_to_none=True)
    out: list[torch.Tensor | None] = [None] * len(samples)
    _sync(device)
    start = time.perf_counter()
    with torch.enable_grad():
        for group in groups:
            for i, lp in zip(group, step([samples[i] for i in group])):
                out[i] = lp.detach().cpu()
    _sync(device)
    return out, time.perf_counter() - start


def save_weights(model: nn.Module, path: str) -> None:
    """The full state dict on the CPU, for :func:`build_sharded` in other processes."""
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)


@contextlib.contextmanager
def _weights_file(model):
    with tempfile.TemporaryDirectory(prefix="rlk-weights-") as tmp:
        path = os.path.join(tmp, "weights.pt")
        save_weights(model, path)
        yield path


class TPRollout:
    """The rollout engine ``name`` at tensor parallelism ``world``, itself a rollout engine
    (:class:`~rlk_integrations.engine.engines.RolloutEngine`, named ``<name>-tp<world>``): each call
    spawns ``world`` processes (gloo on CPU, NCCL on GPUs) that shard the model's weights
    (``leaves`` tree-ordered row-parallel linears) and build the engine from ``options``;
    rank 0's result comes back. The ranks print no progress; with ``warmup`` each first samples
    2 tokens untimed (its kernels compile there)."""

    def __init__(self, name: str, options: RolloutOptions, world: int, leaves: int | None,
                 backend: str | None, warmup: bool) -> None:  # fmt: skip
        self.inner, self.options, self.world, self.leaves = name, options, world, leaves
        self.backend, self.warmup = backend, warmup
        self.name = f"{name}-tp{world}"

    def stock_twin(self, model, device) -> None:
        return None  # the stock side runs unsharded

    def unavailable(self, device: torch.device) -> str | None:
        why = engines.create(self.inner, self.options).unavailable(device)
        if why is None and device.type == "cuda" and torch.cuda.device_count() < self.world:
            why = f"TP={self.world} needs {self.world} GPUs, found {torch.cuda.device_count()}"
        return why

    def generate(self, model, prompts, new_tokens, seeds, *, temperature=1.0, top_k=0,
                 top_p=1.0, eos_token_id=None, progress=None) -> RolloutResult:  # fmt: skip
        p = next(model.parameters())
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
        with _weights_file(model) as weights:
            ro = spawn(rollout_worker, self.world, p.device.type, model.config, weights, p.dtype,
                       self.leaves, self.inner, self.options, prompts, new_tokens, seeds, kw,
                       self.warmup, backend=self.backend)  # fmt: skip
        for smp in ro.samples:
            smp.logprobs = smp.logprobs.to(p.device)
        return ro


class TransformersTP:
    """The transformers + rlk training recompute at tensor parallelism ``world``
    (vocabulary-parallel ``linear_logprobs``). Usable as
    :func:`rlk_integrations.tools.consistency.run_side`'s ``recompute``."""

    def __init__(self, model, world: int, leaves: int | None, backend: str | None, warmup: bool):
        self.model, self.world, self.leaves = model, world, leaves
        self.backend, self.warmup = backend, warmup
        self.engine = f"transformers-tp{world}"

    def __call__(self, samples, groups, temperature, logits_dtype):
        p = next(self.model.parameters())
        samples = [dataclasses.replace(s, logprobs=s.logprobs.detach().cpu()) for s in samples]
        with _weights_file(self.model) as weights:
            lps, seconds = spawn(train_worker, self.world, p.device.type, self.model.config,
                                 weights, p.dtype, self.leaves, samples, groups, temperature,
                                 logits_dtype, self.warmup, backend=self.backend)  # fmt: skip
        return [lp.to(p.device) for lp in lps], seconds


__all__ = [
    "TPRollout",
    "TransformersTP",
    "build_sharded",
    "rollout_worker",
    "save_weights",
    "spawn",
    "train_worker",
]
