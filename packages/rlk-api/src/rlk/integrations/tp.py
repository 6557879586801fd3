"""Tensor parallelism for the transformers integration, with the bits of one device.

:func:`shard_tp` turns a model patched by
:func:`rlk.integrations.transformers.patch_model` with ``leaves`` into rank ``r`` of a
tensor-parallel group of ``t`` ranks (Megatron's layout, in place):

- ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``: column-parallel (the rank's
  heads / intermediate rows), :func:`rlk.parallel.column_parallel_linear`;
- ``o_proj``/``down_proj``: row-parallel, :func:`rlk.parallel.row_parallel_linear` (K reduced
  by the tree of ``leaves`` whatever ``t``: the bits of ``tree_linear`` on one device);
- ``lm_head``: vocabulary-parallel. ``model(...)`` gathers the full logits (each rank's
  vocabulary slice is that of ``rlk.linear``: the rollout samples from the one-device logits),
  and the training recompute (:func:`rlk.integrations.training.packed_logprobs`) uses
  :func:`rlk.parallel.vocab_parallel_linear_logprobs` on the rank's slice;
- embeddings and norms stay replicated; a tied lm_head is untied (its slice is a copy).

So a rollout or a training recompute at any power-of-two ``t`` dividing ``leaves`` (and the
heads) produces the log-probabilities of the same model at ``t = 1``, bit for bit.
``stock_allreduce=True`` builds the usual non-invariant layout instead (``rlk.linear`` on each
rank's slice, an all-reduce of the row-parallel outputs and of column-parallel input
gradients): the baseline for the cost of the tree (``benchmarks/bench_tp.py``).

:func:`spawn` runs a function in ``t`` processes (gloo on CPU, NCCL on GPUs, rank ``r`` on
``cuda:r``) and returns rank 0's result; ``rlk consistency --rollout-tp/--train-tp`` use it
through :func:`rollout_worker` and :func:`train_worker`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import types
from typing import Any

import torch
from torch import nn

import rlk

COLUMN_LINEARS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_LINEARS = ("o_proj", "down_proj")


# --------------------------------------------------------------------------------------------
# Sharded module forwards
# --------------------------------------------------------------------------------------------


def _column_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    import rlk.parallel as P

    rank, world, group, leaves = self._rlk_tp
    return P.column_parallel_linear(x.contiguous(), self.weight, self.bias, leaves=leaves,
                                    group=group)  # fmt: skip


def _row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    import rlk.parallel as P

    rank, world, group, leaves = self._rlk_tp
    return P.row_parallel_linear(x.contiguous(), self.weight, self.bias, leaves=leaves,
                                 group=group)  # fmt: skip


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    import rlk.parallel as P

    rank, world, group, leaves = self._rlk_tp
    return P.column_parallel_linear(x.contiguous(), self.weight, self.bias, leaves=leaves,
                                    gather_output=True, group=group)  # fmt: skip


class _ReduceGrad(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceOut(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, y, group):
        import torch.distributed as dist

        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def _stock_column_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x = _ReduceGrad.apply(x.contiguous(), self._rlk_tp[2])
    return rlk.linear(x, self.weight, self.bias)


def _stock_row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = _ReduceOut.apply(rlk.linear(x.contiguous(), self.weight), self._rlk_tp[2])
    return y if self.bias is None else y + self.bias


def _stock_head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    import rlk.parallel as P

    rank, world, group, _ = self._rlk_tp
    y = rlk.linear(_ReduceGrad.apply(x.contiguous(), group), self.weight, self.bias)
    return P._GatherColumns.apply(y.reshape(-1, y.shape[-1]), rank, world, group).reshape(
        *y.shape[:-1], -1
    )


# --------------------------------------------------------------------------------------------
# Sharding a patched model
# --------------------------------------------------------------------------------------------


def _shard_param(module: nn.Module, name: str, dim: int, rank: int, world: int) -> None:
    import rlk.parallel as P

    p = getattr(module, name)
    if p is None:
        return
    setattr(module, name, nn.Parameter(P.shard(p.data, dim, rank=rank, world_size=world),
                                       requires_grad=p.requires_grad))  # fmt: skip


def shard_tp(model: nn.Module, *, group: Any = None, stock_allreduce: bool = False) -> nn.Module:
    """Make ``model`` (patched by ``patch_model(model, leaves=L)``) this process's rank of the
    tensor-parallel group ``group`` (default: the world), in place. The group size t must be a
    power of two dividing L, the attention and key/value heads, the intermediate size and the
    vocabulary. Returns ``model``.

    Example (in each of 2 processes of an initialised process group)::

        patch_model(model, leaves=8)
        shard_tp(model)
        out = rlk.integrations.rollout.generate(model, prompts, 64)  # the bits of 1 GPU
    """
    import rlk.parallel as P
    from rlk.integrations.transformers import decoder, is_patched

    leaves = getattr(model, "_rlk_leaves", None)
    if not is_patched(model) or not leaves:
        raise ValueError("shard_tp needs a model patched by patch_model(model, leaves=L)")
    if getattr(model, "_rlk_tp", None) is not None:
        raise ValueError("model is already sharded")
    rank, world = P._group_info(group)
    P._tp_leaves(leaves, world)
    cfg = model.config
    for what, n in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ):
        if n % world:
            raise ValueError(f"the TP size {world} must divide {what} = {n}")
    head = model.get_output_embeddings()
    state = (rank, world, group, leaves)
    col, row, hd = (
        (_stock_column_forward, _stock_row_forward, _stock_head_forward)
        if stock_allreduce
        else (_column_forward, _row_forward, _head_forward)
    )
    for path, module in decoder(model).named_modules():
        if not isinstance(module, nn.Linear):
            continue
        short = path.rsplit(".", 1)[-1]
        if short in COLUMN_LINEARS:
            _shard_param(module, "weight", 0, rank, world)
            _shard_param(module, "bias", 0, rank, world)
            fn = col
        elif short in ROW_LINEARS:
            _shard_param(module, "weight", 1, rank, world)
            fn = row
        else:
            raise NotImplementedError(f"shard_tp: no tensor-parallel layout for {path}")
        module._rlk_tp = state
        module.forward = types.MethodType(fn, module)
    if head is not None:
        _shard_param(head, "weight", 0, rank, world)
        _shard_param(head, "bias", 0, rank, world)
        head._rlk_tp = state
        head.forward = types.MethodType(hd, head)
    model._rlk_tp = state
    model._rlk_tp_stock = stock_allreduce
    return model


def local_kv_heads(model: nn.Module) -> int:
    """Key/value heads held by this rank (all of them without :func:`shard_tp`)."""
    tp = getattr(model, "_rlk_tp", None)
    return model.config.num_key_value_heads // (tp[1] if tp else 1)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def _entry(rank, world, init_file, out, device_type, backend, fn, args):
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
    )
    try:
        with rlk.use_backend(backend) if backend else contextlib.nullcontext():
            result = fn(rank, world, device, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def spawn(fn: Any, world: int, device_type: str, *args: Any, backend: str | None = None) -> Any:
    """Run ``fn(rank, world, device, *args)`` in ``world`` new processes (gloo on CPU; NCCL on
    CUDA with rank r on ``cuda:r``) under ``rlk.use_backend(backend)``; returns rank 0's result.
    ``fn`` must be importable (a module-level function) and return tensors, plain Python data or
    rollout records (the result comes back through ``torch.load(weights_only=True)``)."""
    import torch.multiprocessing as mp

    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(
            f"TP={world} on CUDA needs {world} GPUs, found {torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory(prefix="rlk-tp-") as tmp:
        out = os.path.join(tmp, "out.pt")
        args = (world, os.path.join(tmp, "rendezvous"), out, device_type, backend, fn, args)
        mp.spawn(_entry, args=args, nprocs=world, join=True)
        # weights_only: tensors and plain data only, plus the rollout's records by name
        # (add_safe_globals, unlike the safe_globals context manager, exists since torch 2.4).
        from rlk.integrations.rollout import RolloutResult, Sample

        torch.serialization.add_safe_globals([RolloutResult, Sample])
        return torch.load(out, weights_only=True)


def build_sharded(config, weights: str, dtype, device, leaves: int, stock_allreduce=False):
    """This rank's model: built from ``config``, the weights of the file ``weights`` (a full
    state dict), patched with ``leaves`` and sharded over the default process group."""
    from transformers import AutoModelForCausalLM

    from rlk.integrations.transformers import patch_model

    with torch.device(device):
        # (patch_model sets the attention; the pickled config may carry it already)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    patch_model(model, leaves=leaves)
    return shard_tp(model, stock_allreduce=stock_allreduce)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout_worker(rank, world, device, config, weights, dtype, leaves, mode, prompts,
                   new_tokens, kw, warmup):  # fmt: skip
    """A rank of a TP rollout: returns the :class:`~rlk.integrations.rollout.RolloutResult`
    (samples on the CPU). ``mode``: ``padded`` or ``paged``; ``kw``: the rollout's keywords."""
    from rlk.integrations import paged, rollout

    model = build_sharded(config, weights, dtype, device, leaves)

    def go(n):
        if mode == "paged":
            return paged.generate_paged(model, prompts, n, **kw)
        return rollout.generate(model, prompts, n, sampler="rlk", **kw)

    if warmup:
        go(2)
    ro = go(new_tokens)
    for s in ro.samples:
        s.logprobs = s.logprobs.cpu()
    return ro


def train_worker(rank, world, device, config, weights, dtype, leaves, samples, groups,
                 temperature, logits_dtype, warmup, stock_allreduce=False):  # fmt: skip
    """A rank of a TP training recompute (forward + backward per packed micro-batch):
    returns ``(log-probs per sample, seconds)``."""
    from rlk.integrations import training

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


__all__ = [
    "build_sharded",
    "local_kv_heads",
    "rollout_worker",
    "save_weights",
    "shard_tp",
    "spawn",
    "train_worker",
]
