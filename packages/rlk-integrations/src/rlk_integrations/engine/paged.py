"""Rollout with a paged KV cache and continuous batching, attention by :func:`rlk.paged_attention`.

:func:`generate_paged` is the second rollout mode beside the padded batch of
:func:`rlk_integrations.engine.rollout.generate`, with the same result type and the same sampling
(request seed, RNG offset = the token's position), so a request gets the very same tokens and
log-probabilities in either mode, alone or with any other requests, and the training recompute
(:mod:`rlk_integrations.engine.training`) equals them bit for bit.

Pieces:

- :class:`PageAllocator`: a free list of page ids (lowest id first).
- :class:`PagedKVCache`: per layer, ``k``/``v`` caches ``[pages, page_size, Hk, D]`` and the
  metadata of the current step (``slots``, ``block_table``, ``seq_lens``, ``cu_seqlens_q``).
  The patched attention (:mod:`rlk_integrations.models.transformers`) sees it as ``past_key_values``
  and hands it the layer's new ``q [T, Hq, D]``, ``k``/``v [T, Hk, D]``; :meth:`attend` writes
  ``k``/``v`` into their slots and calls :func:`rlk.paged_attention`. Nothing in it reads a
  device value on the host.
- :class:`PagedEngine`: the cache and the decode graphs (:mod:`rlk_integrations.engine.paged_step`:
  the packed forward, the eager step and the CUDA-graph decode step), kept across its
  :meth:`generate <PagedEngine.generate>` calls; :func:`generate_paged` builds one for a single
  call.
- :class:`PagedRollout`: the rollout engine ``paged`` of :mod:`rlk_integrations.engine.engines`,
  which keeps one :class:`PagedEngine` for the calls it fits.
- :func:`generate_paged` (and :meth:`PagedEngine.generate`): the scheduler. Requests wait in
  FIFO order and join the running set when a batch slot and all the pages the request can need
  are free (so no request is ever preempted); each step packs, for every running request,
  either its next prompt chunk (chunked prefill) or its last sampled token (decode) into one
  ``[1, T]`` row of varlen queries, runs the decoder layers on it, samples one token for every
  request whose known tokens are now all cached, and retires requests that reached
  ``max_new_tokens`` or EOS, freeing their pages for the queue.

Why the bits match the padded mode: every op but attention is row-wise and batch-invariant;
:func:`rlk.paged_attention` gives :func:`rlk.attention`'s bits whatever the page size, the page
placement, the chunking or the batch; ``lm_head``, :func:`rlk.sample` and :func:`rlk.logprobs`
see one row per request with that request's seed and offset.

Example::

    model = patch_model(load_model("tiny"))
    ro = generate_paged(model, prompts, 16, seeds=seeds, max_batch=8, page_size=16)
    ro.samples[i].response, ro.samples[i].logprobs      # as rollout.generate(...) gives
"""

from __future__ import annotations

import heapq
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import rlk
from rlk.validate import validate_requested
from rlk_integrations.engine import fused
from rlk_integrations.engine.engines import (
    RolloutOptions,
    RolloutResult,
    Sample,
    logprob_temperature,
)
from rlk_integrations.engine.paged_step import _DecodeGraphs, _eager_step, _Launched
from rlk_integrations.models.tp import local_kv_heads
from rlk_integrations.models.transformers import decoder, graph_reads, is_patched


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Page ids ``0..num_pages-1``; :meth:`alloc` hands out the lowest free ids."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap (sorted is a valid heap)

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        for p in pages:
            heapq.heappush(self._free, p)


class PagedKVCache:
    """K/V pages of every layer plus the current step's metadata.

    Shapes: ``k[layer]``/``v[layer] [num_pages, page_size, Hk, D]``. Per step (set by
    :meth:`set_step`): ``slots`` int64 ``[T]`` (flat slot ``page * page_size + offset`` of each
    new token), ``block_table`` int32 ``[B, max_pages]``, ``seq_lens`` int32 ``[B]`` (cached tokens
    including the new ones), ``cu_seqlens_q`` int32 ``[B + 1]`` (the new tokens of each sequence,
    packed in order).
    """

    # Duck-typed marker read by the patched attention forward.
    rlk_paged = True
    #: Whether the steps run the model's fused projections (:mod:`rlk_integrations.engine.fused`)
    #: where it has them; set by the engine. The patched layers then call :meth:`qkv` and
    #: :meth:`mlp` (the model patch does not import the engine's fused buffers).
    fuse_projections = False
    #: ``(q, k, v)`` of ``x`` by the attention module ``attn``: one product where fused.
    qkv = staticmethod(fused.qkv)
    #: The SwiGLU MLP ``module`` on ``x``: gate and up by one product where fused.
    mlp = staticmethod(fused.mlp)

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots: torch.Tensor | None = None
        self.block_table: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.cu_seqlens_q: torch.Tensor | None = None

    def set_step(
        self,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> None:
        self.slots, self.block_table = slots, block_table
        self.seq_lens, self.cu_seqlens_q = seq_lens, cu_seqlens_q

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
    ) -> torch.Tensor:
        """Store the step's ``k``/``v [T, Hk, D]`` of layer ``layer_idx`` in their slots, then
        attend ``q [T, Hq, D]`` to each sequence's cached tokens (one ``rlk.paged_attention``
        call does both). Returns ``[T, Hq, D]``."""
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        return rlk.paged_attention(
            q, kc, vc, self.block_table, self.seq_lens, self.cu_seqlens_q, scale=scale,
            k_new=k, v_new=v, slots=self.slots,
        )  # fmt: skip


@dataclass
class _Request:
    idx: int
    tokens: list[int]  # prompt + sampled so far
    prompt_len: int
    seed: int
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    lp_refs: list[tuple[int, int]] = field(default_factory=list)  # (step, row) of each logprob
    inflight: int = 0  # tokens sampled on the device, not yet read into ``tokens``
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


#: Run the padded decode step of :class:`_DecodeGraphs` eagerly where graphs are off (tests
#: compare its bits with the unpadded step on machines without CUDA).
_EAGER_PADDED_DECODE = False


def page_bytes(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one page of :class:`PagedKVCache`: K and V of ``page_size`` tokens, every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


def pages_for_memory(budget_bytes: int, page: int, max_batch: int, page_size: int) -> int:
    """Pages of ``page`` bytes that fit ``budget_bytes``, less the pages :class:`_DecodeGraphs`
    reserves for padding rows (so the whole cache stays within the budget); at least 0."""
    return max(0, budget_bytes // page - pad_pages(max_batch, page_size))


def _bar(progress, total: int):
    """A tqdm bar on stderr for ``progress`` (None: when stderr is a terminal), or None."""
    if callable(progress) or progress is False:
        return None
    if progress is None and not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit="tok", desc="rollout", leave=False, file=sys.stderr)


def pad_pages(max_batch: int, page_size: int) -> int:
    """Pages :class:`_DecodeGraphs` reserves for the padding rows of a decode step."""
    return _cdiv(max_batch, page_size)


class PagedEngine:
    """A rollout engine on a paged KV cache that keeps its cache and CUDA graphs between calls.

    :func:`generate_paged` builds one for a single call; an RL loop that samples every step
    builds one and calls :meth:`generate` each step, so that the cache is allocated and the
    decode graphs are captured once (as a serving engine does at start-up). The results are the
    bits :func:`generate_paged` gives, and the padded rollout's.

    ``model``: a causal LM patched by :func:`rlk_integrations.models.transformers.patch_model`.
    ``max_len``: the longest request served, prompt plus new tokens; it sets the pages per
    request (``ceil((max_len - 1) / page_size)``), the width of the graphs' block tables and
    the rotary table. Sampling (``temperature``, ``top_k``, ``top_p``) is fixed per engine:
    the graphs capture it. ``page_size``, ``max_batch``, ``num_pages``,
    ``kv_memory_fraction``, ``max_step_tokens``, ``prefill_chunk`` and ``cuda_graphs`` are
    :func:`generate_paged`'s; the default ``num_pages`` holds ``max_batch`` requests of
    ``max_len`` tokens.

    ``fuse_projections`` (default True): each layer's q/k/v and gate/up projections run as one
    :func:`rlk.linear` each, over one buffer per group that the model's parameters are moved
    into and then view (:func:`rlk_integrations.engine.fused.fuse_projections`: no second copy of
    the weights, the same bits as the separate products, fewer and fuller GEMM launches per step).
    The parameters stay the model's: training on them, in place, goes on as before.

    The cache (``num_pages`` pages) stays allocated while the engine lives. The graphs read the
    model's weights where they were at capture: updating them in place (an optimizer step,
    ``load_state_dict``) is fine; when a parameter, a buffer or the rotary table has moved,
    :meth:`generate` fuses the moved projections again and captures the graphs again.

    Example::

        engine = PagedEngine(model, max_len=576, temperature=1.0, max_batch=64)
        for step in range(steps):
            ro = engine.generate(prompts, 512, seeds=seeds)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_len: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        page_size: int = 16,
        max_batch: int = 64,
        num_pages: int | None = None,
        kv_memory_fraction: float | None = None,
        max_step_tokens: int = 2048,
        prefill_chunk: int | None = None,
        cuda_graphs: bool | None = None,
        fuse_projections: bool = True,
    ) -> None:
        if not is_patched(model):
            raise ValueError("a paged rollout needs a model patched by rlk's patch_model")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        if page_size < 1 or max_batch < 1:
            raise ValueError(f"page_size and max_batch must be >= 1, got {page_size}, {max_batch}")
        if max_step_tokens < max_batch:
            raise ValueError(
                f"max_step_tokens ({max_step_tokens}) must be >= max_batch ({max_batch}) so that "
                "every running request can decode in each step"
            )
        prefill_chunk = max_step_tokens if prefill_chunk is None else prefill_chunk
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        base = decoder(model)
        cfg = model.config
        device = next(model.parameters()).device
        if cuda_graphs is None:  # value checks (RLK_VALIDATE) read the device: no graph capture
            cuda_graphs = device.type == "cuda" and not validate_requested()
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool or None, got {type(cuda_graphs).__name__}")
        if not isinstance(fuse_projections, bool):
            raise TypeError(
                f"fuse_projections must be a bool, got {type(fuse_projections).__name__}"
            )
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA model, this one is on {device.type}")
        dtype = next(model.parameters()).dtype
        # The last sampled token never enters the cache: a request caches at most max_len - 1.
        width = max(1, _cdiv(max_len - 1, page_size))
        # Multi-head latent attention (DeepSeek-V3) caches every head's expanded key and its
        # value zero-padded to the same qk_head_dim (rlk_integrations.models.mla).
        head_dim = (
            getattr(cfg, "qk_head_dim", None)
            or getattr(cfg, "head_dim", None)
            or cfg.hidden_size // cfg.num_attention_heads
        )
        if kv_memory_fraction is not None:
            if num_pages is not None:
                raise ValueError("pass num_pages or kv_memory_fraction, not both")
            if not 0 < kv_memory_fraction <= 1:
                raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
            if device.type != "cuda":
                raise ValueError(
                    f"kv_memory_fraction needs a CUDA model, this one is on {device.type}"
                )
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * kv_memory_fraction)
            page = page_bytes(len(base.layers), page_size, local_kv_heads(model), head_dim, dtype)
            num_pages = pages_for_memory(budget, page, max_batch, page_size)
            if width > num_pages:
                raise ValueError(
                    f"kv_memory_fraction={kv_memory_fraction} gives {num_pages} pages of "
                    f"{page_size} tokens ({budget / 2**30:.2f} GiB of {free / 2**30:.2f} GiB "
                    f"free); the longest request needs {width}"
                )
        if num_pages is None:
            num_pages = max_batch * width
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.model, self.base, self.device, self.dtype = model, base, device, dtype
        self.max_len, self.page_size, self.max_batch = max_len, page_size, max_batch
        self.num_pages, self.width = num_pages, width
        self.max_step_tokens, self.prefill_chunk = max_step_tokens, prefill_chunk
        self.cuda_graphs = cuda_graphs
        self.sample_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.lp_temperature = logprob_temperature(temperature)
        padded_decode = cuda_graphs or _EAGER_PADDED_DECODE
        reserved = pad_pages(max_batch, page_size) if padded_decode else 0
        self.cache = PagedKVCache(
            len(base.layers),
            num_pages + reserved,
            page_size,
            local_kv_heads(model),
            head_dim,
            dtype=dtype,
            device=device,
        )
        # Build the rotary table once up to the largest position (one host read, here).
        base.rotary_emb._rlk_table.gather(torch.tensor([max_len], device=device))
        self.graphs: _DecodeGraphs | None = None
        if padded_decode:
            self.graphs = self._new_graphs()
        self.cache.fuse_projections = fuse_projections
        if fuse_projections:  # before the addresses the graphs will read are taken
            fused.fuse_projections(model)
        self._state = graph_reads(model, device)

    def _new_graphs(self) -> _DecodeGraphs:
        return _DecodeGraphs(
            self.model, self.cache, num_pages=self.num_pages, width=self.width,
            max_batch=self.max_batch, sample_kw=self.sample_kw,
            lp_temperature=self.lp_temperature, capture=self.cuda_graphs,
        )  # fmt: skip

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        seeds: list[int] | None = None,
        eos_token_id: int | None = None,
        progress: bool | Callable[[str], None] | None = None,
    ) -> RolloutResult:
        """Sample up to ``max_new_tokens`` per prompt; arguments and result as
        :func:`generate_paged`. Every prompt plus ``max_new_tokens`` must fit ``max_len``."""
        if not is_patched(self.model):
            raise ValueError("the engine's model is no longer patched by rlk's patch_model")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not (progress is None or isinstance(progress, bool) or callable(progress)):
            raise TypeError(f"progress must be a bool, a callable or None, got {progress!r}")
        n = len(prompts)
        seeds = list(range(n)) if seeds is None else list(seeds)
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
        longest = max((len(p) for p in prompts), default=0)
        if max_new_tokens and longest + max_new_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_len={self.max_len}"
            )
        state = graph_reads(self.model, self.device)
        if state != self._state:  # the graphs would read where the weights used to be
            if self.cache.fuse_projections:  # a moved projection is fused again
                fused.fuse_projections(self.model)
            self.base.rotary_emb._rlk_table.gather(torch.tensor([self.max_len], device=self.device))
            if self.graphs is not None:
                self.graphs = self._new_graphs()
            self._state = graph_reads(self.model, self.device)
        return _schedule(self, prompts, max_new_tokens, seeds, eos_token_id, progress)


def _schedule(engine: PagedEngine, prompts, max_new_tokens, seeds, eos_token_id, progress):
    """:meth:`PagedEngine.generate`'s scheduler loop over validated arguments."""
    model, base, cache, graphs = engine.model, engine.base, engine.cache, engine.graphs
    device, page_size, max_batch = engine.device, engine.page_size, engine.max_batch
    max_step_tokens, prefill_chunk = engine.max_step_tokens, engine.prefill_chunk
    sample_kw, lp_temperature = engine.sample_kw, engine.lp_temperature
    # The last sampled token never enters the cache: a request caches prompt + new - 1 tokens.
    need = (
        [_cdiv(len(p) + max_new_tokens - 1, page_size) for p in prompts] if max_new_tokens else []
    )
    if need and max(need) > engine.num_pages:
        raise ValueError(
            f"a request needs {max(need)} pages of {page_size} tokens but the cache has "
            f"{engine.num_pages}"
        )
    allocator = PageAllocator(engine.num_pages)  # every page is free at the start of a call
    waiting = deque(
        _Request(i, list(p), len(p), seeds[i]) for i, p in enumerate(prompts) if max_new_tokens
    )
    running: list[_Request] = []
    done: list[_Request] = []
    step_lps: list[torch.Tensor] = []  # float32 logprobs per step, on the device
    stats = dict(
        steps=0, max_running=0, mixed_steps=0, prefill_chunks=0, graph_steps=0, late_rows=0
    )
    logits_dtype = engine.dtype
    pin = device.type == "cuda"
    bar = _bar(progress, len(waiting) * max_new_tokens)
    say = progress if callable(progress) else None
    start = time.perf_counter()
    # A decode step launched in a graph is read by the host only after the next step is
    # launched (``pending``), so that the GPU does not wait while the host schedules. A
    # request that stops at EOS is learnt one step late: the step launched meanwhile computes
    # one row for it that is thrown away (writing its own pages only; batch invariance keeps
    # the other rows' bits).
    pending: tuple[list[_Request], _Launched, int] | None = None  # rows, step, lp index

    def finish(rows: list[_Request], tokens: list[int], lp_index: int) -> None:
        """Read one step's tokens into its requests; retire those that are done."""
        nonlocal running
        read = 0
        for j, r in enumerate(rows):
            if r.finished:  # a row computed after its EOS: thrown away
                stats["late_rows"] += 1
                continue
            read += 1
            r.tokens.append(tokens[j])
            r.lp_refs.append((lp_index, j))
            r.inflight -= 1
            if r.generated >= max_new_tokens or (
                eos_token_id is not None and tokens[j] == eos_token_id
            ):
                r.finished = True
                allocator.release(r.pages)
                r.pages = []
                done.append(r)
        running = [r for r in running if not r.finished]
        if bar is not None:
            bar.update(read)
            bar.set_postfix(running=len(running), waiting=len(waiting), refresh=False)

    while waiting or running:
        # Admit in arrival order while a slot and the request's pages are free.
        while waiting and len(running) < max_batch and allocator.free >= need[waiting[0].idx]:
            req = waiting.popleft()
            req.pages = allocator.alloc(need[req.idx])
            running.append(req)
        if not running:
            raise RuntimeError("no request fits the KV cache")  # unreachable: checked above
        stats["max_running"] = max(stats["max_running"], len(running))

        # This step's new tokens: decodes first, then prompt chunks within the token budget.
        # A request whose last token is sampled but not yet read takes no step.
        active = [r for r in running if r.generated + r.inflight < max_new_tokens]
        budget = max_step_tokens - sum(r.cached >= r.prompt_len for r in active)
        batch: list[tuple[_Request, int]] = []
        for r in active:
            if r.cached >= r.prompt_len:
                batch.append((r, 1))
            elif budget > 0:
                take = min(r.prompt_len - r.cached, prefill_chunk, budget)
                budget -= take
                batch.append((r, take))
        n_pre = sum(r.cached < r.prompt_len for r, _ in batch)
        graph_step = graphs is not None and n_pre == 0 and bool(batch)
        if pending is not None and not graph_step:
            # An eager step reads its input tokens on the host: read the pending step first,
            # then schedule again with them.
            rows, launched, lp_index = pending
            pending = None
            finish(rows, launched.read(), lp_index)
            continue
        if not batch:
            raise RuntimeError("no running request can take a step")  # unreachable
        stats["prefill_chunks"] += n_pre
        stats["mixed_steps"] += int(0 < n_pre < len(batch))
        s = stats["steps"]
        stats["steps"] += 1

        if graph_step:
            rows = [r for r, _ in batch]  # decodes only: every request samples
            prev_row = {id(r): j for j, r in enumerate(pending[0])} if pending else {}
            launched = graphs.run(rows, prev_row)
            logits_dtype = graphs.logits_dtype
            step_lps.append(launched.logprobs)
            stats["graph_steps"] += 1
            for r in rows:
                r.cached += 1
                r.inflight += 1
            previous, pending = pending, (rows, launched, len(step_lps) - 1)
            if previous is not None:  # the scheduler's one device read per step
                finish(previous[0], previous[1].read(), previous[2])
        else:
            sampled, new_tok, lp, dt = _eager_step(
                model, base, cache, batch, sample_kw, lp_temperature, pin
            )
            for r, take in batch:
                r.cached += take
            for r in sampled:
                r.inflight += 1
            if lp is not None:
                logits_dtype = dt
                step_lps.append(lp)
            finish(sampled, new_tok, len(step_lps) - 1)
        if say is not None and s % 16 == 15:
            say(f"  paged step {s + 1}: {len(running)} running, {len(waiting)} waiting")
    if bar is not None:
        bar.close()

    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    all_lps = torch.cat(step_lps).cpu() if step_lps else torch.zeros(0)
    base_row = [0]
    for x in step_lps:
        base_row.append(base_row[-1] + x.numel())
    by_idx = {r.idx: r for r in done}
    samples = []
    for i, p in enumerate(prompts):
        r = by_idx.get(i)
        if r is None:  # max_new_tokens == 0
            samples.append(Sample(list(p), [], torch.zeros(0), seeds[i]))
            continue
        lps = all_lps[[base_row[st] + j for st, j in r.lp_refs]]
        samples.append(Sample(list(p), r.tokens[r.prompt_len :], lps, seeds[i]))
    return RolloutResult(
        samples,
        seconds,
        sum(len(s.response) for s in samples),
        logits_dtype=logits_dtype,
        extra=stats,
    )


@torch.no_grad()
def generate_paged(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    seeds: list[int] | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    page_size: int = 16,
    max_batch: int = 64,
    num_pages: int | None = None,
    kv_memory_fraction: float | None = None,
    max_step_tokens: int = 2048,
    prefill_chunk: int | None = None,
    cuda_graphs: bool | None = None,
    progress: bool | Callable[[str], None] | None = None,
    fuse_projections: bool = True,
) -> RolloutResult:
    """Sample up to ``max_new_tokens`` per prompt with continuous batching on a paged KV cache.

    ``model``: a causal LM patched by :func:`rlk_integrations.models.transformers.patch_model`.
    ``seeds`` as in :func:`rlk_integrations.engine.rollout.generate` (default ``i``); the token at
    position ``p`` uses RNG offset ``p``. A response stops after ``eos_token_id``.

    Scheduling: at most ``max_batch`` requests run at once; ``num_pages`` pages of
    ``page_size`` tokens are shared (default: enough for ``max_batch`` of the longest
    requests); a request joins (FIFO) once a slot and ``ceil((prompt + max_new - 1) /
    page_size)`` pages are free, and waits until then: a full cache makes requests wait, the
    cache never grows. ``kv_memory_fraction`` (CUDA, instead of ``num_pages``, like
    vLLM's ``gpu_memory_utilization`` for the cache alone): the pages take at most this
    fraction of the device memory free at the call (:func:`pages_for_memory`); a budget below
    one longest request is a ``ValueError``. A step carries at most ``max_step_tokens`` new
    tokens: every decode first (one token each), then prompt chunks of at most
    ``prefill_chunk`` tokens (default ``max_step_tokens``) in arrival order.

    ``cuda_graphs`` (default: on for CUDA models, off while ``RLK_VALIDATE`` asks for value
    checks, which read the device and so cannot be captured): steps in which every running
    request decodes replay a CUDA graph of the step (:class:`_DecodeGraphs`: padded to a
    power-of-two batch, the same bits as the eager step), so that the host launches one graph
    instead of every kernel of every layer; the host reads a graph step's tokens only after it
    has launched the next one. Steps with prompt chunks run eagerly.

    ``fuse_projections``: as :class:`PagedEngine`'s (the model's q/k/v and gate/up weights
    are moved into one buffer per group, which the parameters then view).

    ``progress``: ``None`` (default) draws a progress bar on stderr (tokens, tokens/s, running
    and waiting requests) when stderr is a terminal; ``True`` always, ``False`` never; a
    callable gets a line every 16 steps instead.

    Each call builds a :class:`PagedEngine` (the cache, and the graphs on first use); a loop
    that samples again and again keeps one engine instead.

    Returns a :class:`~rlk_integrations.engine.engines.RolloutResult` (samples in prompt order);
    ``extra`` holds ``steps``, ``max_running``, ``mixed_steps`` (steps with prompt chunks and
    decodes together), ``prefill_chunks``, ``graph_steps`` and ``late_rows`` (rows computed for
    a request after its EOS, while the host had not read that token yet; thrown away).
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max((len(p) for p in prompts), default=1)
    engine = PagedEngine(
        model, max_len=longest + max(max_new_tokens, 0), temperature=temperature, top_k=top_k,
        top_p=top_p, page_size=page_size, max_batch=max_batch, num_pages=num_pages,
        kv_memory_fraction=kv_memory_fraction, max_step_tokens=max_step_tokens,
        prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs, fuse_projections=fuse_projections,
    )  # fmt: skip
    return engine.generate(
        prompts, max_new_tokens, seeds=seeds, eos_token_id=eos_token_id, progress=progress
    )


class PagedRollout:
    """The rollout engine ``paged`` (:class:`rlk_integrations.engine.engines.RolloutEngine`):
    :meth:`PagedEngine.generate` with ``options.page_size`` tokens per page and
    ``options.max_batch`` requests at once (None: every prompt of the call), at most
    ``max(2048, max_batch)`` tokens per step.

    It keeps the last :class:`PagedEngine` it built (its KV cache and decode graphs) and reuses
    it for a call on the same model with the same sampling and batch whose requests fit its
    ``max_len``; otherwise it builds one sized for the call, as :func:`generate_paged` does.

    Example::

        engine = PagedRollout(RolloutOptions(page_size=16))
        for step in range(steps):
            ro = engine.generate(model, prompts, 512, seeds)  # the cache and graphs built once
    """

    name = "paged"

    def __init__(self, options: RolloutOptions | None = None) -> None:
        self.options = options or RolloutOptions()
        self._kept: PagedEngine | None = None

    def unavailable(self, device: torch.device) -> str | None:
        return None  # any torch device: CUDA graphs on a GPU, eager steps elsewhere

    def stock_twin(self, model, device) -> None:
        return None  # paged attention on a paged cache is rlk's: stock transformers has none

    def generate(self, model, prompts, new_tokens, seeds, *, temperature=1.0, top_k=0,
                 top_p=1.0, eos_token_id=None, progress=None) -> RolloutResult:  # fmt: skip
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        max_len = max((len(p) for p in prompts), default=1) + max(new_tokens, 0)
        max_batch = self.options.max_batch or max(1, len(prompts))
        sample_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        kept = self._kept
        if not (kept is not None and kept.model is model and kept.sample_kw == sample_kw
                and kept.max_batch == max_batch and kept.max_len >= max_len):  # fmt: skip
            kept = self._kept = None  # the old cache is freed before the next one is allocated
            kept = self._kept = PagedEngine(
                model, max_len=max_len, page_size=self.options.page_size, max_batch=max_batch,
                max_step_tokens=max(2048, max_batch),
                fuse_projections=self.options.fuse_projections, **sample_kw,
            )  # fmt: skip
        return kept.generate(
            prompts, new_tokens, seeds=seeds, eos_token_id=eos_token_id,
            progress=progress if progress is not None else False,
        )  # fmt: skip
