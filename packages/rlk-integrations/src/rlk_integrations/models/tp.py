"""Tensor parallelism for the transformers integration, with the bits of one device.

:func:`shard_tp` turns a model patched by
:func:`rlk_integrations.models.transformers.patch_model` with ``leaves`` into rank ``r`` of a
tensor-parallel group of ``t`` ranks (Megatron's layout, in place):

- ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``: column-parallel (the rank's
  heads / intermediate rows), :func:`rlk.parallel.column_parallel_linear`;
- ``o_proj``/``down_proj``: row-parallel, :func:`rlk.parallel.row_parallel_linear` (K reduced
  by the tree of ``leaves`` whatever ``t``: the bits of ``tree_linear`` on one device);
- ``lm_head``: vocabulary-parallel. ``model(...)`` gathers the full logits (each rank's
  vocabulary slice is that of ``rlk.linear``: the rollout samples from the one-device logits),
  and the training recompute (:func:`rlk_integrations.engine.training.packed_logprobs`) uses
  :func:`rlk.parallel.vocab_parallel_linear_logprobs` on the rank's slice;
- embeddings and norms stay replicated; a tied lm_head is untied (its slice is a copy).

So a rollout or a training recompute at any power-of-two ``t`` dividing ``leaves`` (and the
heads) produces the log-probabilities of the same model at ``t = 1``, bit for bit.
``stock_allreduce=True`` builds the usual non-invariant layout instead (``rlk.linear`` on each
rank's slice, an all-reduce of the row-parallel outputs and of column-parallel input
gradients): the baseline for the cost of the tree (``benchmarks/bench_tp.py``).

The processes that run such ranks are :mod:`rlk_integrations.engine.tp_workers`'s.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import rlk
import rlk.parallel as P
from rlk_integrations.models.transformers import decoder, is_patched

COLUMN_LINEARS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_LINEARS = ("o_proj", "down_proj")


# --------------------------------------------------------------------------------------------
# Sharded module forwards
# --------------------------------------------------------------------------------------------


def _column_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rank, world, group, leaves = self._rlk_tp
    return P.column_parallel_linear(x.contiguous(), self.weight, self.bias, leaves=leaves,
                                    group=group)  # fmt: skip


def _row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rank, world, group, leaves = self._rlk_tp
    return P.row_parallel_linear(x.contiguous(), self.weight, self.bias, leaves=leaves,
                                 group=group)  # fmt: skip


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
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
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceOut(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, y, group):
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
    group = self._rlk_tp[2]
    y = rlk.linear(_ReduceGrad.apply(x.contiguous(), group), self.weight, self.bias)
    return P.gather_columns(y, group)


# --------------------------------------------------------------------------------------------
# Sharding a patched model
# --------------------------------------------------------------------------------------------


def _shard_param(module: nn.Module, name: str, dim: int, rank: int, world: int) -> None:
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
        out = rlk_integrations.engine.rollout.generate(model, prompts, 64)  # the bits of 1 GPU
    """
    leaves = getattr(model, "_rlk_leaves", None)
    if not is_patched(model) or not leaves:
        raise ValueError("shard_tp needs a model patched by patch_model(model, leaves=L)")
    if getattr(model, "_rlk_tp", None) is not None:
        raise ValueError("model is already sharded")
    rank, world = P.group_info(group)
    P.check_leaves(leaves, world)
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


__all__ = ["local_kv_heads", "shard_tp"]
