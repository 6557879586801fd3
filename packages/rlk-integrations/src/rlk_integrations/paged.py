"""Rollout with a paged KV cache and continuous batching, attention by :func:`rlk.paged_attention`.

:func:`generate_paged` is the second rollout mode beside the padded batch of
:func:`rlk_integrations.rollout.generate`, with the same result type and the same sampling
(request seed, RNG offset = the token's position), so a request gets the very same tokens and
log-probabilities in either mode, alone or with any other requests, and the training recompute
(:mod:`rlk_integrations.training`) equals them bit for bit.

Pieces:

- :class:`PageAllocator`: a free list of page ids (lowest id first).
- :class:`PagedKVCache`: per layer, ``k``/``v`` caches ``[pages, page_size, Hk, D]`` and the
  metadata of the current step (``slots``, ``block_table``, ``seq_lens``, ``cu_seqlens_q``).
  The patched attention (:mod:`rlk_integrations.transformers`) sees it as ``past_key_values``
  and hands it the layer's new ``q [T, Hq, D]``, ``k``/``v [T, Hk, D]``; :meth:`attend` writes
  ``k``/``v`` into their slots and calls :func:`rlk.paged_attention`. Nothing in it reads a
  device value on the host.
- :class:`PagedEngine`: the cache and the decode graphs, kept across its :meth:`generate
  <PagedEngine.generate>` calls; :func:`generate_paged` builds one for a single call.
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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import rlk
from rlk._validate import validate_requested
from rlk_integrations.rollout import RolloutResult, Sample
from rlk_integrations.tp import local_kv_heads
from rlk_integrations.transformers import graph_reads


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
        attend ``q [T, Hq, D]`` to each sequence's cached tokens. Returns ``[T, Hq, D]``."""
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        _, _, hk, d = kc.shape
        kc.view(-1, hk, d).index_copy_(0, self.slots, k)
        vc.view(-1, hk, d).index_copy_(0, self.slots, v)
        return rlk.paged_attention(
            q, kc, vc, self.block_table, self.seq_lens, self.cu_seqlens_q, scale=scale
        )


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


def _forward_packed(base: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache):
    """The decoder layers on one packed row: ``ids``/``positions`` int64 ``[T]`` -> ``[T, H]``
    final hidden states (after the last norm). The rotary rows are taken from the patched rotary
    table (already built up to the largest position, so no lookup reads the device). Each
    layer's closing residual add is fused into the next RMSNorm, the final norm for the last
    layer (:func:`rlk_integrations.transformers.layer_step`: the same bits)."""
    from rlk_integrations.transformers import layer_step

    cos, sin = base.rotary_emb._rlk_table.lookup(positions)
    h, residual = base.embed_tokens(ids[None]), None
    for layer in base.layers:
        h, residual = layer_step(
            layer,
            h,
            residual,
            attention_mask=None,
            position_ids=positions[None],
            past_key_values=cache,
            use_cache=True,
            position_embeddings=(cos[None], sin[None]),
        )
    norm = base.norm
    if residual is None:  # no layers
        return norm(h)[0]
    return rlk.rms_norm(h, norm.weight, norm.variance_epsilon, residual=residual)[0][0]


@dataclass
class _Launched:
    """A launched decode step: its tokens ``[rows]`` (pinned host memory, valid once ``ready``
    has completed; on the device when ``ready`` is None) and float32 log-probabilities on the
    device."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    ready: torch.cuda.Event | None

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist()


class _DecodeGraphs:
    """The decode-only step (every running request adds its last token) as CUDA graphs.

    A step of ``b`` requests runs in the graph of the smallest bucket ``B >= b`` (powers of
    two up to ``max_batch``), whose extra rows are padding: token 0 at position 0, written to a
    slot of their own in the reserved pages ``num_pages ...`` (the cache holds
    ``num_pages + pad_pages(max_batch, page_size)`` pages), attending to one cached token. Every
    op is batch-invariant and attention is per sequence, so a real row's bits do not depend on
    the padding: the graph gives the eager step's tokens and log-probabilities exactly.

    The step's inputs live in static buffers that each step overwrites (two host-to-device
    copies). A row's input token is either given by the host or, when the host has not read
    it yet, taken on the device from the tokens the previous step sampled (``src``, that
    step's row; every step leaves its tokens in ``prev``): so the host can launch step n + 1
    before it reads step n's tokens, which arrive in pinned host memory behind step n (an event
    marks them), so reading them waits for step n alone. A bucket's graph is captured the
    first time a step needs it, after one eager run on a side stream (Triton compiles there).
    With ``capture=False`` the padded step runs eagerly: the same arithmetic without graphs, for
    machines without CUDA and for tests.
    """

    def __init__(self, model, cache: PagedKVCache, *, num_pages: int, width: int, max_batch: int,
                 sample_kw: dict, lp_temperature: float, capture: bool) -> None:  # fmt: skip
        from rlk_integrations.transformers import decoder

        self.model, self.base, self.cache = model, decoder(model), cache
        self.page_size, self.num_pages, self.width = cache.page_size, num_pages, width
        self.max_batch, self.sample_kw, self.lp_temperature = max_batch, sample_kw, lp_temperature
        self.capture = capture
        device = cache.k[0].device
        B = max_batch
        # ids, positions, slots, sample offsets, seeds, src | cu_seqlens_q, seq_lens, block table
        self.i64 = torch.zeros(6, B, dtype=torch.int64, device=device)
        self.prev = torch.zeros(B, dtype=torch.int64, device=device)  # the last step's tokens
        self.i32 = torch.zeros(2 * B + 1 + B * width, dtype=torch.int32, device=device)
        self.views: dict[int, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.logits_dtype: torch.dtype | None = None
        # capture=False: the eager step's outputs are copied here, as the graph's stay in place.
        self.eager_tok = torch.zeros(B, dtype=torch.int64, device=device)
        self.eager_lp = torch.zeros(B, dtype=torch.float32, device=device)

    def bucket(self, b: int) -> int:
        return min(1 << (b - 1).bit_length(), self.max_batch)

    def _views(self, B: int) -> tuple[torch.Tensor, ...]:
        """Bucket ``B``'s views of the static buffers, made once: the same tensor objects in
        the warm-up and in the capture. paged_attention sizes its grid from the longest query
        run of ``cu_seqlens_q``, a host read it remembers per tensor object and version, so the
        warm-up makes that read (one query per row) and the capture right after makes none."""
        if B not in self.views:
            ids, pos, slots, off, seeds, src = self.i64[:, :B]
            cu = self.i32[: B + 1]
            lens = self.i32[self.max_batch + 1 : self.max_batch + 1 + B]
            start = 2 * self.max_batch + 1
            table = self.i32[start : start + B * self.width].view(B, self.width)
            self.views[B] = (ids, pos, slots, off, seeds, src, cu, lens, table)
        return self.views[B]

    def _step(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, slots, off, seeds, src, cu, lens, table = self._views(B)
        ids = torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)), ids)
        self.cache.set_step(slots, table, lens, cu)
        hidden = _forward_packed(self.base, ids, pos, self.cache)
        logits = self.model.get_output_embeddings()(hidden).contiguous()
        self.logits_dtype = logits.dtype
        tok = rlk.sample(logits, seeds, off, **self.sample_kw)
        self.prev[:B].copy_(tok)
        return tok, rlk.logprobs(logits, tok, temperature=self.lp_temperature)

    def _fill(self, rows: list[_Request], B: int, prev_row: dict[int, int]) -> None:
        ps, pad_page = self.page_size, self.num_pages
        ids, pos, slots, off, seeds, src, lens, table = [], [], [], [], [], [], [], []
        for r in rows:
            p = r.cached
            known = p < len(r.tokens)  # else the token is still on the device: prev_row's row
            ids.append(r.tokens[p] if known else 0)
            src.append(-1 if known else prev_row[id(r)])
            pos.append(p)
            slots.append(r.pages[p // ps] * ps + p % ps)
            off.append(p + 1)
            seeds.append(r.seed)
            lens.append(p + 1)
            table += r.pages + [0] * (self.width - len(r.pages))
        for j in range(len(rows), B):  # padding: a slot of its own in the reserved pages
            page = pad_page + j // ps
            ids.append(0)
            pos.append(0)
            slots.append(page * ps + j % ps)
            off.append(0)
            seeds.append(0)
            src.append(-1)
            lens.append(1)
            table += [page] * self.width
        i64 = torch.tensor([ids, pos, slots, off, seeds, src], dtype=torch.int64)
        i32 = torch.tensor(list(range(B + 1)) + lens + table, dtype=torch.int32)
        if self.capture:
            i64, i32 = i64.pin_memory(), i32.pin_memory()
        self.i64[:, :B].copy_(i64, non_blocking=True)
        self.i32[: B + 1].copy_(i32[: B + 1], non_blocking=True)
        self.i32[self.max_batch + 1 : self.max_batch + 1 + B].copy_(
            i32[B + 1 : 2 * B + 1], non_blocking=True
        )
        start = 2 * self.max_batch + 1
        self.i32[start : start + B * self.width].copy_(i32[2 * B + 1 :], non_blocking=True)

    def _graph(self, B: int):
        if B not in self.graphs:
            self._fill([], B, {})  # all rows padding: the warm-up writes the reserved pages only
            prev = self.prev.clone()  # the warm-up overwrites the tokens the next step may read
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(B)
            torch.cuda.current_stream().wait_stream(side)
            self.prev.copy_(prev)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    tok, lp = self._step(B)
            except RuntimeError as e:
                raise RuntimeError(
                    "generate_paged could not capture its decode step in a CUDA graph (an op "
                    "read a device value on the host: RLK_VALIDATE=1 does); unset RLK_VALIDATE "
                    f"or pass cuda_graphs=False. Cause: {e}"
                ) from e
            self.graphs[B] = (graph, tok, lp)
        return self.graphs[B]

    def run(self, rows: list[_Request], prev_row: dict[int, int]) -> _Launched:
        """Launch one decode step of ``rows``. ``prev_row``: ``id(request) -> row`` of the
        previous step, for the requests whose input token the host has not read."""
        B = self.bucket(len(rows))
        n = len(rows)
        if self.capture:
            graph, tok, lp = self._graph(B)
            self._fill(rows, B, prev_row)
            graph.replay()
        else:
            # Through static outputs like the graph's, so that the CPU tests see what the next
            # step overwrites.
            self._fill(rows, B, prev_row)
            step_tok, step_lp = self._step(B)
            tok, lp = self.eager_tok[:B].copy_(step_tok), self.eager_lp[:B].copy_(step_lp)
        lp = lp[:n].to(torch.float32, copy=True)  # the next step overwrites lp
        if not self.capture:
            return _Launched(tok[:n].clone(), lp, None)
        # The tokens go to pinned host memory right behind the step, and the event marks their
        # arrival: reading them waits for this step only, not for a step launched after it (a
        # plain .tolist() would sync the stream, the next step included).
        host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        host.copy_(tok[:n], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(host, lp, ready)


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
    import sys

    if callable(progress) or progress is False:
        return None
    if progress is None and not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="rollout", leave=False, file=sys.stderr)


def pad_pages(max_batch: int, page_size: int) -> int:
    """Pages :class:`_DecodeGraphs` reserves for the padding rows of a decode step."""
    return _cdiv(max_batch, page_size)


def _eager_step(model, base, cache, batch, sample_kw: dict, lp_temperature: float, pin: bool):
    """One step of any composition, eagerly: ``batch`` is ``(request, new tokens)`` pairs.
    Returns the requests that sampled, their tokens (a list), float32 log-probabilities and the
    logits' dtype (None, None for a step that samples nothing)."""
    page_size, device = cache.page_size, cache.k[0].device
    # Host-side metadata, moved to the device in two copies.
    ids, pos, slots, cu, lens, rows, offsets, row_seeds = [], [], [], [0], [], [], [], []
    sampled: list[_Request] = []
    for r, take in batch:
        for p in range(r.cached, r.cached + take):
            ids.append(r.tokens[p])
            pos.append(p)
            slots.append(r.pages[p // page_size] * page_size + p % page_size)
        cu.append(cu[-1] + take)
        lens.append(r.cached + take)
        if r.cached + take == len(r.tokens):  # all known tokens cached: sample the next
            sampled.append(r)
            rows.append(cu[-1] - 1)
            offsets.append(len(r.tokens))
            row_seeds.append(r.seed)
    width = max(len(r.pages) for r, _ in batch)
    table = [r.pages + [0] * (width - len(r.pages)) for r, _ in batch]
    i64 = torch.tensor(ids + pos + slots + rows + offsets + row_seeds, dtype=torch.int64)
    i32 = torch.tensor(cu + lens + [p for t in table for p in t], dtype=torch.int32)
    if pin:
        i64, i32 = i64.pin_memory(), i32.pin_memory()
    i64 = i64.to(device, non_blocking=True)
    i32 = i32.to(device, non_blocking=True)
    t, b, m = len(ids), len(batch), len(sampled)
    ids_d, pos_d, slots_d, rows_d, off_d, seeds_d = i64.split([t, t, t, m, m, m])
    cu_d, lens_d, table_d = i32.split([b + 1, b, b * width])
    cache.set_step(slots_d, table_d.view(b, width), lens_d, cu_d)

    hidden = _forward_packed(base, ids_d, pos_d, cache)
    if not sampled:
        return sampled, [], None, None
    logits = model.get_output_embeddings()(hidden.index_select(0, rows_d)).contiguous()
    tok = rlk.sample(logits, seeds_d, off_d, **sample_kw)
    lp = rlk.logprobs(logits, tok, temperature=lp_temperature)
    return sampled, tok.tolist(), lp.float(), logits.dtype  # tolist: the step's one device read


class PagedEngine:
    """A rollout engine on a paged KV cache that keeps its cache and CUDA graphs between calls.

    :func:`generate_paged` builds one for a single call; an RL loop that samples every step
    builds one and calls :meth:`generate` each step, so that the cache is allocated and the
    decode graphs are captured once (as a serving engine does at start-up). The results are the
    bits :func:`generate_paged` gives, and the padded rollout's.

    ``model``: a causal LM patched by :func:`rlk_integrations.transformers.patch_model`.
    ``max_len``: the longest request served, prompt plus new tokens; it sets the pages per
    request (``ceil((max_len - 1) / page_size)``), the width of the graphs' block tables and
    the rotary table. Sampling (``temperature``, ``top_k``, ``top_p``) is fixed per engine:
    the graphs capture it. ``page_size``, ``max_batch``, ``num_pages``,
    ``kv_memory_fraction``, ``max_step_tokens``, ``prefill_chunk`` and ``cuda_graphs`` are
    :func:`generate_paged`'s; the default ``num_pages`` holds ``max_batch`` requests of
    ``max_len`` tokens.

    The cache (``num_pages`` pages) stays allocated while the engine lives. The graphs read the
    model's weights where they were at capture: updating them in place (an optimizer step,
    ``load_state_dict``) is fine; when a parameter, a buffer or the rotary table has moved,
    :meth:`generate` captures the graphs again.

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
    ) -> None:
        from rlk_integrations.transformers import decoder, is_patched

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
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA model, this one is on {device.type}")
        dtype = next(model.parameters()).dtype
        # The last sampled token never enters the cache: a request caches at most max_len - 1.
        width = max(1, _cdiv(max_len - 1, page_size))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
        self.lp_temperature = temperature if temperature > 0 else 1.0
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
        from rlk_integrations.transformers import is_patched

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
) -> RolloutResult:
    """Sample up to ``max_new_tokens`` per prompt with continuous batching on a paged KV cache.

    ``model``: a causal LM patched by :func:`rlk_integrations.transformers.patch_model`.
    ``seeds`` as in :func:`rlk_integrations.rollout.generate` (default ``i``); the token at
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

    ``progress``: ``None`` (default) draws a progress bar on stderr (tokens, tokens/s, running
    and waiting requests) when stderr is a terminal; ``True`` always, ``False`` never; a
    callable gets a line every 16 steps instead.

    Each call builds a :class:`PagedEngine` (the cache, and the graphs on first use); a loop
    that samples again and again keeps one engine instead.

    Returns a :class:`~rlk_integrations.rollout.RolloutResult` (samples in prompt order);
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
        prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    return engine.generate(
        prompts, max_new_tokens, seeds=seeds, eos_token_id=eos_token_id, progress=progress
    )
