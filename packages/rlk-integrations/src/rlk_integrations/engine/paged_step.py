"""One step of the paged rollout (:mod:`rlk_integrations.engine.paged`) on the device.

- :func:`forward_packed`: the decoder layers on one packed row of varlen queries.
- :func:`_eager_step`: a step of any composition (prompt chunks and decodes), run eagerly.
- :class:`_DecodeGraphs`: the decode-only step as CUDA graphs, padded to a power-of-two batch
  (eager with ``capture=False``), and :class:`_Launched`, a launched step whose tokens the host
  reads later.

The scheduler, the KV cache and the engine that own these steps are in
:mod:`rlk_integrations.engine.paged`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import rlk
from rlk_integrations.models.transformers import decoder, layer_step


def forward_packed(base: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache):
    """The decoder layers on one packed row: ``ids``/``positions`` int64 ``[T]`` -> ``[T, H]``
    final hidden states (after the last norm). The rotary rows are taken from the patched rotary
    table (already built up to the largest position, so no lookup reads the device). Each
    layer's closing residual add is fused into the next RMSNorm, the final norm for the last
    layer (:func:`rlk_integrations.models.transformers.layer_step`: the same bits)."""
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

    def __init__(self, model, cache, *, num_pages: int, width: int, max_batch: int,
                 sample_kw: dict, lp_temperature: float, capture: bool) -> None:  # fmt: skip
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
        hidden = forward_packed(self.base, ids, pos, self.cache)
        logits = self.model.get_output_embeddings()(hidden).contiguous()
        self.logits_dtype = logits.dtype
        tok = rlk.sample(logits, seeds, off, **self.sample_kw)
        self.prev[:B].copy_(tok)
        return tok, rlk.logprobs(logits, tok, temperature=self.lp_temperature)

    def _fill(self, rows: list, B: int, prev_row: dict[int, int]) -> None:
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

    def run(self, rows: list, prev_row: dict[int, int]) -> _Launched:
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


def _eager_step(model, base, cache, batch, sample_kw: dict, lp_temperature: float, pin: bool):
    """One step of any composition, eagerly: ``batch`` is ``(request, new tokens)`` pairs.
    Returns the requests that sampled, their tokens (a list), float32 log-probabilities and the
    logits' dtype (None, None for a step that samples nothing)."""
    page_size, device = cache.page_size, cache.k[0].device
    # Host-side metadata, moved to the device in two copies.
    ids, pos, slots, cu, lens, rows, offsets, row_seeds = [], [], [], [0], [], [], [], []
    sampled: list = []
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

    hidden = forward_packed(base, ids_d, pos_d, cache)
    if not sampled:
        return sampled, [], None, None
    logits = model.get_output_embeddings()(hidden.index_select(0, rows_d)).contiguous()
    tok = rlk.sample(logits, seeds_d, off_d, **sample_kw)
    lp = rlk.logprobs(logits, tok, temperature=lp_temperature)
    return sampled, tok.tolist(), lp.float(), logits.dtype  # tolist: the step's one device read
