"""Batched generation that records the log-probability of every sampled token.

:func:`generate` runs a left-padded batch of prompts through a transformers causal LM with its
``DynamicCache``: one prefill, then one decode step per new token. With ``sampler="rlk"`` each
token is drawn by :func:`rlk.sample` with the request's own seed and the token's position as
the RNG offset, and its log-probability is :func:`rlk.logprobs` of the same logits, so a
request's tokens and log-probabilities do not depend on the rest of the batch (when the model is
patched with :func:`rlk_integrations.models.transformers.patch_model`). ``sampler="torch"`` is the
stock path: softmax + ``torch.multinomial`` and ``log_softmax`` in fp32.

The other rollout mode, continuous batching on a paged KV cache, is
:func:`rlk_integrations.engine.paged.generate_paged` (rlk only; same samples, same bits).
:class:`PaddedRollout` is :func:`generate` as the rollout engine ``padded`` of
:mod:`rlk_integrations.engine.engines`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import rlk
from rlk_integrations.engine.critic import final_hidden_hook
from rlk_integrations.engine.engines import (
    RolloutOptions,
    RolloutResult,
    Sample,
    logprob_temperature,
)
from rlk_integrations.models.transformers import cache_kwarg


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _sample_torch(logits: torch.Tensor, temperature: float, gen: torch.Generator):
    logp = torch.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    if temperature == 0:
        tok = logp.argmax(-1)
    else:
        tok = torch.multinomial(logp.exp(), 1, generator=gen).reshape(-1)
    return tok, logp.gather(1, tok[:, None]).reshape(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    seeds: list[int] | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    sampler: str = "rlk",
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    progress: Callable[[str], None] | None = None,
    value_head: torch.nn.Module | None = None,
) -> RolloutResult:
    """Sample ``max_new_tokens`` for each prompt in one left-padded batch.

    ``prompts``: token id lists (any lengths). ``seeds[i]`` keys request ``i``'s RNG (default
    ``i``); the token at position ``p`` of a sequence uses RNG offset ``p``. A response stops
    after ``eos_token_id``. ``progress`` gets a line every quarter of the steps.
    ``value_head`` (a :class:`rlk_integrations.engine.critic.ValueHead`): each sample also records
    the head's value of the final hidden state that sampled each response token.
    Returns a :class:`RolloutResult` whose samples hold the response
    tokens and their float32 log-probabilities under ``softmax(logits / temperature)``.
    """
    if sampler not in ("rlk", "torch"):
        raise ValueError(f"sampler must be 'rlk' or 'torch', got {sampler!r}")
    from transformers import DynamicCache

    device = next(model.parameters()).device
    b = len(prompts)
    seeds = list(range(b)) if seeds is None else list(seeds)
    seeds_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(seeds[0] if seeds else 0)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    ids, mask = _left_pad(prompts, pad_token_id, device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    cache_name = cache_kwarg(model)
    out_tokens: list[torch.Tensor] = []
    out_lps: list[torch.Tensor] = []
    logits_dtype = torch.float32
    hidden: list[torch.Tensor] = []
    hook = None
    if value_head is not None:
        hook = final_hidden_hook(model, hidden)
    try:
        start = time.perf_counter()
        for step in range(max_new_tokens):
            logits = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_name: cache},
            ).logits[:, -1, :]
            logits_dtype = logits.dtype
            if sampler == "rlk":
                logits = logits.contiguous()
                tok = rlk.sample(
                    logits,
                    seeds_t,
                    lengths + step,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                )
                lp = rlk.logprobs(logits, tok, temperature=logprob_temperature(temperature))
            else:
                tok, lp = _sample_torch(logits, temperature, gen)
            if progress is not None and (step + 1) % max(1, max_new_tokens // 4) == 0:
                progress(f"  decode step {step + 1}/{max_new_tokens}")
            out_tokens.append(tok)
            out_lps.append(lp.float())
            ids = tok[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = (lengths + step)[:, None]
    finally:
        if hook is not None:
            hook.remove()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    toks = torch.stack(out_tokens, 1).cpu() if out_tokens else torch.zeros(b, 0, dtype=torch.long)
    lps = torch.stack(out_lps, 1).cpu() if out_lps else torch.zeros(b, 0)
    vals = None
    if value_head is not None:
        # The final norm runs once per step: its last position predicts the step's token.
        vals = torch.stack([value_head(h) for h in hidden], 1).cpu() if hidden else lps * 0
    samples = []
    for i in range(b):
        resp = toks[i].tolist()
        n = len(resp)
        if eos_token_id is not None and eos_token_id in resp:
            n = resp.index(eos_token_id) + 1
        v = None if vals is None else vals[i, :n].clone()
        samples.append(Sample(list(prompts[i]), resp[:n], lps[i, :n].clone(), seeds[i], v))
    return RolloutResult(
        samples, seconds, sum(len(s.response) for s in samples), logits_dtype=logits_dtype
    )


class PaddedRollout:
    """The rollout engine ``padded`` (:class:`rlk_integrations.engine.engines.RolloutEngine`):
    :func:`generate`, one left-padded batch per call; it keeps nothing between calls and reads
    no option. ``sampler="torch"`` is the stock rollout (``rlk consistency``'s stock row).

    Example::

        ro = PaddedRollout().generate(patch_model(model), prompts, 64, seeds=[11, 12])
    """

    name = "padded"

    def __init__(self, options: RolloutOptions | None = None, *, sampler: str = "rlk") -> None:
        if sampler not in ("rlk", "torch"):
            raise ValueError(f"sampler must be 'rlk' or 'torch', got {sampler!r}")
        self.sampler = sampler

    def unavailable(self, device: torch.device) -> str | None:
        return None  # transformers is a dependency; any torch device

    def stock_twin(self, model, device) -> None:
        return None  # the stock side's padded rollout (torch sampling) is every engine's baseline

    def generate(self, model, prompts, new_tokens, seeds, *, temperature=1.0, top_k=0,
                 top_p=1.0, eos_token_id=None, progress=None) -> RolloutResult:  # fmt: skip
        return generate(
            model, prompts, new_tokens, seeds=seeds, temperature=temperature, top_k=top_k,
            top_p=top_p, sampler=self.sampler, eos_token_id=eos_token_id, progress=progress,
        )  # fmt: skip
