"""Training side: recompute the rollout's log-probabilities in packed micro-batches, and the
GRPO and PPO updates on them (:func:`grpo_step`, :func:`ppo_step`).

A micro-batch packs whole sequences (prompt + response) into one ``[1, T]`` row whose
``position_ids`` restart at 0 for each sequence (no padding). With a model patched by
:func:`rlk_integrations.models.transformers.patch_model`, the decoder runs on rlk ops and the
log-probabilities come from :func:`rlk.linear_logprobs` on the final hidden states and the
``lm_head`` weight, so they equal the rollout's bit for bit whatever the micro-batch composition.
The stock path (``use_rlk=False``) takes ``model(...).logits`` and an fp32 ``log_softmax``.

The packed layout is :mod:`rlk_integrations.engine.packing`'s; the same recompute replayed as
CUDA graphs is :class:`rlk_integrations.engine.graphed.GraphedLogprobs`. Both modules' public
names are importable from here too.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

import rlk
from rlk.parallel import vocab_parallel_linear_logprobs
from rlk_integrations.engine.critic import ValueHead
from rlk_integrations.engine.engines import Sample, logprob_temperature
from rlk_integrations.engine.graphed import GraphedLogprobs, bucket_of  # noqa: F401  (public)
from rlk_integrations.engine.packing import (
    FSDP_FORWARD,
    _pack_lists,
    micro_batches,
    pack_samples,
    pad_rows,
)
from rlk_integrations.models.transformers import decoder, is_patched


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
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state.squeeze(0)  # one packed row (a view's gradient: no copy)
    head = model.get_output_embeddings()
    tp = getattr(model, "_rlk_tp", None)
    fn, extra = rlk.linear_logprobs, {}
    if tp is not None:  # rlk_integrations.models.tp: this rank holds a vocabulary slice of lm_head
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
    ids, pos, rows, targets = pack_samples(samples, device)
    temperature = logprob_temperature(temperature)
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


def compiled_logprobs(
    model: torch.nn.Module,
    *,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
    **compile_kwargs: Any,
):
    """:func:`packed_logprobs`' rlk pass under ``torch.compile(fullgraph=True)`` (and
    ``compile_kwargs``, e.g. ``mode="reduce-overhead"`` for CUDA graphs): returns a function
    ``samples -> [len(response)] float32 per sample``, differentiable, bitwise the eager pass.

    The packed offsets and the longest sequence go to attention (``cu_seq_lens_q/k``,
    ``max_length_q/k``), so the compiled graph reads nothing on the host; the rotary table is
    extended to the longest sequence before each call, outside the graph. ``model`` is a model
    patched by :func:`rlk_integrations.models.transformers.patch_model`.
    """
    base = decoder(model)

    def packed(ids, pos, cu, rows, targets, longest):
        hidden = base(
            input_ids=ids,
            position_ids=pos,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
            use_cache=False,
        ).last_hidden_state.squeeze(0)
        head = model.get_output_embeddings()
        return rlk.linear_logprobs(
            hidden.index_select(0, rows),
            head.weight,
            targets,
            bias=head.bias,
            temperature=logprob_temperature(temperature),
            logits_dtype=logits_dtype,
        )

    compiled = torch.compile(packed, fullgraph=True, **compile_kwargs)

    def run(samples: list[Sample]) -> list[torch.Tensor]:
        device = next(model.parameters()).device
        ids, pos, cu, rows, targets = _pack_lists(samples)
        longest = max(len(s.tokens) for s in samples)
        base.rotary_emb._rlk_table.reserve(longest)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        lp = compiled(
            as_long(ids)[None],
            as_long(pos)[None],
            torch.tensor(cu, dtype=torch.int32, device=device),
            as_long(rows),
            as_long(targets),
            longest,
        )
        return list(lp.split([len(s.response) for s in samples]))

    return run


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
    graphed: GraphedLogprobs | None = None,
) -> dict[str, float]:
    """One GRPO update on rlk: recompute log-probs in packed micro-batches (with grad),
    ``grpo_advantages`` per group, ``policy_loss`` against the rollout's log-probs, backward,
    optimizer step. Gradients of the micro-batches are accumulated (each scaled by its share of
    the tokens, so the sum is the token mean over the whole batch).

    ``graphed``: a :class:`GraphedLogprobs` of ``model`` (built with the same ``temperature``
    and ``logits_dtype``) that recomputes each micro-batch, its bucket holding one; the same
    bits, replayed as CUDA graphs.

    Returns ``loss``, ``max_abs_dlogp`` (rollout vs the recompute, 0 with rlk) and metrics.
    """
    if graphed is not None:
        if graphed.model is not model:
            raise ValueError("graphed is built on another model")
        if graphed.entropy:
            raise ValueError(
                "graphed returns entropies (return_entropy=True); grpo_step's does not"
            )
        # logits_dtype None is the hidden states' dtype: lm_head's.
        head_dtype = model.get_output_embeddings().weight.dtype
        have = (graphed.temperature, graphed.logits_dtype or head_dtype)
        want = (logprob_temperature(temperature), logits_dtype or head_dtype)
        if have != want:
            raise ValueError(
                f"graphed has temperature {have[0]} and logits_dtype {have[1]}; "
                f"this step asks for {want[0]} and {want[1]}"
            )
        recompute = graphed
    else:

        def recompute(batch: list[Sample]) -> list[torch.Tensor]:
            return packed_logprobs(model, batch, temperature=temperature, logits_dtype=logits_dtype)

    device = next(model.parameters()).device
    stats, _ = grpo_update(
        recompute, optimizer, samples, rewards, group_size, micro_batch_size, order=order,
        device=device,
    )  # fmt: skip
    return stats


def grpo_update(
    recompute: Callable[[list[Sample]], list[torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: torch.Tensor,
    group_size: int,
    micro_batch_size: int,
    *,
    order: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """:func:`grpo_step`'s update with any trainer: ``recompute(batch)`` gives the float32
    ``[len(response)]`` log-probabilities (with grad) of a micro-batch of samples on
    ``device`` (the transformers model's :func:`packed_logprobs`, Megatron's
    ``rlk_integrations.adapters.megatron.packed_logprobs``). Per micro-batch: GRPO advantages
    of ``rewards`` (float ``[len(samples)]``, groups of ``group_size`` consecutive samples),
    :func:`rlk.policy_loss` against the rollout's ``Sample.logprobs``, backward scaled by the
    micro-batch's share of the tokens; then one ``optimizer.step()``.

    Returns ``({"loss", "max_abs_dlogp"}, the recomputed log-probabilities per sample, detached,
    in the samples' order)``."""
    adv_all = rlk.grpo_advantages(
        rewards.to(device=device, dtype=torch.float32).contiguous(), group_size
    )
    total_tokens = sum(len(s.response) for s in samples)
    optimizer.zero_grad(set_to_none=True)
    max_d, loss_sum = 0.0, 0.0
    width = max(len(s.response) for s in samples)
    out: list[torch.Tensor | None] = [None] * len(samples)
    for group in micro_batches(len(samples), micro_batch_size, order):
        batch = [samples[i] for i in group]
        lps = recompute(batch)
        for i, lp in zip(group, lps):
            out[i] = lp.detach()
        new_p, mask = pad_rows(lps, width)
        old_p, _ = pad_rows([s.logprobs.to(device) for s in batch], width)
        max_d = max(max_d, float(((new_p.detach() - old_p).abs() * mask).max()))
        loss, _ = rlk.policy_loss(new_p, old_p, adv_all[group], mask, agg="token-mean")
        share = int(mask.sum()) / max(total_tokens, 1)
        (loss * share).backward()
        loss_sum += float(loss.detach()) * share
    optimizer.step()
    return {"loss": loss_sum, "max_abs_dlogp": max_d}, out  # type: ignore[return-value]


def packed_logprobs_and_values(
    model: torch.nn.Module,
    samples: list[Sample],
    *,
    value_head: ValueHead | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sample's response log-probabilities and values from one packed forward (rlk):
    two lists of float32 ``[len(response)]`` tensors, differentiable when grad is on.
    ``value_head`` defaults to ``model.rlk_value_head``. An unsharded model only (no TP, no
    FSDP)."""
    if not is_patched(model):
        raise ValueError("the model is not patched by rlk: patch_model(model) first")
    if getattr(model, "_rlk_tp", None) is not None or hasattr(model, FSDP_FORWARD):
        raise ValueError("packed_logprobs_and_values takes an unsharded model (no TP, no FSDP)")
    head = getattr(model, "rlk_value_head", None) if value_head is None else value_head
    if head is None:
        raise ValueError("no value head: pass value_head or add_value_head(model) first")
    ids, pos, rows, targets = pack_samples(samples, next(model.parameters()).device)
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state.squeeze(0).index_select(0, rows)
    lm_head = model.get_output_embeddings()
    lp = rlk.linear_logprobs(
        hidden,
        lm_head.weight,
        targets,
        bias=lm_head.bias,
        temperature=logprob_temperature(temperature),
        logits_dtype=logits_dtype,
    )
    sizes = [len(s.response) for s in samples]
    return list(lp.split(sizes)), list(head(hidden).split(sizes))


def ppo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: torch.Tensor,
    micro_batch_size: int,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip: float = 0.2,
    value_clip: float | None = 0.5,
    value_coef: float = 0.5,
    epochs: int = 1,
    order: list[int] | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """One PPO update on rlk, with a critic that is a value head on ``model``
    (:func:`rlk_integrations.engine.critic.add_value_head`) and samples from
    ``rollout.generate(..., value_head=model.rlk_value_head)``.

    ``rewards [N]``: one outcome reward per sample, put on its response's last token (verl's
    token-level rewards of an outcome reward). :func:`rlk.gae_advantages` turns them and the
    rollout's values into whitened advantages and returns, once, over the whole batch. Then
    ``epochs`` times: recompute log-probabilities and values in packed micro-batches of
    ``micro_batch_size`` samples taken in ``order`` (with grad), ``rlk.policy_loss`` (the ratio
    to the rollout's log-probabilities clipped to ``1 -/+ clip``) plus ``value_coef`` times
    ``rlk.value_loss`` (clipped at ``value_clip`` around the rollout's values), both token
    means over the whole batch (``num_tokens``: the micro-batches' losses add up to the
    batch's), backward, one optimizer step per epoch.

    Returns ``loss``, ``policy_loss``, ``value_loss`` and ``value_clip_fraction`` of the first
    epoch, and ``max_abs_dlogp`` / ``max_abs_dvalue``: rollout vs the first epoch's recompute
    (0 with rlk: the first ratio is exactly 1, the critic's old values are its values).
    """
    if any(s.values is None for s in samples):
        raise ValueError("every sample needs its rollout values: generate(..., value_head=)")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    if tuple(rewards.shape) != (len(samples),):
        raise ValueError(f"rewards must be [N] = [{len(samples)}], got {tuple(rewards.shape)}")
    device = next(model.parameters()).device
    width = max(len(s.response) for s in samples)
    old_v, mask = pad_rows([s.values.to(device) for s in samples], width)
    old_p, _ = pad_rows([s.logprobs.to(device) for s in samples], width)
    token_r = torch.zeros_like(old_v)
    for i, s in enumerate(samples):
        if s.response:
            token_r[i, len(s.response) - 1] = rewards[i].float()
    adv, ret = rlk.gae_advantages(token_r, old_v, mask, gamma=gamma, lam=lam)
    total = float(max(int(mask.sum()), 1))
    first: dict[str, float] = {}
    for epoch in range(epochs):
        optimizer.zero_grad(set_to_none=True)
        out = dict.fromkeys(("loss", "policy_loss", "value_loss", "value_clip_fraction"), 0.0)
        max_p = max_v = 0.0
        for group in micro_batches(len(samples), micro_batch_size, order):
            lps, vals = packed_logprobs_and_values(
                model, [samples[i] for i in group], temperature=temperature,
                logits_dtype=logits_dtype,
            )  # fmt: skip
            new_p, m = pad_rows(lps, width)
            new_v, _ = pad_rows(vals, width)
            max_p = max(max_p, float(((new_p.detach() - old_p[group]).abs() * m).max()))
            max_v = max(max_v, float(((new_v.detach() - old_v[group]).abs() * m).max()))
            pg, _ = rlk.policy_loss(new_p, old_p[group], adv[group], m, clip_low=clip,
                                    clip_high=clip, num_tokens=total)  # fmt: skip
            vf, vm = rlk.value_loss(new_v, old_v[group], ret[group], m, clip=value_clip,
                                    num_tokens=total)  # fmt: skip
            loss = pg + value_coef * vf
            loss.backward()
            share = float(m.sum()) / total
            for k, v in (("loss", loss), ("policy_loss", pg), ("value_loss", vf)):
                out[k] += float(v.detach())
            out["value_clip_fraction"] += float(vm["clip_fraction"]) * share
        optimizer.step()
        if epoch == 0:
            first = {**out, "max_abs_dlogp": max_p, "max_abs_dvalue": max_v}
    return first


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------


def shard_model(model: torch.nn.Module, **fsdp_kwargs: Any) -> torch.nn.Module:
    """Shard a (patched) causal LM with FSDP2 for data-parallel training; in place, returns it.

    Calls ``torch.distributed.fsdp.fully_shard`` on each decoder layer, then on the root (the
    embeddings, final norm and ``lm_head``, tied or not, are the root's group), passing
    ``fsdp_kwargs`` (``mesh``, ``reshard_after_forward``, ``mp_policy``, ...) to every call. It
    needs an initialised process group; apply
    :func:`~rlk_integrations.models.transformers.patch_model` first. Then :func:`packed_logprobs`,
    :func:`recompute_logprobs` and :func:`grpo_step` work unchanged on each rank's own samples.

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

    for layer in decoder(model).layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    setattr(model, FSDP_FORWARD, types.MethodType(_rlk_logprobs, model))
    register_fsdp_forward_method(model, FSDP_FORWARD)
    return model
