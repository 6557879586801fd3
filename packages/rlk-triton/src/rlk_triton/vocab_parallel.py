"""Vocabulary-parallel log-probabilities: ``linear_logprobs`` with the lm_head split over ranks.

The optional op behind ``rlk.parallel.vocab_parallel_linear_logprobs``. The log-sum-exp of
``linear_logprobs`` is a fixed tree over :data:`~rlk_triton.logprobs.VOCAB_LEAVES` vocabulary
leaves; a rank holding ``V / t`` contiguous rows of the lm_head (V a multiple of the leaves,
t a power of two dividing them) holds a subtree. So each rank merges its own leaves
(``fused_logprobs.linear_leaf_states``), the ranks' ``(max, sum-exp, entropy term, target
logit)`` are gathered, and every rank merges the top of the tree: the bits of
``linear_logprobs`` on the full lm_head.

Backward: dW and dbias are the rank's rows (local). dHidden sums over the vocabulary, which the
ranks split: each rank's fp32 subtree value goes to ``exchange.reduce``, which tops the tree
over the ranks and rounds once to hidden's dtype.

Communication belongs to the caller: ``exchange`` (built by ``rlk.parallel``) has ``rank``,
``world``, ``gather(t)`` (every rank's ``t``, in rank order) and ``reduce(fp32 subtree, bias,
dtype)``. This module runs kernels and torch ops only.
"""

from __future__ import annotations

from typing import Any

import torch

from rlk_triton import fused_logprobs as fl
from rlk_triton import logprobs as lp_mod
from rlk_triton import tuning


def check_split(vocab: int, world: int) -> None:
    """ValueError unless ``world`` ranks (a power of two dividing the vocabulary leaves) can
    split a ``vocab``-row lm_head along leaf boundaries (``vocab`` a multiple of the leaves)."""
    leaves = lp_mod.VOCAB_LEAVES
    if world & (world - 1) or leaves % world:
        raise ValueError(
            f"leaves = {leaves} must be a multiple of the tensor-parallel group size {world}, "
            "which must be a power of two"
        )
    if vocab % leaves:
        raise ValueError(
            f"the vocabulary V = {vocab} ({world} ranks x {vocab // world} rows) must be a "
            f"multiple of {leaves} (the vocabulary leaves; pad the lm_head as Megatron does)"
        )


class VocabParallelLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, entropy, logits_dtype,
                exchange, table):  # fmt: skip
        v_local, world = weight.shape[0], exchange.world
        vocab, offset = v_local * world, v_local * exchange.rank
        m, s, t, zt = fl.linear_leaf_states(
            hidden, weight, targets, bias, temperature, entropy, logits_dtype, table, vocab, offset
        )
        # Deterministic merge: gather every rank's subtree triple (and its target logit, which
        # only the owner of the target holds), then the top of the leaf tree on every rank.
        triple = torch.stack([m, s, t if entropy else s, zt], 0)
        parts = torch.stack(exchange.gather(triple), 2)  # [4, T, world]
        owner = (targets // v_local).clamp_(0, world - 1)
        zt = parts[3].gather(1, owner[:, None])[:, 0]
        lp, lse, ent = lp_mod.merge_states(
            parts[0].contiguous(),
            parts[1].contiguous(),
            parts[2].contiguous() if entropy else None,
            zt,
            final=True,
        )
        ctx.save_for_backward(hidden, weight, targets, bias, lse, ent)
        ctx.args = (temperature, entropy, logits_dtype, vocab, offset, exchange, table)
        return (lp, ent) if entropy else lp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        hidden, weight, targets, bias, lse, ent = ctx.saved_tensors
        temperature, entropy, logits_dtype, vocab, offset, exchange, table = ctx.args
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        if entropy:
            g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        else:
            ent = g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[3]
        dh, dw, db = fl.backward(
            hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype,
            table, need_h, need_w, need_b, torch.float32, vocab, offset,
        )  # fmt: skip
        if need_h:
            # hidden is replicated; its gradient sums over the vocabulary, which the ranks
            # split: this rank's subtree of the leaf tree, the top of the tree after a gather.
            dh = exchange.reduce(dh, None, hidden.dtype)
        return dh, dw, None, db, None, None, None, None, None


def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    return_entropy: bool,
    logits_dtype: torch.dtype,
    *,
    exchange: Any,
    table: tuning.TuningTable,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``linear_logprobs`` of the full lm_head, from this rank's rows of it.

    Shapes: ``hidden [T, H]`` and ``targets`` int64 ``[T]`` (ids in the whole vocabulary of
    ``V = world * V_r``) replicated, ``weight [V_r, H]`` the rows ``rank*V_r .. (rank+1)*V_r``
    of the lm_head, ``bias [V_r]`` the same slice or None -> float32 ``[T]`` log-probabilities
    (and entropy), bitwise equal to ``linear_logprobs`` of the full lm_head on one device.
    ``exchange``: the ranks' ``rank``, ``world``, ``gather`` and ``reduce`` (see the module).

    Example::

        lp = vocab_parallel_linear_logprobs(h, w_rows, tokens, None, 1.0, False, h.dtype,
                                            exchange=ex, table=backend.default_table())
    """
    check_split(weight.shape[0] * exchange.world, exchange.world)
    return VocabParallelLogprobsFunction.apply(
        hidden, weight, targets, bias, temperature, return_entropy, logits_dtype, exchange, table
    )
