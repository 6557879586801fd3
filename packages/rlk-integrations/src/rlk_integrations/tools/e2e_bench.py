"""End-to-end benchmarks: rollout and training tokens per second on whole models.

Models: the built-in random-weight configs of :mod:`rlk_integrations.tools.zoo` (:data:`MODELS`),
bf16, on :data:`rlk.bench.timing.DEVICE`. Each model is loaded once; its stock rows run it
unpatched (transformers as shipped, SDPA attention) and its rlk rows run the same weights under
:func:`~rlk_integrations.models.transformers.patch_model`.

Rollout (``B`` random prompts of :data:`PROMPT_LEN` tokens, seeded; :data:`NEW_TOKENS` sampled
per prompt at temperature 1, no top-k / top-p, nothing stops early, so every engine makes
``B * NEW_TOKENS`` tokens; the family ``e2e-long`` (:data:`LONG`, its own ``rlk bench`` family so
that each fits one run of a time-limited machine) runs the long setting,
:data:`LONG_PROMPT_LEN` and :data:`LONG_NEW_TOKENS`, for every engine but those of
:data:`LONG_SKIP`). One op per rollout engine of :mod:`rlk_integrations.engine.engines` that can run
here (one that cannot is named on stderr with the reason), run through the engine protocol:

- ``e2e.rollout.<engine>``, impl ``rlk``: the engine's ``generate`` (``padded``: left-padded
  batch, ``DynamicCache``, ``rlk.sample`` + ``rlk.logprobs``; ``paged``: paged KV cache,
  continuous batching, all ``B`` requests admitted at once). One engine object per shape serves
  the warm-up and the timed run, as a serving engine serves calls after start-up: ``paged``
  builds its KV cache and captures its decode CUDA graphs in the warm-up (the row's
  ``first_run_ms``) and keeps them for the timed run.
  The ``paged`` rows add their share of the decode HBM roofline (``hbm_roofline``: every
  weight read once per step plus each request's keys and values, ``decode_bytes`` in all, at the
  copy bandwidth of the report's ceilings, over the row's time; see :func:`_decode_bytes`),
  on CUDA and for dense models.
- impl ``hf-generate``: ``model.generate(do_sample=True)`` on the left-padded batch with
  transformers' default dynamic cache (``cache: "dynamic"``), and impl
  ``hf-generate-static``: the same with ``cache_implementation="static"`` (``cache:
  "static"``), for which ``generate`` compiles the decode step itself on CUDA (transformers'
  default ``CompileConfig``: inductor, ``mode="reduce-overhead"``, i.e. CUDA graphs; the
  warm-up compiles and records, ``first_run_ms``; on a CPU it does not compile, and the row
  says ``decode_compiled: false``; see :func:`_hf_static_row`). Each runs once per shape,
  under the first engine's op; transformers has no other engine, so each other op's peer rows
  are those runs emitted again, marked ``same_run_as`` the first op.

Each engine first makes the very same run untimed (same prompts, same number of new tokens), so
that whatever is built per shape stays out of the timed run: Triton compiles rlk's kernels per
specialisation, and SDPA's default backend on an H200 (cuDNN) builds an execution plan for each
new key/value length, i.e. at every decode step (a warm-up of 8 tokens left ~120 plan builds,
~45 ms each, inside a timed 128-token hf-generate run). A row's ``ms`` is the wall time of one
run (device synchronised at both ends), with ``tok_s`` (new tokens per second) and
``new_tokens``.

Training (``e2e.train``): :data:`TRAIN_SEQS` random sequences of :data:`TRAIN_LEN` tokens packed
into one ``[1, TRAIN_SEQS * TRAIN_LEN]`` row whose ``position_ids`` restart per sequence (all
three impls; field ``layout``). Forward, the log-probability of every token after each
sequence's first, their sum, backward:

- ``stock``: ``model(...).logits``, ``log_softmax`` + ``gather`` in fp32
  (:func:`rlk_integrations.engine.training.packed_logprobs` with ``use_rlk=False``);
- ``stock+liger``: the stock decoder's hidden states, then Liger's fused linear cross-entropy
  with ``reduction="none"`` (per-token losses = -log-probs); skipped when liger is missing;
- ``rlk``: the patched decoder's hidden states, then :func:`rlk.linear_logprobs`
  (:func:`~rlk_integrations.engine.training.packed_logprobs`, as ``rlk consistency`` trains);
- ``rlk graphed`` (CUDA only): the same pass and its backward, each replayed as one CUDA graph
  (:class:`~rlk_integrations.engine.training.GraphedLogprobs`, its bucket the row's shape; the
  warm-up call captures).

The same step with ``torch.compile`` on both sides (``e2e.train.compiled``: stock, stock with
Liger's kernels, rlk) is :mod:`rlk_integrations.tools.e2e_compile`'s; the family runs its Liger row
after every model's other rows.

A training row is the median wall time of :data:`~.e2e_common.TRAIN_ITERS` iterations after
:data:`~.e2e_common.TRAIN_WARMUP` untimed ones, gradients zeroed before each; ``tok_s`` counts every
token of the packed row (``tokens``).

GRPO step (``e2e.grpo_step``): :data:`GRPO_PROMPTS` random prompts, :data:`GRPO_GROUP`
completions of :data:`NEW_TOKENS` tokens each, a reward computed from the tokens, group-normalised
advantages, the clipped policy loss (token mean) against the rollout's log-probabilities over
micro-batches of :data:`GRPO_MICRO_BATCH` completions, backward, and an AdamW step (learning
rate 0, so that every step does the same work):

- ``stock``: ``generate`` (torch sampling; the sampling log-probabilities from the logits it
  returns), log-probabilities from stock transformers, the loss in torch;
- ``stock+liger``: the same with Liger's fused linear cross-entropy for the log-probabilities;
- ``rlk``: the rollout engine :data:`GRPO_ENGINE` (one engine object for the untimed step and
  the timed one), then :func:`~rlk_integrations.engine.training.grpo_step`, which on a GPU
  recomputes through one :class:`~rlk_integrations.engine.training.GraphedLogprobs` (its bucket a
  micro-batch of the longest prompts; the untimed step captures).

A row is the wall time of one step after an untimed one; ``tok_s`` counts the sampled tokens.

The family ``e2e-train-long`` (:data:`TRAIN_LONG_FAMILY`) runs the training rows alone at long
context, where attention's backward is most of a step: each of :data:`TRAIN_LONG_SHAPES` (one
sequence of 16384 tokens, and 4 of 8192 packed) through each of :data:`TRAIN_LONG_MODELS`. Stock
runs transformers' SDPA attention: causal over one sequence, and over packed ones with the
block-diagonal mask transformers builds from the ``position_ids``. A peer that runs out of memory
has no row: the report's ``left_out`` records it with the error.

The family ``e2e-heldout`` runs the training rows alone on the held-out shapes
(:data:`rlk_integrations.tools.zoo.HELDOUT`), whose kernel configurations were never measured.

``RLK_E2E_MODELS`` (comma-separated built-in names) restricts the e2e families to those of their
models it names, so that a family can be split over runs of a time-limited machine.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch

from rlk.bench import timing
from rlk_integrations.engine import engines, rollout, training
from rlk_integrations.engine.engines import Sample
from rlk_integrations.models.transformers import decoder, patch_model, unpatch_model
from rlk_integrations.tools import e2e_common
from rlk_integrations.tools import e2e_compile as ec
from rlk_integrations.tools.consistency import random_prompts
from rlk_integrations.tools.e2e_common import DTYPE, SEED, restart_clock
from rlk_integrations.tools.e2e_common import free as _free
from rlk_integrations.tools.e2e_common import say as _say
from rlk_integrations.tools.e2e_common import train_samples as _train_samples
from rlk_integrations.tools.e2e_common import train_seconds as _train_seconds
from rlk_integrations.tools.e2e_common import wall as _wall
from rlk_integrations.tools.zoo import HELDOUT, load_model

#: Last, the mixture-of-experts model (Qwen3-30B-A3B's layers, 4 of them), so that a run cut
#: short by its time limit keeps the dense models' rows.
MODELS = ("qwen2-0.5b", "qwen3-0.6b", "llama3-8b-4layers", "qwen3-30b-a3b-4layers")
BATCHES = (8, 64)
NEW_TOKENS = 128
TRAIN_SEQS = 8
TRAIN_LEN = 512

QUICK_MODELS = ("qwen2-0.5b",)
#: The ``e2e-heldout`` family's models (the quick run and the full one).
HELDOUT_MODELS = HELDOUT
#: The ``e2e-train-long`` family: models and (sequences, tokens each) of its packed row.
TRAIN_LONG_MODELS = ("llama3-8b-4layers", "qwen3-4b-4layers")
TRAIN_LONG_SHAPES = ((1, 16384), (4, 8192))
QUICK_TRAIN_LONG_SHAPES = ((1, 4096), (4, 1024))
QUICK_BATCHES = (8,)
QUICK_NEW_TOKENS = 32
QUICK_TRAIN_SEQS = 8
QUICK_TRAIN_LEN = 128

#: GRPO step: its rollout engine, prompts, completions per prompt (the group), micro-batch of
#: the update.
GRPO_ENGINE = "paged"
GRPO_PROMPTS = 8
GRPO_GROUP = 8
GRPO_MICRO_BATCH = 16
QUICK_GRPO_PROMPTS = 2

#: Prompt lengths (min, max), drawn per prompt.
PROMPT_LEN = (16, 64)
#: The long rollout setting (the engines against hf-generate): prompt lengths and new tokens,
#: and the quick run's; the engines not timed there (the eager padded rollout).
LONG_SKIP = ("padded",)
LONG_PROMPT_LEN = (256, 512)
LONG_NEW_TOKENS = 512
QUICK_LONG_PROMPT_LEN = (64, 128)
QUICK_LONG_NEW_TOKENS = 64
PAGE_SIZE = 16
PAD_ID = 0


# --------------------------------------------------------------------------------------------
# Rollout engines: (model, prompts, new tokens) -> new tokens made
# --------------------------------------------------------------------------------------------


def _generate(model: torch.nn.Module, prompts: list[list[int]], new: int, **extra: Any):
    """transformers' ``generate`` with torch sampling on the left-padded prompts, every row
    making ``new`` tokens; returns the padded prompt ids and ``generate``'s output."""
    device = next(model.parameters()).device
    ids, mask = rollout._left_pad(prompts, PAD_ID, device)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        max_new_tokens=new,
        # No early stop: every row makes `new` tokens, as the rlk engines do (the built-in
        # configs have no EOS; with one, this keeps it from being sampled).
        min_new_tokens=new,
        # Unset, transformers would default to top_k=50; 0 turns the filter off, like rlk's.
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        pad_token_id=PAD_ID,
        **extra,
    )
    return ids, out


@torch.no_grad()
def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int, **extra: Any) -> int:
    ids, out = _generate(model, prompts, new, **extra)
    made = out.shape[1] - ids.shape[1]
    if made != new:
        raise RuntimeError(f"hf generate made {made} new tokens per row, not {new}")
    return len(prompts) * made


def _hf_generate_static(model: torch.nn.Module, prompts: list[list[int]], new: int) -> int:
    """``generate`` with transformers' static cache, which compiles the decode step itself on a
    CUDA device (and not on a CPU)."""
    return _hf_generate(model, prompts, new, cache_implementation="static")


def _hf_static_row(op, model, prompts, new, shape, device) -> dict[str, Any]:
    """The ``hf-generate-static`` row: ``generate(cache_implementation="static")``, whose decode
    step transformers compiles with its default ``CompileConfig`` (inductor,
    ``mode="reduce-overhead"``: CUDA graphs) on CUDA; the warm-up compiles and records
    (``first_run_ms``). Dynamo starts afresh for each row, so that no earlier model's or
    batch's compiled code, recompile count or CUDA graph pool reaches it, and ends afresh, so
    that its memory is free for the engines after it. On a CPU transformers does not compile
    (``decode_compiled`` false). A peer that fails, or on CUDA did not compile its decode step,
    gives instead a record of why under ``left_out`` (the report's ``left_out``), not a row."""
    torch._dynamo.reset()
    try:
        r = _rollout_row(op, "hf-generate-static", _hf_generate_static, model, prompts, new,
                         shape, device)  # fmt: skip
        # generate keeps its compiled call on the model (transformers' get_compiled_call).
        compiled = getattr(model, "_compiled_call", None) is not None
        if device.type == "cuda" and not compiled:
            raise RuntimeError("generate with the static cache did not compile its decode step")
    except Exception as e:
        _say(f"e2e: hf-generate-static failed, row left out ({type(e).__name__}: {e})")
        return timing.left_out(op, shape, "bf16", "hf-generate-static", e)
    finally:
        # The compiled call, and the cache length generate keeps to size the next static
        # cache: each shape's run is sized and compiled for its own prompts.
        for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
            model.__dict__.pop(attr, None)
        torch._dynamo.reset()
        _free(device)
    return dict(r, cache="static", decode_compiled=compiled)


def _copy_GBps(device: torch.device) -> float | None:
    """The copy bandwidth of the report's ceilings (GB/s, read + write; measured once per
    process); None off CUDA."""
    return timing.copy_GBps() if device.type == "cuda" else None


def _decode_bytes(model: torch.nn.Module, prompts: list[list[int]], new: int) -> int | None:
    """The bytes a rollout of ``new`` tokens per prompt must read from HBM at the least, one
    step per token: every weight once per step (an input embedding not tied to the output
    head counts nothing: a step reads a row of it per request) and each request's keys and
    values over its context (the prompt and the tokens made before the step's), in the
    model's dtype. None for a mixture-of-experts model: which expert weights a step reads
    depends on the routing."""
    params = dict(model.named_parameters())  # a tied weight once
    if any(".experts." in name for name in params):
        return None
    weights = sum(p.numel() * p.element_size() for p in params.values())
    emb = model.get_input_embeddings().weight
    if emb is not model.get_output_embeddings().weight:
        weights -= emb.numel() * emb.element_size()
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * emb.element_size()
    # Step t (0-based) of a request with a prompt of n tokens reads n + t tokens' keys/values.
    tokens = new * sum(len(p) for p in prompts) + len(prompts) * new * (new - 1) // 2
    return new * weights + tokens * per_token


def _roofline(model, prompts, new, ms: float, device) -> dict[str, Any]:
    """A paged row's share of the decode HBM roofline: the time :func:`_decode_bytes` take at
    the copy bandwidth over the row's ``ms`` (``hbm_roofline``; the row's time includes the
    prefill, which the bytes leave out) and those bytes (``decode_bytes``); nothing where either
    is unknown (off CUDA, a mixture of experts)."""
    nbytes, copy = _decode_bytes(model, prompts, new), _copy_GBps(device)
    if nbytes is None or copy is None:
        return {}
    return {"decode_bytes": nbytes, "hbm_roofline": round(nbytes / copy / 1e6 / ms, 3)}


def _rollout_row(op, impl, engine, model, prompts, new, shape, device) -> dict[str, Any]:
    _say(f"e2e: {shape} {op} {impl} (warm-up, then timed)")
    # The warm-up: the same run, untimed; its wall time is kept (``first_run_ms``).
    _, first = _wall(lambda: engine(model, prompts, new), device)
    tokens, seconds = _wall(lambda: engine(model, prompts, new), device)
    if tokens != len(prompts) * new:
        raise RuntimeError(f"{impl} {op} made {tokens} tokens, not {len(prompts)} x {new}")
    return timing.row(
        op,
        shape,
        "bf16",
        impl,
        seconds * 1e3,
        timing="wall, 1 run",
        tok_s=round(tokens / seconds, 1),
        new_tokens=tokens,
        first_run_ms=round(first * 1e3, 1),
    )


def _engines(device: torch.device, skip: tuple[str, ...] = ()) -> list[engines.RolloutEngine]:
    """The rollout engines that can run on ``device`` (every page of ``PAGE_SIZE`` tokens, all
    requests admitted at once), less ``skip``; those that cannot run are named on stderr."""
    options = engines.RolloutOptions(page_size=PAGE_SIZE)
    wanted = tuple(n for n in engines.names() if n not in skip)
    found, skipped = engines.available(wanted, device, options)
    for name, why in skipped.items():
        _say(f"e2e: rollout engine {name} not run: {why}")
    return found


def _rollouts(model, name: str, b: int, new: int, prompt_len, device, emit, long: bool) -> None:
    """The rollout rows of one shape: hf-generate and hf-generate-static once, then every
    engine (``long``: but those of :data:`LONG_SKIP`), each op after the first with copies of
    the hf-generate rows."""
    prompts = random_prompts(b, model.config.vocab_size, *prompt_len, seed=SEED + b)
    seeds = list(range(b))
    shape = f"{name} B={b} prompt={prompt_len[0]}-{prompt_len[1]} new={new}"
    found = _engines(device, LONG_SKIP if long else ())
    if not found:
        raise RuntimeError("no rollout engine can run here")
    ops = [f"e2e.rollout.{e.name}" for e in found]
    unpatch_model(model)
    hf = _rollout_row(ops[0], "hf-generate", _hf_generate, model, prompts, new, shape, device)
    hf = dict(hf, cache="dynamic")
    emit(hf)
    static = _hf_static_row(ops[0], model, prompts, new, shape, device)
    emit(static)
    patch_model(model)
    for op, engine in zip(ops, found):
        if op != ops[0]:  # transformers has one engine: this op's peers are the same runs
            emit(dict(hf, op=op, same_run_as=ops[0]))
            if "left_out" not in static:
                emit(dict(static, op=op, same_run_as=ops[0]))

        def run(model, prompts, new, engine=engine) -> int:
            return engine.generate(model, prompts, new, seeds).new_tokens

        r = _rollout_row(op, "rlk", run, model, prompts, new, shape, device)
        if engine.name == "paged":
            r.update(_roofline(model, prompts, new, r["ms"], device))
        emit(r)


# --------------------------------------------------------------------------------------------
# Training steps: forward, per-token log-probs, sum, backward
# --------------------------------------------------------------------------------------------


def _stock_step(model, samples: list[Sample]) -> None:
    lps = training.packed_logprobs(model, samples, use_rlk=False)
    torch.cat(lps).sum().backward()


def _rlk_step(model, samples: list[Sample]) -> None:
    lps = training.packed_logprobs(model, samples, use_rlk=True)
    torch.cat(lps).sum().backward()


def _graphed_step() -> Callable:
    """rlk's training step through :class:`~rlk_integrations.engine.training.GraphedLogprobs`, its
    bucket the samples' own shape (captured on the first, warm-up, call)."""
    held: list[training.GraphedLogprobs] = []

    def step(model, samples: list[Sample]) -> None:
        if not held:
            held.append(training.GraphedLogprobs.for_batches(model, [samples]))
        torch.cat(held[0](samples)).sum().backward()

    return step


def _liger_logprobs(flce, model, samples: list[Sample]) -> torch.Tensor:
    """The stock decoder's hidden states, then Liger's fused linear cross-entropy per token:
    the log-probabilities of every sample's response, concatenated (packed as
    ``packed_logprobs`` packs them)."""
    ids, pos, rows, targets = training.pack_samples(samples, next(model.parameters()).device)
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    nll = flce(
        hidden[0].index_select(0, rows), head.weight, targets, bias=head.bias, reduction="none"
    )
    return -nll


def _liger_step(flce, model, samples: list[Sample]) -> None:
    _liger_logprobs(flce, model, samples).sum().backward()


def _liger() -> Callable | None:
    """Liger's fused linear cross-entropy (functional API), or None when it cannot load."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as e:  # not installed, or built against another torch / triton
        _say(f"e2e: liger-kernel not importable, no stock+liger rows ({type(e).__name__}: {e})")
        return None
    return liger_fused_linear_cross_entropy


def _trainings(model, name: str, n: int, length: int, device, emit, flce) -> None:
    samples = _train_samples(model.config.vocab_size, n, length)
    shape, tokens = f"{name} {n}x{length}", n * length
    impls: list[tuple[str, bool, Callable]] = [("stock", False, _stock_step)]
    if flce is not None:
        impls.append(("stock+liger", False, lambda m, s: _liger_step(flce, m, s)))
    impls.append(("rlk", True, _rlk_step))
    if device.type == "cuda":
        impls.append(("rlk graphed", True, _graphed_step()))
    for impl, patched, step in impls:
        if patched:
            patch_model(model)
        else:
            unpatch_model(model)
        warm, iters = e2e_common.TRAIN_WARMUP, e2e_common.TRAIN_ITERS
        _say(f"e2e: {shape} e2e.train {impl} ({warm} warm-up, {iters} timed)")
        try:
            seconds = _train_seconds(model, step, samples, device)
        except Exception as e:
            # An optional peer's failure, or a peer's lack of memory at long context (stock
            # keeps every layer's fp32 logits), must not cost the rlk rows after it.
            oom = isinstance(e, torch.OutOfMemoryError) and not patched
            if impl != "stock+liger" and not oom:
                raise
            model.zero_grad(set_to_none=True)
            _free(device)
            _say(f"e2e: {impl} failed, row skipped ({type(e).__name__}: {e})")
            emit(timing.left_out("e2e.train", shape, "bf16", impl, e))  # the report says why
            continue
        emit(
            timing.row(
                "e2e.train",
                shape,
                "bf16",
                impl,
                seconds * 1e3,
                timing=f"wall, median of {e2e_common.TRAIN_ITERS}",
                tok_s=round(tokens / seconds, 1),
                tokens=tokens,
                layout=f"packed 1x{tokens}",
            )
        )


# --------------------------------------------------------------------------------------------
# GRPO step: rollout, reward, advantages, policy loss, backward, optimizer step
# --------------------------------------------------------------------------------------------


def _reward(samples: list[Sample]) -> torch.Tensor:
    """A verifiable reward computed from the tokens: the share of even token ids."""
    return torch.tensor([sum(t % 2 == 0 for t in s.response) / len(s.response) for s in samples])


@torch.no_grad()
def _stock_rollout(model, prompts: list[list[int]], new: int) -> list[Sample]:
    """transformers' ``generate`` (torch sampling), with each sampled token's float32
    log-probability from the logits it returns, as TRL records them."""
    ids, out = _generate(model, prompts, new, return_dict_in_generate=True, output_logits=True)
    resp = out.sequences[:, ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float()  # [B, new, V]
    lps = torch.log_softmax(logits, dim=-1).gather(-1, resp[..., None])[..., 0].cpu()
    return [Sample(list(p), r, lp) for p, r, lp in zip(prompts, resp.tolist(), lps)]


def _stock_update(model, optimizer, samples, rewards, group: int, micro: int, flce) -> None:
    """GRPO's clipped policy loss (token mean, eps 0.2) in torch over packed micro-batches; the
    log-probabilities from stock transformers (``flce``: Liger's fused linear cross-entropy)."""
    device = next(model.parameters()).device
    r = rewards.to(device).view(-1, group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    total = sum(len(s.response) for s in samples)
    optimizer.zero_grad(set_to_none=True)
    for idx in training.micro_batches(len(samples), micro):
        batch = [samples[i] for i in idx]
        if flce is None:
            new = torch.cat(training.packed_logprobs(model, batch, use_rlk=False))
        else:
            new = _liger_logprobs(flce, model, batch).float()
        old = torch.cat([s.logprobs for s in batch]).to(device)
        a = torch.cat([adv[i].expand(len(samples[i].response)) for i in idx])
        ratio = torch.exp(new - old)
        loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).sum() / total
        loss.backward()
    optimizer.step()


def _grpo_step(
    impl: str, model, optimizer, prompts, new: int, flce, engine=None, graphed=None
) -> int:
    """One GRPO step of ``impl`` (rlk samples with ``engine`` and recomputes with ``graphed``
    when given); returns the tokens sampled."""
    if impl == "rlk":
        ro = engine.generate(model, prompts, new, list(range(len(prompts))))
        samples = ro.samples
        training.grpo_step(
            model, optimizer, samples, _reward(samples), GRPO_GROUP, GRPO_MICRO_BATCH,
            logits_dtype=ro.logits_dtype, graphed=graphed,
        )  # fmt: skip
    else:
        samples = _stock_rollout(model, prompts, new)
        liger = flce if impl == "stock+liger" else None
        _stock_update(
            model, optimizer, samples, _reward(samples), GRPO_GROUP, GRPO_MICRO_BATCH, liger
        )
    return sum(len(s.response) for s in samples)


def _grpo_graphed(model, new: int) -> training.GraphedLogprobs | None:
    """On CUDA, the recompute of a GRPO micro-batch (its largest prompts and all ``new``
    tokens) as CUDA graphs; elsewhere None (eager)."""
    if next(model.parameters()).device.type != "cuda":
        return None
    longest = PROMPT_LEN[1] + new
    return training.GraphedLogprobs(
        model,
        max_tokens=GRPO_MICRO_BATCH * longest,
        max_seqs=GRPO_MICRO_BATCH,
        max_seq_len=longest,
        max_rows=GRPO_MICRO_BATCH * new,
    )


def _grpo(model, name: str, prompts_n: int, new: int, device, emit, flce) -> None:
    base = random_prompts(prompts_n, model.config.vocab_size, *PROMPT_LEN, seed=SEED + 7)
    prompts = [p for p in base for _ in range(GRPO_GROUP)]
    shape = f"{name} {prompts_n}x{GRPO_GROUP} new={new}"
    # lr = 0: the weights (and so every step's work) stay the same for every impl and step;
    # AdamW still updates its state and runs its kernels.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    impls = ["stock"] + (["stock+liger"] if flce is not None else []) + ["rlk"]
    for impl in impls:
        (patch_model if impl == "rlk" else unpatch_model)(model)
        _say(f"e2e: {shape} e2e.grpo_step {impl} (1 warm-up, 1 timed)")
        # rlk's rollout engine and its graphed recompute serve the warm-up step (which builds
        # and captures) and the timed one, like a trainer's.
        options = engines.RolloutOptions(page_size=PAGE_SIZE)
        engine = engines.create(GRPO_ENGINE, options) if impl == "rlk" else None
        graphed = _grpo_graphed(model, new) if impl == "rlk" else None
        try:
            _grpo_step(impl, model, optimizer, prompts, new, flce, engine, graphed)
            tokens, seconds = _wall(
                lambda impl=impl, engine=engine, graphed=graphed: _grpo_step(
                    impl, model, optimizer, prompts, new, flce, engine, graphed
                ),
                device,
            )
        except Exception as e:
            if impl != "stock+liger":
                raise
            _say(f"e2e: stock+liger failed, row skipped ({type(e).__name__}: {e})")
            continue
        finally:
            model.zero_grad(set_to_none=True)
        emit(
            timing.row(
                "e2e.grpo_step", shape, "bf16", impl, seconds * 1e3, timing="wall, 1 step",
                tok_s=round(tokens / seconds, 1), new_tokens=tokens,
            )
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Family entry point
# --------------------------------------------------------------------------------------------


def _bench_model(
    name: str, batches, new: int, long, n: int, length: int, grpo_prompts: int, device, emit, flce
) -> None:
    """One model's rows: the rollouts, training and the GRPO step, or (``long`` given) the
    long-setting rollouts alone."""
    _say(f"e2e: loading {name} (random weights, bf16, {device})")
    model = load_model(name, dtype=DTYPE, device=device, seed=SEED)
    try:
        if long is not None:
            long_prompt_len, long_new = long
            for b in sorted(batches, reverse=True):
                _rollouts(model, name, b, long_new, long_prompt_len, device, emit, long=True)
            return
        for b in batches:
            _rollouts(model, name, b, new, PROMPT_LEN, device, emit, long=False)
        _trainings(model, name, n, length, device, emit, flce)
        if device.type == "cuda":  # torch.compile on both sides (e2e_compile.py)
            # Liger's compiled row runs after every model's other rows (_run).
            ec.compiled_trainings(
                name, n, length, device, emit, flce, tuple(i for i in ec.IMPLS if i != ec.LIGER)
            )
        _grpo(model, name, grpo_prompts, new, device, emit, flce)
    finally:
        unpatch_model(model)


def _settings(quick: bool):
    if quick:
        return (QUICK_MODELS, QUICK_BATCHES, QUICK_NEW_TOKENS, QUICK_TRAIN_SEQS, QUICK_TRAIN_LEN,
                QUICK_GRPO_PROMPTS, (QUICK_LONG_PROMPT_LEN, QUICK_LONG_NEW_TOKENS))  # fmt: skip
    return (MODELS, BATCHES, NEW_TOKENS, TRAIN_SEQS, TRAIN_LEN, GRPO_PROMPTS,
            (LONG_PROMPT_LEN, LONG_NEW_TOKENS))  # fmt: skip


def _selected(models) -> tuple[str, ...]:
    """``models``, restricted to those ``RLK_E2E_MODELS`` names when it is set (an unknown name
    is an error: a typo must not measure nothing)."""
    wanted = os.environ.get("RLK_E2E_MODELS", "").strip()
    if not wanted:
        return tuple(models)
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in names if w not in models]
    if unknown:
        raise ValueError(
            f"RLK_E2E_MODELS names {unknown}, not models of this family ({', '.join(models)})"
        )
    return tuple(m for m in models if m in names)


def _run(quick: bool, emit: Callable[[dict], None], long: bool) -> None:
    restart_clock()
    device = torch.device(timing.DEVICE)
    models, batches, new, n, length, grpo, long_setting = _settings(quick)
    flce = None if long else _liger()
    for name in _selected(models):
        # The model is local to _bench_model: gone on return, so its memory can be released
        # before the next one loads.
        setting = long_setting if long else None
        _bench_model(name, batches, new, setting, n, length, grpo, device, emit, flce)
        _free(device)
    if not long and flce is not None and device.type == "cuda":
        # Last: a peer that fails here may leave the CUDA context unusable (e2e_compile.py).
        for name in _selected(models):
            ec.compiled_trainings(name, n, length, device, emit, flce, (ec.LIGER,))


def run(quick: bool, emit: Callable[[dict], None]) -> None:
    """The ``e2e`` family: every model's rollouts, training and GRPO step."""
    _run(quick, emit, long=False)


def run_long(quick: bool, emit: Callable[[dict], None]) -> None:
    """The ``e2e-long`` family: every model's paged rollouts in the long setting, the largest
    batch first."""
    _run(quick, emit, long=True)


def _training_rows(models, shapes) -> Callable[[bool, Callable[[dict], None]], None]:
    """A family of training rows alone: each of ``models`` loaded once, then each
    ``(sequences, tokens each)`` of ``shapes(quick)`` packed into one row."""

    def run(quick: bool, emit: Callable[[dict], None]) -> None:
        restart_clock()
        device = torch.device(timing.DEVICE)
        flce = _liger()
        for name in _selected(models()):
            _say(f"e2e: loading {name} (random weights, bf16, {device})")
            model = load_model(name, dtype=DTYPE, device=device, seed=SEED)
            try:
                for n, length in shapes(quick):
                    _trainings(model, name, n, length, device, emit, flce)
                    _free(device)
            finally:
                unpatch_model(model)
            del model
            _free(device)

    return run


#: The ``e2e-heldout`` family: the training rows on the held-out shapes (``quick``: the quick
#: run's training length). Module constants are read at each run (tests set them).
run_heldout = _training_rows(lambda: HELDOUT_MODELS, lambda quick: [_settings(quick)[3:5]])
#: The ``e2e-train-long`` family: the training rows of :data:`TRAIN_LONG_SHAPES` (``quick``:
#: :data:`QUICK_TRAIN_LONG_SHAPES`) on each of :data:`TRAIN_LONG_MODELS`.
run_train_long = _training_rows(
    lambda: TRAIN_LONG_MODELS,
    lambda quick: QUICK_TRAIN_LONG_SHAPES if quick else TRAIN_LONG_SHAPES,
)


#: The ``e2e-long`` family's entry (``rlk bench --only e2e-long``).
LONG = types.SimpleNamespace(run=run_long)
#: The ``e2e-heldout`` family's entry (``rlk bench --only e2e-heldout``).
HELDOUT_FAMILY = types.SimpleNamespace(run=run_heldout)
#: The ``e2e-train-long`` family's entry (``rlk bench --only e2e-train-long``).
TRAIN_LONG_FAMILY = types.SimpleNamespace(run=run_train_long)
