"""Training side: recompute the rollout's log-probabilities in packed micro-batches.

A micro-batch packs whole sequences (prompt + response) into one ``[1, T]`` row whose
``position_ids`` restart at 0 for each sequence (no padding). With a model patched by
:func:`rlk_integrations.transformers.patch_model`, the decoder runs on rlk ops and the
log-probabilities come from :func:`rlk.linear_logprobs` on the final hidden states and the
``lm_head`` weight, so they equal the rollout's bit for bit whatever the micro-batch composition.
The stock path (``use_rlk=False``) takes ``model(...).logits`` and an fp32 ``log_softmax``.
"""

from __future__ import annotations

import types
from typing import Any

import torch

import rlk
from rlk_integrations.rollout import Sample


def micro_batches(n: int, size: int, order: list[int] | None = None) -> list[list[int]]:
    """Split sample indices (in ``order``, default ``0..n-1``) into groups of ``size``."""
    order = list(range(n)) if order is None else list(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _pack(samples: list[Sample], device: torch.device):
    ids, pos, rows, targets = [], [], [], []
    offset = 0
    for s in samples:
        toks = s.tokens
        ids += toks
        pos += list(range(len(toks)))
        p = len(s.prompt)
        # The hidden state at position j predicts the token at j + 1.
        rows += range(offset + p - 1, offset + len(toks) - 1)
        targets += s.response
        offset += len(toks)
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return as_long(ids)[None], as_long(pos)[None], as_long(rows), as_long(targets)


def _rlk_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    logits_dtype: torch.dtype | None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The packed rows' hidden states from the decoder, then ``rlk.linear_logprobs`` with the
    ``lm_head`` weight: ``[len(rows)]`` float32 (and the rows' entropies with
    ``return_entropy``)."""
    from rlk_integrations.transformers import decoder

    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state.squeeze(0)  # one packed row (a view's gradient: no copy)
    head = model.get_output_embeddings()
    tp = getattr(model, "_rlk_tp", None)
    fn, extra = rlk.linear_logprobs, {}
    if tp is not None:  # rlk_integrations.tp: this rank holds a vocabulary slice of lm_head
        from rlk.parallel import vocab_parallel_linear_logprobs

        fn, extra = vocab_parallel_linear_logprobs, {"group": tp[2]}
    return fn(
        hidden.index_select(0, rows),
        head.weight,
        targets,
        bias=head.bias,
        temperature=temperature,
        return_entropy=return_entropy,
        logits_dtype=logits_dtype,
        **extra,
    )


def packed_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    *,
    temperature: float = 1.0,
    use_rlk: bool = True,
    logits_dtype: torch.dtype | None = None,
    return_entropy: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probabilities of each sample's response tokens from one packed forward.

    Returns one float32 tensor ``[len(response)]`` per sample (differentiable when grad is on);
    with ``return_entropy`` (rlk only) a pair of such lists: the log-probabilities and the
    entropies of the tempered distributions that gave them.
    ``logits_dtype``: the dtype the rollout's logits had (default: the model's dtype).
    """
    if return_entropy and not use_rlk:
        raise ValueError("return_entropy=True needs use_rlk=True")
    device = next(model.parameters()).device
    ids, pos, rows, targets = _pack(samples, device)
    temperature = temperature if temperature > 0 else 1.0
    sizes = [len(s.response) for s in samples]
    if use_rlk:
        # A model sharded by shard_model runs this as an FSDP forward method (its root
        # parameters gathered around it); an unsharded model runs the same function directly.
        forward = getattr(model, FSDP_FORWARD, None) or types.MethodType(_rlk_logprobs, model)
        out = forward(ids, pos, rows, targets, temperature, logits_dtype, return_entropy)
        lp, entropy = out if return_entropy else (out, None)
        if hasattr(model, FSDP_FORWARD) and not lp.requires_grad:
            # FSDP2 keeps the root's parameters gathered after its forward, for the backward;
            # without one coming, shard them again (else model.parameters() are the gathered
            # tensors, and an optimizer built from them would miss the sharded ones).
            model.reshard()
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logp = torch.log_softmax(logits.index_select(0, rows).float() / temperature, dim=-1)
        lp, entropy = logp.gather(1, targets[:, None]).reshape(-1), None
    if entropy is not None:
        return list(lp.split(sizes)), list(entropy.split(sizes))
    return list(lp.split(sizes))


def recompute_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    micro_batch_size: int,
    *,
    order: list[int] | None = None,
    temperature: float = 1.0,
    use_rlk: bool = True,
    logits_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """:func:`packed_logprobs` over micro-batches of ``micro_batch_size`` samples taken in
    ``order``; returns the per-sample tensors in the samples' original order."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for group in micro_batches(len(samples), micro_batch_size, order):
        lps = packed_logprobs(
            model,
            [samples[i] for i in group],
            temperature=temperature,
            use_rlk=use_rlk,
            logits_dtype=logits_dtype,
        )
        for i, lp in zip(group, lps):
            out[i] = lp
    return out  # type: ignore[return-value]


def pad_rows(
    rows: list[torch.Tensor], width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D tensors into ``[B, L]`` (zero padded) and a bool mask of the real entries."""
    width = max((r.numel() for r in rows), default=0) if width is None else width
    out = torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.numel())) for r in rows])
    idx = torch.arange(width, device=out.device)
    mask = torch.stack([idx < r.numel() for r in rows])
    return out, mask


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: torch.Tensor,
    group_size: int,
    micro_batch_size: int,
    *,
    order: list[int] | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """One GRPO update on rlk: recompute log-probs in packed micro-batches (with grad),
    ``grpo_advantages`` per group, ``policy_loss`` against the rollout's log-probs, backward,
    optimizer step. Gradients of the micro-batches are accumulated (each scaled by its share of
    the tokens, so the sum is the token mean over the whole batch).

    Returns ``loss``, ``max_abs_dlogp`` (rollout vs the recompute, 0 with rlk) and metrics.
    """
    device = next(model.parameters()).device
    adv_all = rlk.grpo_advantages(
        rewards.to(device=device, dtype=torch.float32).contiguous(), group_size
    )
    total_tokens = sum(len(s.response) for s in samples)
    optimizer.zero_grad(set_to_none=True)
    max_d, loss_sum = 0.0, 0.0
    width = max(len(s.response) for s in samples)
    for group in micro_batches(len(samples), micro_batch_size, order):
        batch = [samples[i] for i in group]
        new = packed_logprobs(model, batch, temperature=temperature, logits_dtype=logits_dtype)
        new_p, mask = pad_rows(new, width)
        old_p, _ = pad_rows([s.logprobs.to(device) for s in batch], width)
        max_d = max(max_d, float(((new_p.detach() - old_p).abs() * mask).max()))
        loss, _ = rlk.policy_loss(new_p, old_p, adv_all[group], mask, agg="token-mean")
        share = int(mask.sum()) / max(total_tokens, 1)
        (loss * share).backward()
        loss_sum += float(loss.detach()) * share
    optimizer.step()
    return {"loss": loss_sum, "max_abs_dlogp": max_d}


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------

# The name under which shard_model registers the packed log-prob forward on the root module.
FSDP_FORWARD = "_rlk_fsdp_logprobs"


def shard_model(model: torch.nn.Module, **fsdp_kwargs: Any) -> torch.nn.Module:
    """Shard a (patched) causal LM with FSDP2 for data-parallel training; in place, returns it.

    Calls ``torch.distributed.fsdp.fully_shard`` on each decoder layer, then on the root (the
    embeddings, final norm and ``lm_head``, tied or not, are the root's group), passing
    ``fsdp_kwargs`` (``mesh``, ``reshard_after_forward``, ``mp_policy``, ...) to every call. It
    needs an initialised process group; apply :func:`~rlk_integrations.transformers.patch_model`
    first. Then :func:`packed_logprobs`, :func:`recompute_logprobs` and
    :func:`grpo_step` work unchanged on each rank's own samples.

    FSDP2 gathers a group's parameters into plain contiguous tensors before its forward, so the
    rlk ops see the same weights as on one device: a sequence's log-probs are the same bits as
    unsharded (the model's ``model.model(...)`` + ``lm_head`` path is registered as a FSDP
    forward method of the root, so the root's parameters are gathered around it). Gradients are
    reduce-scattered and averaged over the ranks by the collective, in its own summation order:
    deterministic for a fixed world size and collective, but not bitwise the one-device sum.
    ``grpo_step`` scales each rank's loss to its own token mean, so the update is the global
    token mean when every rank holds the same number of response tokens.

    ``mp_policy`` with a ``param_dtype`` casts the gathered weights: the log-probs are then those
    of a rollout engine that holds the weights in that dtype.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from rlk_integrations.transformers import decoder

    for layer in decoder(model).layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    setattr(model, FSDP_FORWARD, types.MethodType(_rlk_logprobs, model))
    register_fsdp_forward_method(model, FSDP_FORWARD)
    return model
