"""Varlen attention and paged attention: one sequence at a time, plain softmax in float64."""

from __future__ import annotations

import torch

#: The ops this module holds (``rlk_reference`` exports them).
__all__ = ["attention", "paged_attention"]

# Scores of one query chunk are [Hq, chunk, nk] float64; this bounds them to ~128 MiB.
_MAX_SCORE_ELEMENTS = 1 << 24


def _attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """One sequence: ``q [nq, Hq, D]``, ``k``/``v [nk, Hk, D]`` -> float64 ``[nq, Hq, D]``.

    The queries are the last ``nq`` of the ``nk`` tokens: query ``i`` sits at position
    ``nk - nq + i`` and, when causal, sees keys ``0..nk - nq + i``. Query head ``h`` reads KV head
    ``h // (Hq // Hk)``.
    """
    nq, hq, _ = q.shape
    nk, hk, _ = k.shape
    group = hq // hk
    k = k.double().repeat_interleave(group, dim=1)  # [nk, Hq, D]
    v = v.double().repeat_interleave(group, dim=1)
    q = q.double()
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, hq * nk))
    key_pos = torch.arange(nk, device=q.device)
    outs = []
    for start in range(0, nq, chunk):
        qc = q[start : start + chunk]
        # Keys after the chunk's last query are invisible to all of it under causal masking.
        end = nk - nq + start + qc.shape[0] if causal else nk
        scores = torch.einsum("qhd,khd->hqk", qc, k[:end]) * scale
        if causal:
            q_pos = nk - nq + torch.arange(start, start + qc.shape[0], device=q.device)
            visible = key_pos[None, :end] <= q_pos[:, None]  # [chunk, end]
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v[:end]))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0)


def _check_bound(name: str, bound: int | None, cu: torch.Tensor) -> None:
    if bound is not None and cu.numel() > 1 and int((cu[1:] - cu[:-1]).max()) > bound:
        raise ValueError(f"a sequence is longer than {name} = {bound}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    table=None,
) -> torch.Tensor:
    """Packed varlen attention: ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hk, D]``, int32 ``[B + 1]``
    offsets; each sequence's queries are its last tokens. Returns ``[Tq, Hq, D]`` in q's dtype.
    The length bounds ``max_seqlen_*`` size nothing here (the offsets are read); a sequence
    longer than one is a ``ValueError``."""
    _check_bound("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    _check_bound("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    outs = [q.new_zeros((0, *q.shape[1:]), dtype=torch.float64)]
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        outs.append(_attend_one(q[qs:qe], k[ks:ke], v[ks:ke], causal, scale))
    return torch.cat(outs, dim=0).to(q.dtype)


def _store_slots(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """``cache[slot // page_size, slot % page_size] = new[i]`` for each ``slot = slots[i]``
    (an exact copy; ``cache [pages, page_size, Hk, D]`` may be a strided view)."""
    page_size = cache.shape[1]
    cache[slots // page_size, slots % page_size] = new


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    table=None,
) -> torch.Tensor:
    """Causal attention against a paged cache ``[pages, page_size, Hk, D]``: token ``j`` of
    sequence ``b`` lives at ``cache[block_table[b, j // page_size], j % page_size]``. Gathers
    each sequence's ``seq_lens[b]`` tokens and runs :func:`attention`'s math on them. With
    ``k_new``/``v_new [Tn, Hk, D]`` and ``slots`` int64 ``[Tn]``: stores row ``i`` of each at
    flat slot ``slots[i]`` of its cache first."""
    if k_new is not None:
        _store_slots(k_cache, k_new, slots)
        _store_slots(v_cache, v_new, slots)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    page_size = k_cache.shape[1]
    cu_q = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    outs = [q.new_zeros((0, *q.shape[1:]), dtype=torch.float64)]
    for b, n in enumerate(lens):
        pages = block_table[b, : (n + page_size - 1) // page_size].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        outs.append(_attend_one(q[cu_q[b] : cu_q[b + 1]], k, v, True, scale))
    return torch.cat(outs, dim=0).to(q.dtype)
