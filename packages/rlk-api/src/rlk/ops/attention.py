"""Attention: ``attention`` (packed varlen, training and prefill) and ``paged_attention``
(rollout decode against paged KV caches); argument checks, then the selected backend.
"""

from __future__ import annotations

import math

import torch

from rlk import _validate as chk
from rlk import selection
from rlk._catalog import Operator, op
from rlk.ops._common import _call, f32

#: The ops declared here (``rlk`` exports them).
__all__ = ["attention", "paged_attention"]


def _check_qkv_heads(q: torch.Tensor, hk: int, d: int, kname: str) -> None:
    if q.shape[2] != d:
        raise ValueError(f"q's head dim {q.shape[2]} differs from {kname}'s head dim {d}")
    if d == 0:  # (and the default scale 1/sqrt(D) would divide by zero)
        raise ValueError(f"q's and {kname}'s head dim must be > 0, got q of shape {tuple(q.shape)}")
    if hk == 0 or q.shape[1] % hk:
        raise ValueError(
            f"q's {q.shape[1]} heads must be a multiple of {kname}'s {hk} KV heads (GQA/MQA)"
        )


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else chk.positive_float("scale", scale)


@op(
    "attention",
    grad_args=("q", "k", "v"),
    unit_grads=("q", "k", "v"),
    operator=Operator(
        "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, "
        "float scale, SymInt? max_seqlen_q, SymInt? max_seqlen_k",
        outputs=lambda a: [torch.empty_like(a["q"])],
        # each query row's log-sum-exp (natural log) of the scaled scores, [Tq, Hq]
        extras=lambda a: [f32(a["q"].shape[0], a["q"].shape[1], like=a["q"])],
        saved_outputs=lambda a: (0,),
        omitted_if_none=("max_seqlen_q", "max_seqlen_k"),
        packed_grads=True,  # the backward fills one buffer for dq, dk and dv
    ),
)
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
) -> torch.Tensor:
    """Variable-length (packed) multi-head attention with GQA/MQA.

    Shapes: ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hk, D]`` with ``Hq % Hk == 0``;
    ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B + 1]`` offsets of each sequence.
    Sequence ``b`` has ``nq = cu_q[b+1] - cu_q[b]`` queries and ``nk >= nq`` keys; its queries
    are its *last* ``nq`` tokens (bottom-right aligned), which covers training (nq == nk),
    prefill, chunked prefill and decode (nq == 1). Returns ``[Tq, Hq, D]`` in q's dtype.
    ``scale`` defaults to ``1/sqrt(D)``.

    ``max_seqlen_q``/``max_seqlen_k`` (ints >= 1, both or neither): upper bounds on the
    sequences' query and key counts. Without them a GPU backend reads the longest sequence
    from the offsets, a host synchronisation; with them it sizes its grids from the bounds and
    reads nothing, so the call can be captured in a CUDA graph. Looser bounds cost idle
    programs, never bits. A sequence longer than its bound is an error: a ``ValueError`` where
    values are checked (CPU, ``RLK_VALIDATE``), else a device-side assertion.

    Contract: a query's output depends only on its own sequence's keys up to its position; KV
    is processed in fixed-size tiles aligned to the sequence's position 0, in ascending order,
    so training, prefill, chunked prefill, decode and :func:`paged_attention` give the same bits.
    Backward is deterministic without atomics.

    Example::

        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        o = rlk.attention(q, k, v, cu, cu)   # two packed causal sequences of 5 and 7 tokens
    """
    chk.tensor("q", q, dtypes=chk.FLOAT_DTYPES, ndim=3)
    chk.tensor("k", k, dtypes=chk.FLOAT_DTYPES, ndim=3)
    chk.tensor("v", v, dtypes=chk.FLOAT_DTYPES, ndim=3)
    chk.tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    chk.tensor("cu_seqlens_k", cu_seqlens_k, dtypes=(torch.int32,), ndim=1)
    device = chk.same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    chk.same_dtype(q=q, k=k, v=v)
    chk.shape("v", v, k.shape, "the shape of k")
    _check_qkv_heads(q, k.shape[1], k.shape[2], "k")
    causal = chk.flag("causal", causal)
    cu_q = chk.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0]")
    cu_k = chk.cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0]")
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}"
        )
    if chk.value_checks_enabled(cu_q) and bool(
        ((cu_q[1:] - cu_q[:-1]) > (cu_k[1:] - cu_k[:-1])).any()
    ):
        raise ValueError("a sequence has more queries than keys (cu_seqlens_q vs cu_seqlens_k)")
    if (max_seqlen_q is None) != (max_seqlen_k is None):
        raise ValueError("give both max_seqlen_q and max_seqlen_k, or neither")
    bounds = {}  # passed only when given: a backend without them keeps its signature
    if max_seqlen_q is not None:
        bounds["max_seqlen_q"] = chk.length_bound("max_seqlen_q", max_seqlen_q, cu_q)
        bounds["max_seqlen_k"] = chk.length_bound("max_seqlen_k", max_seqlen_k, cu_k)
    scale = _scale(scale, q.shape[2])
    return _call("attention", device, q, k, v, cu_q, cu_k, causal, scale, **bounds)


@op(
    "paged_attention",
    operator=Operator(
        "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor cu_seqlens_q, float scale, Tensor? k_new, Tensor? v_new, Tensor? slots",
        outputs=lambda a: [torch.empty_like(a["q"])],
        omitted_if_none=("k_new", "v_new", "slots"),
    ),
)
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
) -> torch.Tensor:
    """Causal attention of new queries against a paged KV cache; the same bits as :func:`attention`.

    Shapes: ``q [Tq, Hq, D]``; ``k_cache``/``v_cache [pages, page_size, Hk, D]``;
    ``block_table`` int32 ``[B, max_pages]`` (page ids of each sequence in order);
    ``seq_lens`` int32 ``[B]``: cached tokens of each sequence *including* its new ones;
    ``cu_seqlens_q`` int32 ``[B + 1]``: the new queries, the last tokens of each sequence.
    Returns ``[Tq, Hq, D]``.

    The caches may be strided views (any page, token and head strides; ``D`` contiguous), such
    as the key and value halves of a serving engine's blocks.

    With ``k_new``/``v_new [Tn, Hk, D]`` (any token and head strides, ``D`` contiguous) and
    ``slots`` int64 ``[Tn]`` the call first stores row ``i`` of each at flat slot ``slots[i]``
    (``page * page_size + offset``) of its cache, an exact copy, then attends: the step's new
    keys and values enter the cache and the attention in one call (backends may write both
    caches in one launch). The slots must be distinct and in ``[0, pages * page_size)``; one out
    of range is never written and fails like a bad page id.

    Contract: bitwise equal to :func:`attention` on the same logical sequence, whatever the page
    size, the page order in memory, the caches' strides, or the batch.

    Example::

        o = rlk.paged_attention(q, kc, vc, block_table, seq_lens, cu_q)   # decode: 1 query/seq
        o = rlk.paged_attention(q, kc, vc, block_table, seq_lens, cu_q, k_new=k, v_new=v,
                                slots=slots)                   # the step's K/V stored first
    """
    chk.tensor("q", q, dtypes=chk.FLOAT_DTYPES, ndim=3)
    # A cache may be a strided view (a serving engine's blocks holding keys and values side by
    # side): the kernels read its page, token and head strides; head_dim must be contiguous.
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        chk.tensor(name, cache, dtypes=chk.FLOAT_DTYPES, ndim=4, contiguous=False)
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) dimension")
    chk.tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    chk.tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    chk.tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    device = chk.same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
    )
    chk.same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    chk.shape("v_cache", v_cache, k_cache.shape, "the shape of k_cache")
    pages, page_size, hk, d = k_cache.shape
    _check_qkv_heads(q, hk, d, "k_cache")
    b = block_table.shape[0]
    chk.shape("seq_lens", seq_lens, (b,), "[B] of block_table")
    cu_q = chk.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0]")
    chk.shape("cu_seqlens_q", cu_q, (b + 1,), "[B + 1] of block_table")
    if chk.value_checks_enabled(seq_lens):
        nq = cu_q[1:] - cu_q[:-1]
        if bool((seq_lens < nq).any()):
            raise ValueError("seq_lens must count the new tokens too: seq_lens[b] >= queries of b")
        cap = block_table.shape[1] * page_size
        if b and int(seq_lens.max()) > cap:
            raise ValueError(
                f"seq_lens has {int(seq_lens.max())} tokens but block_table holds at most {cap} "
                f"({block_table.shape[1]} pages of {page_size})"
            )
        used = torch.arange(block_table.shape[1], device=seq_lens.device)[None, :] * page_size
        in_use = used < seq_lens[:, None]
        chk.index_range("block_table", block_table[in_use], 0, pages, f"pages of k_cache: {pages}")
    new = _check_new_kv(k_new, v_new, slots, k_cache)
    if new and selection._compiling():
        # torch.ops.rlk.paged_attention writes nothing: the stores as torch ops in the graph.
        _store_slots(k_cache, k_new, slots)
        _store_slots(v_cache, v_new, slots)
        new = {}
    return _call(
        "paged_attention",
        device,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        cu_q,
        _scale(scale, d),
        **new,
    )


def _check_new_kv(
    k_new: object, v_new: object, slots: object, k_cache: torch.Tensor
) -> dict[str, torch.Tensor]:
    """:func:`paged_attention`'s ``k_new``, ``v_new`` and ``slots`` checked, as the keywords to
    pass a backend ({} when none is given)."""
    given = [
        name for name, t in (("k_new", k_new), ("v_new", v_new), ("slots", slots)) if t is not None
    ]
    if not given:
        return {}
    if len(given) != 3:
        raise ValueError(f"give k_new, v_new and slots together, or none of them (got {given})")
    pages, page_size, hk, d = k_cache.shape
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        chk.tensor(name, t, dtypes=chk.FLOAT_DTYPES, ndim=3, contiguous=False)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) dimension")
        chk.same_dtype(k_cache=k_cache, **{name: t})
    chk.tensor("slots", slots, dtypes=(torch.int64,), ndim=1)
    tn = k_new.shape[0]
    chk.shape("k_new", k_new, (tn, hk, d), f"[Tn, Hk, D] with Hk={hk}, D={d} of k_cache")
    chk.shape("v_new", v_new, (tn, hk, d), "the shape of k_new")
    chk.shape("slots", slots, (tn,), "[Tn] of k_new")
    chk.same_device(k_cache=k_cache, k_new=k_new, v_new=v_new, slots=slots)
    chk.index_range("slots", slots, 0, pages * page_size, f"slots of k_cache: {pages * page_size}")
    if chk.value_checks_enabled(slots) and slots.unique().numel() != tn:
        raise ValueError("slots must be distinct (two new tokens in one slot)")
    return {"k_new": k_new, "v_new": v_new, "slots": slots}


def _store_slots(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    page_size = cache.shape[1]
    cache[slots // page_size, slots % page_size] = new
