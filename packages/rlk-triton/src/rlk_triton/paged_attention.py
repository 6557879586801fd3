"""Paged attention (rollout decode and prefill): ``paged_attention``, bitwise equal to
:func:`rlk_triton.attention.attention` on the same logical sequences.

The kernel is the forward of :mod:`rlk_triton.attention_fwd` (``PAGED``): it gathers each KV
tile's keys by logical position through the block table and feeds the same tiles to the
same arithmetic; that module's docstring says why every path gives the same bits. This
module holds the paged op's tuning rules and its public function.
"""

from __future__ import annotations

import math

import torch

from rlk_triton import _bounds, tuning
from rlk_triton import attention_fwd as _fwd
from rlk_triton._triton import jit, next_power_of_2, tl
from rlk_triton.attention import _FWD_CONFIGS, _long_rows
from rlk_triton.attention_fwd import _forward

#: Decode grids of fewer programs than this run a program per KV split (the SPLIT config) once
#: a sequence may hold more than ``attention_fwd.KV_SPLIT`` keys. H200, ctx 8192, page 16, us, a
#: program per split against one program running its splits: 128 programs (B = 16, 8 KV heads,
#: head_dim 128; B = 64, 2 KV heads, 64) 163.6 / 218.0 and 120.4 / 193.2; 512 programs (B = 64,
#: 8 KV heads, 128; B = 256, 2 KV heads, 64) 599.5 / 590.3 and 366.2 / 321.0.
SPLIT_BELOW_PROGRAMS = 264
_SPLIT = next(i for i, c in enumerate(_FWD_CONFIGS) if c.get("SPLIT"))


def _choose_paged(rows: int, head_dim: int, programs: int, keys: int = 0, **_: int) -> int:
    # programs: sequences x KV heads, the decode grid's size; keys: the bound on any
    # sequence's keys (_forward passes both).
    if head_dim > 128:
        return 1
    if rows >= 1024:
        return _long_rows(head_dim)
    if keys > _fwd.KV_SPLIT and programs < SPLIT_BELOW_PROGRAMS:
        return _SPLIT
    # Decode, H200 (scripts/kernel_sweep.py paged; B = 64, ctx 4096 at head_dim 128, B = 256,
    # ctx 2048 at 64): 5 stages at head_dim 128 (page 128: 290 -> 280 us, page 16: 289 ->
    # 287); at 64, 3 stages with registers capped at 128 per thread (4 programs per SM instead
    # of 2; 24 bytes spilled): 107.4 -> 80.8 us. A grid of a few programs (one per SM at
    # most) gains nothing from more programs per SM or a deeper pipeline: 3 stages without a
    # cap (B = 1, ctx 8192, head_dim 128, 8 programs: 205.2 -> 190.5 us; B = 8, ctx 512,
    # head_dim 64, 16 programs: 14.9 -> 14.4 us). Grids of 17 to 511 programs were not timed.
    if programs <= 16:
        return 3
    return 8 if head_dim > 64 else 7


TUNING = {"paged_attention.fwd": tuning.Rule(configs=_FWD_CONFIGS, choose=_choose_paged)}

#: Under the Triton interpreter (CPU): the largest tiles (its cost is per program and per op).
CPU_TUNING = {"paged_attention.fwd": tuning.Rule(configs=_FWD_CONFIGS, choose=lambda **_: 0)}


@jit
def _store_kernel(
    K, V, KC, VC, SLOTS, OK, n_slots, page_size, hk, d,
    skt, skh, svt, svh, kcp, kct, kch, vcp, vct, vch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Program t copies row t of K and of V ([Tn, Hk, D], D contiguous) into flat slot SLOTS[t]
    # of each cache (page = slot // page_size, token = slot % page_size; any strides, D
    # contiguous). A slot outside [0, n_slots) is never used as an address: it clears OK.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t)
    in_range = (slot >= 0) & (slot < n_slots)
    if ~in_range:
        tl.store(OK, 0)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]
    slots = slot + 0 * h  # [BLOCK_H, 1]: the mask is built of tensors (a scalar would do on GPU)
    mask = (h < hk) & (slots >= 0) & (slots < n_slots) & (c < d)
    slot = tl.where(in_range, slot, 0)
    page, tok = slot // page_size, slot % page_size
    k = tl.load(K + t * skt + h * skh + c, mask=mask)
    tl.store(KC + page * kcp + tok * kct + h * kch + c, k, mask=mask)
    v = tl.load(V + t * svt + h * svh + c, mask=mask)
    tl.store(VC + page * vcp + tok * vct + h * vch + c, v, mask=mask)


def _store(k_new, v_new, slots, k_cache, v_cache) -> torch.Tensor:
    """Stores ``k_new``/``v_new [Tn, Hk, D]`` at flat ``slots`` of the caches in one launch (an
    exact copy, so no launch parameter changes a bit); returns the bounds flag."""
    ok = _bounds.flag(k_cache.device)
    tn, hk, d = k_new.shape
    pages, page_size = k_cache.shape[:2]
    if tn:
        _store_kernel[(tn,)](
            k_new, v_new, k_cache, v_cache, slots, ok, pages * page_size, page_size, hk, d,
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            BLOCK_H=next_power_of_2(hk), BLOCK_D=next_power_of_2(d), num_warps=4,
        )  # fmt: skip
    return ok


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
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Causal attention of ``q [Tq, Hq, D]`` against paged caches ``[pages, page_size, Hk, D]``
    (``block_table`` int32 ``[B, max_pages]``, ``seq_lens`` int32 ``[B]`` including the new
    tokens, ``cu_seqlens_q`` int32 ``[B + 1]``) -> ``[Tq, Hq, D]``; bitwise equal to
    :func:`attention` on the same logical sequences. Forward only.

    With ``k_new``/``v_new [Tn, Hk, D]`` and ``slots`` int64 ``[Tn]``: one launch stores them in
    their slots first (:func:`_store`).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs caches with a contiguous head_dim")
    if k_new is not None:
        ok = _store(k_new, v_new, slots.contiguous(), k_cache, v_cache)
        # On a GPU the flag is the device's one, which the attention's report below covers (no
        # second assertion kernel); a CPU call's flag is its own, read now.
        if ok is not _bounds.flag(ok.device) or q.shape[0] == 0:
            n = k_cache.shape[0] * k_cache.shape[1]
            _bounds.report(ok, f"paged_attention: a new token's slot outside [0, {n})")
    q = q.contiguous()
    o, _ = _forward(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q.contiguous(),
        None,
        seq_lens.contiguous(),
        block_table.contiguous(),
        True,
        float(scale),
        "paged_attention.fwd",
        table,
        False,
    )
    return o
