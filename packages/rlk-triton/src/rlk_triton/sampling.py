"""Seeded per-row sampling: temperature, top-k, top-p, Gumbel-max with Philox-4x32-10 noise.

A row's token depends only on its logits, seed, offset and parameters. With enough rows to
fill the GPU, one program per row does all of a row. With fewer (:data:`TUNING`), each step is
a launch: the block maxima and each pass of the threshold over (row, part) programs, a part
being :data:`PART_BLOCKS` blocks (or the launch config's ``part_blocks``), and the pick in
ranges of whole blocks, merged as one pass over the row would: the same token either way.

- Noise: ``u`` from Philox-4x32-10 exactly as :mod:`rlk_reference.philox` specifies (key = the
  seed's two 32-bit words, counter = ``(v, offset_lo, offset_hi, 0)``), ``g = -log(-log(u))``.
- Filters without sorting: both are thresholds on an order-preserving uint32 key of
  ``z = logit / temperature``. top-k: the largest key with ``count(key >= K) >= k`` (integer
  counts), i.e. the k-th largest z, ties kept (searched on the logits, then divided once: the
  division is monotone). top-p: the largest key with
  ``mass(key >= K) >= top_p * mass(all kept)``, a mass being the int64 sum of the fixed-point
  terms ``floor(exp(z - z_max) * 2**40)`` (:func:`_mass_terms`). Counts and masses are exact
  integers, so they have one value whatever adds them, in whatever order, and both can only
  shrink as K grows: any search for the largest K finds the same one.
- Pick: ``argmax(z + g)`` over the kept tokens, the lowest index among ties; temperature 0 is
  the lowest-index argmax of the logits.
- Block maxima. With a filter on, a first step writes each block's largest logit (as a key)
  to a scratch row; later steps read only the blocks that can matter, which changes no bit (a
  block with a NaN is never skipped). Top-k: the k-th largest block maximum is a floor below
  which no block holds a kept token (:func:`_topk_floor`).
- Two ways to the thresholds, one token. A top-k row gathers its few candidates (tokens at or
  above the floor, divided) and finds both thresholds and the pick on them in registers
  (:func:`_few_token`), when there are at most :data:`FEW_CAP`. Other rows take radix
  passes over the row, :data:`RADIX_BITS` bits of the key a pass, then the pick.
- A row with a NaN logit draws no token: its result is -1 (as on every backend). Nothing is
  synchronised for it; ``rlk.sample`` rejects NaN logits with ``ValueError`` where value checks
  run (CPU, or ``RLK_VALIDATE``).
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl

#: Vocabulary block of a pass (the unit that block maxima skip; no bit depends on it).
BLOCK = 512
#: Key bits resolved per radix pass (2**RADIX_BITS candidate thresholds counted per pass).
RADIX_BITS = 4
#: Radix passes per filter.
LEVELS = 32 // RADIX_BITS
#: The most candidates a top-k row may have for its token to be drawn from them alone
#: (:func:`_few_token`); a row with more takes the radix passes. 0: never.
FEW_CAP = 1024
#: Warps of the candidate step's program, unless the launch config's ``few_warps`` says (a
#: launch parameter: no bit depends on it).
FEW_WARPS = 4
#: Blocks the candidate step loads at once (a latency choice: no bit depends on it).
GATHER = tl.constexpr(8)
#: Blocks per part of a row: a program of the split threshold's passes reads one part. A power
#: of two, at most 32 (a part's blocks to read are the bits of one int64, :func:`_live_blocks`).
PART_BLOCKS = 16  # unless the launch config's ``part_blocks`` says

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)


@jit
def philox_uniform(v, seed, offset):
    """Uniforms in (0, 1) (fp32, exact) for vocabulary indices ``v`` (int32 tensor) of one row."""
    zero = tl.zeros(v.shape, tl.uint32)
    c0 = v.to(tl.uint32)
    c1 = zero + offset.to(tl.uint32)
    c2 = zero + (offset >> 32).to(tl.uint32)
    c3 = zero
    k0 = zero + seed.to(tl.uint32)
    k1 = zero + (seed >> 32).to(tl.uint32)
    m0 = tl.full(v.shape, PHILOX_M0, tl.uint32)
    m1 = tl.full(v.shape, PHILOX_M1, tl.uint32)
    w0 = tl.full(v.shape, PHILOX_W0, tl.uint32)
    w1 = tl.full(v.shape, PHILOX_W1, tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + w0
        k1 = k1 + w1
    # 2 * (x0 >> 9) + 1 < 2**24: exact in fp32, and the scaling by 2**-24 is exact too.
    return ((c0 >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08


@jit
def _key(z):
    """Order-preserving uint32 key of fp32 ``z`` (-0.0 is taken as +0.0)."""
    bits = tl.where(z == 0.0, 0.0, z).to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    return tl.where(neg, ~bits, bits | 0x80000000)


@jit
def _unkey(key):
    """The fp32 value of key ``key`` (the inverse of :func:`_key` on its image)."""
    bits = tl.where((key >> 31) == 1, key & 0x7FFFFFFF, ~key)
    return bits.to(tl.float32, bitcast=True)


#: Fixed point of the top-p masses: a token adds ``floor(exp(z - z_max) * MASS_SCALE)`` (int64).
#: The max adds 2**40 itself, so a mass of up to 2**22 tokens stays below 2**63 and is exact in
#: any order; a term's truncation costs under 2**-40 of that max's share.
MASS_SCALE = tl.constexpr(2.0**40)
#: The largest vocabulary whose masses cannot overflow (checked by :func:`sample`).
MAX_VOCAB = 2**22


@jit
def _mass_terms(z, z_max, on):
    """The top-p mass terms of ``z`` (fp32, the row's largest ``z_max``), int64: 0 off ``on``
    and for NaN; ``z == z_max`` adds exactly MASS_SCALE, infinities included."""
    e = tl.exp(tl.where(z == z_max, 0.0, z - z_max))
    return tl.where(on & (e == e), (e * MASS_SCALE).to(tl.int64), 0)


#: The block-maximum key of a block holding a NaN logit: above every key, so such a block is
#: never skipped (and its NaN is counted where it is loaded).
NAN_BLOCK = tl.constexpr(0xFFFFFFFF)
#: Blocks whose maxima the pick loads at once (the bits of one int64 mask).
PICK_SPAN = tl.constexpr(32)


@jit
def _block_maxima(row_ptr, V, b_lo, b_hi, maxima_ptr, BLOCK: tl.constexpr):
    """Blocks ``b_lo <= b < b_hi`` of the row: each block's largest logit as a key
    (:data:`NAN_BLOCK` for a block with a NaN) into ``maxima_ptr[b]`` (int32 bits)."""
    cols = tl.arange(0, BLOCK)
    for b in range(b_lo, b_hi):
        offs = b * BLOCK + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        has_nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
        key = tl.where(has_nan, NAN_BLOCK, _key(tl.max(x, axis=0)))
        tl.store(maxima_ptr + b, key.to(tl.int32, bitcast=True))


@jit
def _load_maxima(maxima_ptr, n_blocks, MAX_BLOCKS: tl.constexpr):
    """The row's block maxima keys ``[MAX_BLOCKS]`` (uint32), 0 past its ``n_blocks``."""
    b = tl.arange(0, MAX_BLOCKS)
    return tl.load(maxima_ptr + b, mask=b < n_blocks, other=0).to(tl.uint32, bitcast=True)


@jit
def _kth_largest_key(keys, k):
    """The largest key K with ``count(keys >= K) >= k`` (0 when fewer than k keys are above 0),
    by bisection, one bit a step from the top: the k-th largest of ``keys``."""
    found = tl.zeros([], tl.uint32)
    for bit in tl.static_range(32):
        cand = found | (tl.full([], 1, tl.uint32) << (31 - bit))
        found = tl.where(tl.sum((keys >= cand).to(tl.int32), axis=0) >= k, cand, found)
    return found


@jit
def _row_z_max(maxima_ptr, n_blocks, temperature, MAX_BLOCKS: tl.constexpr):
    """The row's largest z, i.e. its largest logit divided once (the division is monotone),
    from its block maxima."""
    keys = _load_maxima(maxima_ptr, n_blocks, MAX_BLOCKS)
    return tl.math.div_rn(_unkey(tl.max(keys, axis=0)), temperature)


@jit
def _may_count(block_max, low):
    """Whether a block can hold a key >= ``low``, the larger of the radix bucket's lowest key
    and the row's :func:`_topk_floor`: a block whose largest key is below adds 0 to every count
    of the pass that matters, so skipping it decides the same digit."""
    return block_max >= low


@jit
def _topk_floor(maxima_ptr, n_blocks, k, MAX_BLOCKS: tl.constexpr):
    """The k-th largest block maximum key of the row (0 when the row has fewer than k blocks).

    Those k blocks each hold a token with a key at least this, so the k-th largest key is at
    least this too, and a block whose largest key is below it holds no token that top-k
    keeps. A radix pass may skip it: its count is exact for every candidate at or above the
    floor, and for a candidate below, ``count >= k`` holds with or without the block."""
    return _kth_largest_key(_load_maxima(maxima_ptr, n_blocks, MAX_BLOCKS), k)


@jit
def _live_blocks(maxima_ptr, b_lo, b_hi, low, temperature, KEEP: tl.constexpr,
                 SPAN: tl.constexpr):  # fmt: skip
    """Bit ``i`` set for each block ``b_lo + i < b_hi`` (``i < SPAN <= 63``) a pass must read:
    :func:`_may_count` with ``low`` (``KEEP`` False) or :func:`_may_keep` with ``low`` as the
    kept key. One vector load of the maxima instead of a dependent load per block."""
    i = tl.arange(0, SPAN)
    ok = b_lo + i < b_hi
    mx = tl.load(maxima_ptr + b_lo + i, mask=ok, other=0).to(tl.uint32, bitcast=True)
    if KEEP:
        live = _may_keep(mx, temperature, low)
    else:
        live = _may_count(mx, low)
    return tl.sum(tl.where(ok & live, tl.full([SPAN], 1, tl.int64) << i.to(tl.int64), 0), axis=0)


@jit
def _may_keep(block_max, temperature, kept):
    """Whether a block whose largest logit has key ``block_max`` can hold a token with key
    ``kept`` or more. z = x / temperature is non-decreasing in x, so none can when the largest
    logit divided falls short (a block with a NaN is never skipped). A block skipped on this
    flag would add only exact zeros, or only -inf scores: the same bits."""
    top = tl.math.div_rn(_unkey(block_max), temperature)
    return (kept == 0) | (block_max == NAN_BLOCK) | (_key(top) >= kept)


@jit
def _pick_block(x, ok, offs, V, temperature, kept, seed, offset, best, best_i):
    """The running Gumbel-max pick ``(best, best_i)`` after one block of logits ``x``: the largest
    ``z + g`` over its tokens with key >= ``kept``, the lowest index among ties."""
    z = tl.math.div_rn(x, temperature)
    g = -tl.log(-tl.log(philox_uniform(offs, seed, offset)))
    score = tl.where(ok & (_key(z) >= kept), z + g, float("-inf"))
    bv = tl.max(score, axis=0)
    bi = tl.min(tl.where(score == bv, offs, V), axis=0)
    take = bv > best
    return tl.where(take, bv, best), tl.where(take, bi, best_i)


@jit
def _pick_digit(score, need, prefix, shift, NCAND: tl.constexpr):
    """Extend ``prefix`` by the largest digit whose candidate satisfies ``score >= need``."""
    digits = tl.arange(0, NCAND)
    best = tl.max(tl.where(score >= need, digits, 0), axis=0)
    return prefix | (best.to(tl.uint32) << shift)


@jit
def _count_blocks(row_ptr, V, b_lo, b_hi, prefix, shift, floor, maxima_ptr, BLOCK: tl.constexpr,
                  NCAND: tl.constexpr, PART_BLOCKS: tl.constexpr):  # fmt: skip
    """Top-k radix pass over the blocks ``b_lo <= b < b_hi`` of one part: per candidate
    ``prefix | d << shift`` the number of tokens with a key at least that (integers: exact in
    any order). Reads only the blocks that can hold a key of the bucket at or above the row's
    ``floor`` (:func:`_may_count`)."""
    cols = tl.arange(0, BLOCK)
    cand = prefix | (tl.arange(0, NCAND).to(tl.uint32) << shift)
    count = tl.zeros([NCAND], tl.int32)
    live = _live_blocks(maxima_ptr, b_lo, b_hi, tl.maximum(prefix, floor), 1.0, False,
                        PART_BLOCKS)  # fmt: skip
    for i in range(0, b_hi - b_lo):
        if ((live >> i) & 1) != 0:
            offs = (b_lo + i) * BLOCK + cols
            ok = offs < V
            key = _key(tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32))
            hit = (key[None, :] >= cand[:, None]) & ok[None, :]
            count += tl.sum(hit.to(tl.int32), axis=1)
    return count


@jit
def _mass_blocks(row_ptr, V, b_lo, b_hi, prefix, shift, temperature, kept, z_max, maxima_ptr,
                 BLOCK: tl.constexpr, NCAND: tl.constexpr, PART_BLOCKS: tl.constexpr):  # fmt: skip
    """Top-p radix pass over the blocks of one part: per candidate key ``K`` the mass
    (:func:`_mass_terms`, int64) of the tokens with key >= ``max(K, kept)``. Blocks without a
    token that top-k kept add zeros: skipped."""
    cols = tl.arange(0, BLOCK)
    cand = prefix | (tl.arange(0, NCAND).to(tl.uint32) << shift)
    mass = tl.zeros([NCAND], tl.int64)
    live = _live_blocks(maxima_ptr, b_lo, b_hi, kept, temperature, True, PART_BLOCKS)
    for i in range(0, b_hi - b_lo):
        if ((live >> i) & 1) != 0:
            offs = (b_lo + i) * BLOCK + cols
            ok = offs < V
            z = tl.math.div_rn(tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32),
                               temperature)  # fmt: skip
            key = _key(z)
            q = _mass_terms(z, z_max, ok & (key >= kept))
            mass += tl.sum(tl.where(key[None, :] >= cand[:, None], q[None, :], 0), axis=1)
    return mass


@jit
def _row_masses(row_ptr, V, prefix, shift, temperature, kept, z_max, n_blocks, maxima_ptr,
                BLOCK: tl.constexpr, NCAND: tl.constexpr, PART_BLOCKS: tl.constexpr):  # fmt: skip
    """A top-p pass's masses over the whole row: each part's (:func:`_mass_blocks`) added."""
    mass = tl.zeros([NCAND], tl.int64)
    for b_lo in range(0, n_blocks, PART_BLOCKS):
        b_hi = tl.minimum(b_lo + PART_BLOCKS, n_blocks)
        mass += _mass_blocks(row_ptr, V, b_lo, b_hi, prefix, shift, temperature, kept, z_max,
                             maxima_ptr, BLOCK, NCAND, PART_BLOCKS)  # fmt: skip
    return mass


@jit
def _top_p_need(p, mass, NCAND: tl.constexpr):
    """``p`` times the first top-p pass's candidate 0 mass (key 0: everything top-k kept), in
    float64, as a mass is compared with it (:func:`_top_p_digit`)."""
    return p.to(tl.float64) * tl.sum(tl.where(tl.arange(0, NCAND) == 0, mass, 0), axis=0).to(
        tl.float64
    )


@jit
def _top_p_digit(mass, need, prefix, shift, NCAND: tl.constexpr):
    """:func:`_pick_digit` for int64 masses against a float64 ``need``."""
    return _pick_digit(mass.to(tl.float64), need, prefix, shift, NCAND)


@jit
def _topk_kept(prefix, temperature):
    """The top-k threshold as a key of z, from the k-th largest logit's key ``prefix``.

    The search runs on the logits x, without dividing: z = x / temperature (correctly rounded,
    temperature > 0) is non-decreasing in x, so the k-th largest z is the k-th largest x divided
    once, and the tokens kept (z >= that z, ties included) are the same."""
    return _key(tl.math.div_rn(_unkey(prefix), temperature))


@jit
def _topk_key(row_ptr, V, temperature, k, n_blocks, maxima_ptr, BLOCK: tl.constexpr,
              RADIX_BITS: tl.constexpr, PART_BLOCKS: tl.constexpr,
              MAX_BLOCKS: tl.constexpr):  # fmt: skip
    """One program's top-k threshold: :data:`LEVELS` radix passes over the whole row, a part
    at a time."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    floor = _topk_floor(maxima_ptr, n_blocks, k, MAX_BLOCKS)
    prefix = tl.zeros([], tl.uint32)
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        count = tl.zeros([NCAND], tl.int32)
        for b_lo in range(0, n_blocks, PART_BLOCKS):
            count += _count_blocks(row_ptr, V, b_lo, tl.minimum(b_lo + PART_BLOCKS, n_blocks),
                                   prefix, shift, floor, maxima_ptr, BLOCK, NCAND,
                                   PART_BLOCKS)  # fmt: skip
        prefix = _pick_digit(count, k, prefix, shift, NCAND)
    return _topk_kept(prefix, temperature)


@jit
def _topp_key(row_ptr, V, temperature, p, kept, n_blocks, maxima_ptr, BLOCK: tl.constexpr,
              RADIX_BITS: tl.constexpr, PART_BLOCKS: tl.constexpr,
              MAX_BLOCKS: tl.constexpr):  # fmt: skip
    """One program's top-p threshold: the largest key K with mass(key >= K) >= p * mass(all
    kept), among tokens with key >= kept."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    z_max = _row_z_max(maxima_ptr, n_blocks, temperature, MAX_BLOCKS)
    prefix = tl.zeros([], tl.uint32)
    need = tl.zeros([], tl.float64)
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        mass = _row_masses(row_ptr, V, prefix, shift, temperature, kept, z_max, n_blocks,
                           maxima_ptr, BLOCK, NCAND, PART_BLOCKS)  # fmt: skip
        if level == 0:
            need = _top_p_need(p, mass, NCAND)
        prefix = _top_p_digit(mass, need, prefix, shift, NCAND)
    return prefix


@jit
def _filters(temp_ptr, topk_ptr, topp_ptr, row, V, HAS_TOPK: tl.constexpr,
             HAS_TOPP: tl.constexpr):  # fmt: skip
    """``(temperature, k, p, topk_on, topp_on)`` of a row; a filter the host passed as None is
    off for every row (its pointer is not read). Greedy rows filter nothing."""
    temperature = tl.load(temp_ptr + row)
    k = tl.zeros([], tl.int64)
    p = tl.full([], 1.0, tl.float32)
    if HAS_TOPK:
        k = tl.load(topk_ptr + row)
    if HAS_TOPP:
        p = tl.load(topp_ptr + row)
    sampled = temperature != 0.0
    return temperature, k, p, sampled & (k > 0) & (k < V), sampled & (p < 1.0)


@jit
def _row_kept(row_ptr, V, temperature, k, p, topk_on, topp_on, n_blocks, maxima_ptr,
              BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, PART_BLOCKS: tl.constexpr,
              MAX_BLOCKS: tl.constexpr):  # fmt: skip
    """One program's threshold of a row: the smallest key a token needs to be kept by top-k
    and top-p (0: all kept), from the row's block maxima (written before)."""
    kept = tl.zeros([], tl.uint32)
    if topk_on | topp_on:
        if topk_on:
            kept = _topk_key(row_ptr, V, temperature, k, n_blocks, maxima_ptr, BLOCK, RADIX_BITS,
                             PART_BLOCKS, MAX_BLOCKS)  # fmt: skip
        if topp_on:
            top_p_key = _topp_key(row_ptr, V, temperature, p, kept, n_blocks, maxima_ptr, BLOCK,
                                  RADIX_BITS, PART_BLOCKS, MAX_BLOCKS)  # fmt: skip
            kept = tl.maximum(kept, top_p_key)
    return kept


@jit
def _pick_range(row_ptr, V, lo, hi, temperature, kept, seed, offset, maxima_ptr,
                BLOCK: tl.constexpr):  # fmt: skip
    """``(best, best_i, n_nan)`` over the tokens ``lo <= v < hi`` (``lo`` a multiple of BLOCK):
    the largest ``z + g`` among the kept tokens and its lowest index (temperature 0: the largest
    logit), and the count of NaN logits. A block only wins with a strictly larger value, so the
    lowest index wins ties: ranges merged in ascending order give the one-pass result."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    n_nan = tl.zeros([], tl.int32)  # NaN logits of the row: no token can be drawn
    if temperature == 0.0:
        for b0 in range(lo, hi, BLOCK):
            offs = b0 + cols
            x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            n_nan += tl.sum((x != x).to(tl.int32), axis=0)
            bv = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bv, offs, V), axis=0)
            take = bv > best
            best_i = tl.where(take, bi, best_i)
            best = tl.where(take, bv, best)
    elif kept == 0:  # no filter: every block takes part
        for b0 in range(lo, hi, BLOCK):
            offs = b0 + cols
            ok = offs < hi
            x = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            n_nan += tl.sum((x != x).to(tl.int32), axis=0)  # z is NaN exactly where x is
            best, best_i = _pick_block(x, ok, offs, V, temperature, kept, seed, offset, best,
                                       best_i)  # fmt: skip
    else:
        # A block without a kept token scores -inf everywhere and cannot win: skipped, with its
        # noise (a block with a NaN is never skipped: its NaN is counted here). The blocks are
        # taken PICK_SPAN at a time, one vector load of their maxima each.
        b_end = tl.cdiv(hi, BLOCK)
        for c_lo in range(lo // BLOCK, b_end, PICK_SPAN):
            live = _live_blocks(maxima_ptr, c_lo, tl.minimum(c_lo + PICK_SPAN, b_end), kept,
                                temperature, True, PICK_SPAN)  # fmt: skip
            for i in range(0, tl.minimum(PICK_SPAN, b_end - c_lo)):
                if ((live >> i) & 1) != 0:
                    offs = (c_lo + i) * BLOCK + cols
                    ok = offs < hi
                    x = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                    n_nan += tl.sum((x != x).to(tl.int32), axis=0)
                    best, best_i = _pick_block(x, ok, offs, V, temperature, kept, seed, offset,
                                               best, best_i)  # fmt: skip
    return best, best_i, n_nan


@jit
def _few_token(row_ptr, V, temperature, k, p, topp_on, seed, offset, n_blocks, maxima_ptr,
               cand_x_ptr, cand_i_ptr, BLOCK: tl.constexpr, FEW_CAP: tl.constexpr,
               MAX_BLOCKS: tl.constexpr):  # fmt: skip
    """``(done, token)`` of a top-k row from its few candidates, without the radix passes.

    The candidates are the tokens with ``key(z) >= key(floor / temperature)``, ``floor`` the
    row's :func:`_topk_floor`: a superset of what top-k keeps (z is non-decreasing in x, ties
    made by the division included). One pass over the blocks that can hold one, GATHER blocks
    a load, gathers them into the row's scratch ``[FEW_CAP]``; the rest runs on them in
    registers, each threshold by a 32-step bisection on the key:

    - top-k: the largest key K with ``count(key(x) >= K) >= k`` (exact: every token at or
      above the floor is a candidate, and below it the count reaches k either way);
    - top-p: the largest key K with ``mass(key(z) >= K) >= need`` (integer masses: the very
      values the radix passes add, in any order; a mass only shrinks as K grows, so the
      bisection and the radix search find the same K);
    - the pick: the Gumbel-max over the kept candidates, the lowest index among ties.

    So the token is the radix path's. ``done`` is 0 (nothing decided) where the row has a NaN,
    ``k > FEW_CAP``, fewer blocks than ``k`` (no floor), or more candidates than FEW_CAP."""
    b = tl.arange(0, MAX_BLOCKS)
    maxima = _load_maxima(maxima_ptr, n_blocks, MAX_BLOCKS)
    nan_blocks = tl.sum((maxima == NAN_BLOCK).to(tl.int32), axis=0)
    floor = _kth_largest_key(maxima, k)  # the row's _topk_floor
    try_few = (k <= FEW_CAP) & (floor > 0) & (nan_blocks == 0)
    floor_z = _topk_kept(floor, temperature)
    # The blocks that can hold a candidate, GATHER at a time: their ranks among those blocks
    # give each round its block indices, and one [GATHER, BLOCK] load.
    live = (b < n_blocks) & _may_keep(maxima, temperature, floor_z) & try_few
    rank = tl.cumsum(live.to(tl.int32), axis=0) - 1
    n_live = tl.sum(live.to(tl.int32), axis=0)
    r = tl.arange(0, GATHER)
    cols = tl.arange(0, BLOCK)
    n = tl.zeros([], tl.int32)
    for first in range(0, n_live, GATHER):
        if n <= FEW_CAP:
            pick = live[None, :] & (rank[None, :] == first + r[:, None])
            blk = tl.sum(tl.where(pick, b[None, :], 0), axis=1)
            offs = blk[:, None] * BLOCK + cols[None, :]
            ok = ((first + r)[:, None] < n_live) & (offs < V)
            x = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            take = (ok & (_key(tl.math.div_rn(x, temperature)) >= floor_z)).to(tl.int32)
            per_block = tl.sum(take, axis=1)
            # Distinct slots (their order does not matter: what follows is order-free).
            at = n + (tl.cumsum(per_block, axis=0) - per_block)[:, None] + tl.cumsum(take, axis=1)
            at -= 1
            keep = (take != 0) & (at < FEW_CAP)
            tl.store(cand_x_ptr + at, x, mask=keep)
            tl.store(cand_i_ptr + at, offs, mask=keep)
            n += tl.sum(per_block, axis=0)
    done = try_few & (n <= FEW_CAP)
    token = tl.zeros([], tl.int32)
    if done:
        tl.debug_barrier()  # the gathered candidates, stored by other threads of the program
        j = tl.arange(0, FEW_CAP)
        valid = j < n
        x = tl.load(cand_x_ptr + j, mask=valid, other=0.0)
        idx = tl.load(cand_i_ptr + j, mask=valid, other=0)
        kept = _topk_kept(_kth_largest_key(tl.where(valid, _key(x), 0), k), temperature)
        z = tl.math.div_rn(x, temperature)
        key_z = tl.where(valid, _key(z), 0)
        if topp_on:
            z_max = _row_z_max(maxima_ptr, n_blocks, temperature, MAX_BLOCKS)
            q = _mass_terms(z, z_max, valid & (key_z >= kept))
            need = p.to(tl.float64) * tl.sum(q, axis=0).to(tl.float64)
            top = tl.zeros([], tl.uint32)
            for bit in tl.static_range(32):
                cand = top | (tl.full([], 1, tl.uint32) << (31 - bit))
                mass = tl.sum(tl.where(key_z >= cand, q, 0), axis=0).to(tl.float64)
                top = tl.where(mass >= need, cand, top)
            kept = tl.maximum(kept, top)
        g = -tl.log(-tl.log(philox_uniform(idx, seed, offset)))
        score = tl.where(valid & (key_z >= kept), z + g, float("-inf"))
        best = tl.max(score, axis=0)
        token = tl.min(tl.where(score == best, idx, V), axis=0)
    return done, token


@jit
def _few_kernel(logits_ptr, seeds_ptr, offsets_ptr, temp_ptr, topk_ptr, topp_ptr, maxima_ptr,
                cand_x_ptr, cand_i_ptr, done_ptr, out_ptr, V, stride, n_blocks,
                HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr, FEW_CAP: tl.constexpr,
                MAX_BLOCKS: tl.constexpr):  # fmt: skip
    """Split sampling, after the block maxima (a program per row): :func:`_few_token` for the
    rows with top-k; ``done[row]`` says whether it decided the row's token (then in ``out``)."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    temperature, k, p, topk_on, topp_on = _filters(temp_ptr, topk_ptr, topp_ptr, row, V, True,
                                                   HAS_TOPP)  # fmt: skip
    done = tl.zeros([], tl.int1)
    if topk_on:
        done, token = _few_token(logits_ptr + r64 * stride, V, temperature, k, p, topp_on,
                                 tl.load(seeds_ptr + row), tl.load(offsets_ptr + row),
                                 n_blocks, maxima_ptr + r64 * n_blocks,
                                 cand_x_ptr + r64 * FEW_CAP, cand_i_ptr + r64 * FEW_CAP, BLOCK,
                                 FEW_CAP, MAX_BLOCKS)  # fmt: skip
        if done:
            tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(done_ptr + row, done.to(tl.int32))


@jit
def _sample_kernel(
    logits_ptr,
    seeds_ptr,
    offsets_ptr,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    maxima_ptr,
    cand_x_ptr,
    cand_i_ptr,
    out_ptr,
    V,
    stride,
    n_blocks,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    PART_BLOCKS: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    FEW_CAP: tl.constexpr,
):
    """One program per row: the block maxima, then the token from the few candidates of a
    top-k row (:func:`_few_token`), or else the filters' radix threshold and the pick over the
    whole row. ``maxima_ptr``: int32 ``[B, n_blocks]`` scratch for the block maxima;
    ``cand_*_ptr`` ``[B, FEW_CAP]`` for the candidates (FEW_CAP 0: no candidate step)."""
    pid = tl.program_id(0)
    r64 = pid.to(tl.int64)
    row_ptr = logits_ptr + r64 * stride
    maxima_ptr += r64 * n_blocks
    temperature, k, p, topk_on, topp_on = _filters(temp_ptr, topk_ptr, topp_ptr, pid, V,
                                                   HAS_TOPK, HAS_TOPP)  # fmt: skip
    seed = tl.load(seeds_ptr + pid)
    offset = tl.load(offsets_ptr + pid)
    if topk_on | topp_on:
        _block_maxima(row_ptr, V, 0, n_blocks, maxima_ptr, BLOCK)
        tl.debug_barrier()
    done = tl.zeros([], tl.int1)
    token = tl.zeros([], tl.int32)
    if FEW_CAP > 0:  # noqa: SIM102 (a compile-time branch: with FEW_CAP 0 no candidate code)
        if topk_on:
            done, token = _few_token(row_ptr, V, temperature, k, p, topp_on, seed, offset,
                                     n_blocks, maxima_ptr, cand_x_ptr + r64 * FEW_CAP,
                                     cand_i_ptr + r64 * FEW_CAP, BLOCK, FEW_CAP,
                                     MAX_BLOCKS)  # fmt: skip
    if done:
        tl.store(out_ptr + pid, token.to(tl.int64))
    else:
        kept = _row_kept(row_ptr, V, temperature, k, p, topk_on, topp_on, n_blocks, maxima_ptr,
                         BLOCK, RADIX_BITS, PART_BLOCKS, MAX_BLOCKS)  # fmt: skip
        best, best_i, n_nan = _pick_range(row_ptr, V, 0, V, temperature, kept, seed, offset,
                                          maxima_ptr, BLOCK)  # fmt: skip
        tl.store(out_ptr + pid, tl.where(n_nan > 0, -1, best_i).to(tl.int64))


# Split threshold: the passes of the one-program threshold, each a launch over (row, part)
# programs, a part being PART_BLOCKS blocks. A pass's program first finishes the previous pass
# of its row from the parts' results (integers: exact in any order), then runs its part. Per
# row the scratch holds: ``prefix [2 * LEVELS]`` (each pass's starting prefix, top-k then
# top-p, written by part 0), ``counts``/``masses [2, parts, NCAND]`` (ping-pong by pass parity,
# so that a pass never reads what the same launch writes), ``topk [1]`` (the top-k key),
# ``need [1]`` (top_p times the kept mass), ``floor [1]`` and ``done [1]`` (whether the
# candidate step decided the row: then every later step skips it).


@jit
def _sum_parts(ptr, n_parts, NCAND: tl.constexpr, MAX_PARTS: tl.constexpr):
    """The parts' ``[NCAND]`` integer results at ``ptr`` added (exact in any order)."""
    q = tl.arange(0, MAX_PARTS)[:, None]
    parts = tl.load(ptr + q * NCAND + tl.arange(0, NCAND)[None, :], mask=q < n_parts, other=0)
    return tl.sum(parts, axis=0)


@jit
def _undecided(done_ptr, row, FEW: tl.constexpr):
    """Whether the radix path decides the row's token: always without the candidate step
    (``FEW`` False), else where :func:`_few_kernel` did not."""
    undecided = tl.full([], 1, tl.int1)
    if FEW:
        undecided = tl.load(done_ptr + row) == 0
    return undecided


@jit
def _maxima_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, maxima_ptr, V, stride, n_blocks,
                   HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr,
                   PART_BLOCKS: tl.constexpr):  # fmt: skip
    """Split threshold, first pass: the block maxima of a row's part (rows with a filter)."""
    row = tl.program_id(0)
    b_lo = tl.program_id(1) * PART_BLOCKS
    _, _, _, topk_on, topp_on = _filters(temp_ptr, topk_ptr, topp_ptr, row, V, HAS_TOPK,
                                         HAS_TOPP)  # fmt: skip
    if topk_on | topp_on:
        _block_maxima(logits_ptr + row.to(tl.int64) * stride, V, b_lo,
                      tl.minimum(b_lo + PART_BLOCKS, n_blocks),
                      maxima_ptr + row.to(tl.int64) * n_blocks, BLOCK)  # fmt: skip


@jit
def _topk_finish(prefix_ptr, count_ptr, k, n_parts, temperature, RADIX_BITS: tl.constexpr,
                 MAX_PARTS: tl.constexpr):  # fmt: skip
    """The top-k key of a row once its last pass has run (``count_ptr``: that pass's parts)."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    LEVELS: tl.constexpr = 32 // RADIX_BITS
    start = tl.load(prefix_ptr + LEVELS - 1).to(tl.uint32)
    prefix = _pick_digit(_sum_parts(count_ptr, n_parts, NCAND, MAX_PARTS), k, start, 0, NCAND)
    return _topk_kept(prefix, temperature)


@jit
def _level_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, maxima_ptr, prefix_ptr, count_ptr,
                  mass_ptr, topk_key_ptr, need_ptr, floor_ptr, done_ptr, V, stride, n_blocks,
                  n_parts, TOPP: tl.constexpr, LEVEL: tl.constexpr, HAS_TOPK: tl.constexpr,
                  HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
                  PART_BLOCKS: tl.constexpr, MAX_BLOCKS: tl.constexpr, MAX_PARTS: tl.constexpr,
                  FEW: tl.constexpr):  # fmt: skip
    """Split threshold, pass ``LEVEL`` of top-k (``TOPP`` False) or top-p, program (row,
    part), for the rows the candidate step left undecided. The first top-k pass finds the
    row's :func:`_topk_floor` (each program alike; part 0 keeps it for the later passes)."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    LEVELS: tl.constexpr = 32 // RADIX_BITS
    SHIFT: tl.constexpr = 32 - RADIX_BITS * (LEVEL + 1)
    row = tl.program_id(0)
    part = tl.program_id(1)
    temperature, k, p, topk_on, topp_on = _filters(temp_ptr, topk_ptr, topp_ptr, row, V,
                                                   HAS_TOPK, HAS_TOPP)  # fmt: skip
    undecided = _undecided(done_ptr, row, FEW)
    topk_on &= undecided
    topp_on &= undecided
    r64 = row.to(tl.int64)
    row_ptr = logits_ptr + r64 * stride
    maxima_ptr += r64 * n_blocks
    prefix_ptr += r64 * (2 * LEVELS)
    # counts / masses [2, B, n_parts, NCAND]: this row's results in plane 0, ``plane`` on.
    row_counts = count_ptr + r64 * (n_parts * NCAND)
    row_masses = mass_ptr + r64 * (n_parts * NCAND)
    plane = tl.num_programs(0).to(tl.int64) * (n_parts * NCAND)
    b_lo = part * PART_BLOCKS
    b_hi = tl.minimum(b_lo + PART_BLOCKS, n_blocks)
    if not TOPP:
        if topk_on:
            prefix = tl.zeros([], tl.uint32)
            if LEVEL > 0:
                floor = tl.load(floor_ptr + row).to(tl.uint32)
                start = tl.load(prefix_ptr + LEVEL - 1).to(tl.uint32)
                prev = _sum_parts(row_counts + ((LEVEL - 1) % 2) * plane, n_parts, NCAND,
                                  MAX_PARTS)  # fmt: skip
                prefix = _pick_digit(prev, k, start, SHIFT + RADIX_BITS, NCAND)
            else:
                floor = _topk_floor(maxima_ptr, n_blocks, k, MAX_BLOCKS)
                if part == 0:
                    tl.store(floor_ptr + row, floor.to(tl.int64))
            if part == 0:
                tl.store(prefix_ptr + LEVEL, prefix.to(tl.int64))
            count = _count_blocks(row_ptr, V, b_lo, b_hi, prefix, SHIFT, floor, maxima_ptr, BLOCK,
                                  NCAND, PART_BLOCKS)  # fmt: skip
            tl.store(row_counts + (LEVEL % 2) * plane + part * NCAND + tl.arange(0, NCAND), count)
    else:
        if topp_on:
            kept = tl.zeros([], tl.uint32)
            if topk_on:
                if LEVEL == 0:
                    kept = _topk_finish(prefix_ptr, row_counts + ((LEVELS - 1) % 2) * plane, k,
                                        n_parts, temperature, RADIX_BITS, MAX_PARTS)  # fmt: skip
                    if part == 0:
                        tl.store(topk_key_ptr + row, kept.to(tl.int64))
                else:
                    kept = tl.load(topk_key_ptr + row).to(tl.uint32)
            z_max = _row_z_max(maxima_ptr, n_blocks, temperature, MAX_BLOCKS)
            prefix = tl.zeros([], tl.uint32)
            if LEVEL > 0:
                start = tl.load(prefix_ptr + LEVELS + LEVEL - 1).to(tl.uint32)
                if LEVEL == 1:  # the first pass's parts, finished
                    need = _top_p_need(p, _sum_parts(row_masses, n_parts, NCAND, MAX_PARTS),
                                       NCAND)  # fmt: skip
                    if part == 0:
                        tl.store(need_ptr + row, need)
                else:
                    need = tl.load(need_ptr + row)
                prev = _sum_parts(row_masses + ((LEVEL - 1) % 2) * plane, n_parts, NCAND,
                                  MAX_PARTS)  # fmt: skip
                prefix = _top_p_digit(prev, need, start, SHIFT + RADIX_BITS, NCAND)
            if part == 0:
                tl.store(prefix_ptr + LEVELS + LEVEL, prefix.to(tl.int64))
            mass = _mass_blocks(row_ptr, V, b_lo, b_hi, prefix, SHIFT, temperature, kept, z_max,
                                maxima_ptr, BLOCK, NCAND, PART_BLOCKS)  # fmt: skip
            tl.store(row_masses + (LEVEL % 2) * plane + part * NCAND + tl.arange(0, NCAND), mass)


@jit
def _finish_kernel(temp_ptr, topk_ptr, topp_ptr, prefix_ptr, count_ptr, mass_ptr, topk_key_ptr,
                   need_ptr, done_ptr, kept_ptr, V, n_parts, HAS_TOPK: tl.constexpr,
                   HAS_TOPP: tl.constexpr, RADIX_BITS: tl.constexpr, MAX_PARTS: tl.constexpr,
                   FEW: tl.constexpr):  # fmt: skip
    """Split threshold, last step (one program per row): the last pass finished, the row's
    threshold key into ``kept_ptr``."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    LEVELS: tl.constexpr = 32 // RADIX_BITS
    row = tl.program_id(0)
    temperature, k, p, topk_on, topp_on = _filters(temp_ptr, topk_ptr, topp_ptr, row, V,
                                                   HAS_TOPK, HAS_TOPP)  # fmt: skip
    undecided = _undecided(done_ptr, row, FEW)
    topk_on &= undecided
    topp_on &= undecided
    r64 = row.to(tl.int64)
    prefix_ptr += r64 * (2 * LEVELS)
    plane = tl.num_programs(0).to(tl.int64) * (n_parts * NCAND)
    last = ((LEVELS - 1) % 2) * plane + r64 * (n_parts * NCAND)
    kept = tl.zeros([], tl.uint32)
    if topk_on:
        kept = _topk_finish(prefix_ptr, count_ptr + last, k, n_parts, temperature, RADIX_BITS,
                            MAX_PARTS)  # fmt: skip
    if topp_on:
        start = tl.load(prefix_ptr + 2 * LEVELS - 1).to(tl.uint32)
        prev = _sum_parts(mass_ptr + last, n_parts, NCAND, MAX_PARTS)
        top_p_key = _top_p_digit(prev, tl.load(need_ptr + row), start, 0, NCAND)
        kept = tl.maximum(kept, top_p_key)
    tl.store(kept_ptr + row, kept.to(tl.int64))


@jit
def _pick_kernel(logits_ptr, seeds_ptr, offsets_ptr, temp_ptr, kept_ptr, maxima_ptr, done_ptr,
                 best_ptr, index_ptr, nan_ptr, V, stride, SPAN, BLOCK: tl.constexpr,
                 FEW: tl.constexpr):  # fmt: skip
    """Split sampling, step 2 (a program per row and range of SPAN tokens): the range's pick
    (rows left undecided by the candidate step)."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    if _undecided(done_ptr, pid, FEW):
        lo = part * SPAN
        hi = tl.minimum(lo + SPAN, V)
        best, best_i, n_nan = _pick_range(
            logits_ptr + pid.to(tl.int64) * stride, V, lo, hi, tl.load(temp_ptr + pid),
            tl.load(kept_ptr + pid).to(tl.uint32), tl.load(seeds_ptr + pid),
            tl.load(offsets_ptr + pid), maxima_ptr + pid.to(tl.int64) * tl.cdiv(V, BLOCK), BLOCK,
        )  # fmt: skip
        at = pid * tl.num_programs(1) + part
        tl.store(best_ptr + at, best)
        tl.store(index_ptr + at, best_i)
        tl.store(nan_ptr + at, n_nan)


@jit
def _merge_kernel(best_ptr, index_ptr, nan_ptr, done_ptr, out_ptr, V, PARTS,
                  BLOCK_P: tl.constexpr, FEW: tl.constexpr):  # fmt: skip
    """Split sampling, step 3 (one program per row): the ranges' picks merged as one pass over
    the row would: the largest value, the lowest index among ranges holding it (rows left
    undecided by the candidate step)."""
    pid = tl.program_id(0)
    if _undecided(done_ptr, pid, FEW):
        p = tl.arange(0, BLOCK_P)
        ok = p < PARTS
        best = tl.load(best_ptr + pid * PARTS + p, mask=ok, other=float("-inf"))
        idx = tl.load(index_ptr + pid * PARTS + p, mask=ok, other=V)
        n_nan = tl.sum(tl.load(nan_ptr + pid * PARTS + p, mask=ok, other=0), axis=0)
        top = tl.max(best, axis=0)
        # Where every range is at -inf the one-pass pick keeps index 0: range 0's index.
        best_i = tl.min(tl.where(ok & (best == top), idx, V), axis=0)
        tl.store(out_ptr + pid, tl.where(n_nan > 0, -1, best_i).to(tl.int64))


@jit
def _uniform_kernel(seeds_ptr, offsets_ptr, out_ptr, V, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = philox_uniform(offs, tl.load(seeds_ptr + pid), tl.load(offsets_ptr + pid))
    tl.store(out_ptr + pid.to(tl.int64) * V + offs, u, mask=offs < V)


#: Launch configs. ``programs``: the programs a pass should fill the GPU with. Below that
#: many rows, the filters' threshold runs as the split threshold (a launch per pass, a program
#: per part of a row) and the pick in ranges of whole blocks (a program each), merged by a third
#: kernel; 0 keeps one program per row. ``part_blocks`` (default :data:`PART_BLOCKS`): blocks per
#: part of a split pass; ``few_warps`` (default :data:`FEW_WARPS`): the candidate step's warps.
#: None changes a bit: counts and masses are exact integers, and ranges merge as one pass would.
def _choose(*, B: int, V: int) -> int:
    # H200, scripts/kernel_sweep.py --parts sample,sampleknobs (V = 151936): from B = 64 to 1024,
    # 2 warps and 4096 programs are the fastest or within 3% of it (temperature only at
    # B = 1024: 850 against 961 us for the first config, one program per row; top-k + top-p at
    # B = 1024: 686 against 943 us); at B = 1 the first is (8.2 us, against 8.6). The candidate
    # step is one program per row: below a row per SM, 8 warps shorten it (top-k 50 + top-p
    # 0.9: 123.5 -> 105.4 us at B = 64, 97.4 -> 85.4 at B = 1), at B = 256 they cost occupancy
    # (195.6 -> 223.2). Parts of 32 blocks halve the programs of the passes the candidate step
    # leaves empty (195.6 -> 170.4 us at B = 256; 3-5% slower there for top-p alone and
    # top-k 1000); parts of 8 give one row more programs (top-p alone at B = 1: 220.7 ->
    # 127.3 us, top-k 1000: 155.6 -> 99.4).
    if B < 32:
        return 5
    if B < 128:
        return 6
    return 7 if B < 512 else 4


TUNING = {
    "sample.fwd": tuning.Rule(
        configs=(
            {"num_warps": 4, "programs": 528},
            {"num_warps": 4, "programs": 0},
            {"num_warps": 8, "programs": 264},
            {"num_warps": 2, "programs": 2048},
            {"num_warps": 2, "programs": 4096},
            {"num_warps": 4, "programs": 528, "part_blocks": 8, "few_warps": 8},
            {"num_warps": 2, "programs": 4096, "few_warps": 8},
            {"num_warps": 2, "programs": 4096, "part_blocks": 32},
        ),
        choose=_choose,
    ),
}

#: Under the interpreter the cost is per program: the first config at every batch size.
CPU_TUNING = {"sample.fwd": tuning.Rule(configs=TUNING["sample.fwd"].configs)}


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's Philox uniforms, float32 ``[B, vocab]`` (for checking the RNG bit for bit
    against :func:`rlk_reference.philox.philox_uniform`)."""
    b = seeds.shape[0]
    out = torch.empty(b, vocab, dtype=torch.float32, device=seeds.device)
    if b and vocab:
        _uniform_kernel[(b, cdiv(vocab, 1024))](
            seeds.contiguous(), offsets.contiguous(), out, vocab, BLOCK=1024
        )
    return out


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Seeded per-row sampling (semantics: :func:`rlk.sample`).

    Shapes: ``logits [B, V]`` (bf16/fp16/fp32); int64 ``seeds``, ``offsets``, ``top_k`` ``[B]``;
    float32 ``temperature`` (0 = greedy), ``top_p`` ``[B]`` -> int64 ``[B]``. ``top_k`` /
    ``top_p`` None: that filter is off for every row (no pass of it is launched).

    Example::

        tok = sample(logits, seeds, offsets, temperature=t, top_k=k, top_p=p, table=table)
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if not B:
        return out
    cfg = dict(tuning.config(table, "sample.fwd", B=B, V=V))
    part_blocks = cfg.pop("part_blocks", PART_BLOCKS)
    few_warps = cfg.pop("few_warps", FEW_WARPS)
    blocks = cdiv(V, BLOCK)
    parts = min(blocks, cdiv(cfg.pop("programs"), B))
    temperature = temperature.to(torch.float32).contiguous()
    seeds, offsets = seeds.contiguous(), offsets.contiguous()
    # A filter passed as None is read nowhere: any tensor stands in for its pointer.
    has = dict(HAS_TOPK=top_k is not None, HAS_TOPP=top_p is not None)
    params = (
        top_k.to(torch.int64).contiguous() if top_k is not None else temperature,
        top_p.to(torch.float32).contiguous() if top_p is not None else temperature,
    )
    if top_p is not None and V > MAX_VOCAB:
        raise ValueError(
            f"logits: a vocabulary of {V} is more than {MAX_VOCAB}, the most whose top-p masses "
            "are exact in int64"
        )
    meta = dict(BLOCK=BLOCK, RADIX_BITS=RADIX_BITS)
    sizes = dict(PART_BLOCKS=part_blocks, MAX_BLOCKS=next_power_of_2(blocks))
    # Written and read only by rows with a filter on (the candidates: by rows with top-k).
    maxima = torch.empty((B, blocks), dtype=torch.int32, device=dev)
    cap = FEW_CAP if top_k is not None else 0
    # Without top-k there is no candidate step: the maxima stand in for its unread scratch.
    cand_x = torch.empty((B, cap), dtype=torch.float32, device=dev) if cap else maxima
    cand_i = torch.empty((B, cap), dtype=torch.int32, device=dev) if cap else maxima
    if parts <= 1:
        _sample_kernel[(B,)](logits, seeds, offsets, temperature, *params, maxima, cand_x, cand_i,
                             out, V, logits.stride(0), blocks, **has, **meta, **sizes,
                             FEW_CAP=cap, **cfg)  # fmt: skip
        return out
    few = (seeds, offsets, cand_x, cand_i, out) if cap else None
    kept, done = _split_threshold(logits, temperature, params, has, maxima, meta, sizes, cfg, few,
                                  few_warps)  # fmt: skip
    span = cdiv(blocks, parts) * BLOCK  # whole blocks: the one-pass blocks exactly
    parts = cdiv(V, span)
    best = torch.empty((B, parts), dtype=torch.float32, device=dev)
    index = torch.empty((B, parts), dtype=torch.int32, device=dev)
    nans = torch.empty((B, parts), dtype=torch.int32, device=dev)
    _pick_kernel[(B, parts)](logits, seeds, offsets, temperature, kept, maxima, done, best,
                             index, nans, V, logits.stride(0), span, BLOCK=BLOCK, FEW=bool(cap),
                             **cfg)  # fmt: skip
    _merge_kernel[(B,)](best, index, nans, done, out, V, parts, BLOCK_P=next_power_of_2(parts),
                        FEW=bool(cap))  # fmt: skip
    return out


def _split_threshold(logits, temperature, params, has, maxima, meta, sizes, cfg, few=None,
                     few_warps=FEW_WARPS):  # fmt: skip
    """``(kept, done)``: the filters' threshold key of every row (int64 ``[B]``), a launch per
    pass over (row, part) programs, after the block maxima; without a filter on the host's
    side, zeros and nothing launched. ``few``: ``(seeds, offsets, cand_x, cand_i, out)`` to run
    the candidate step first (:func:`_few_kernel`, the rows it decides have their token in
    ``out`` and ``done`` 1; the passes skip them), or None; ``few_warps`` its warps. A part is
    ``sizes["PART_BLOCKS"]`` blocks."""
    B, V = logits.shape
    dev = logits.device
    # Read only with the candidate step (FEW); else a stand-in for its pointer.
    done = torch.empty(B, dtype=torch.int32, device=dev) if few else maxima
    if not (has["HAS_TOPK"] or has["HAS_TOPP"]):
        return torch.zeros(B, dtype=torch.int64, device=dev), done
    blocks = maxima.shape[1]
    n_parts = cdiv(blocks, sizes["PART_BLOCKS"])
    ncand = 1 << RADIX_BITS
    prefix = torch.empty((B, 2 * LEVELS), dtype=torch.int64, device=dev)
    counts = torch.empty((2, B, n_parts, ncand), dtype=torch.int32, device=dev)
    masses = torch.empty((2, B, n_parts, ncand), dtype=torch.int64, device=dev)
    topk_key = torch.empty(B, dtype=torch.int64, device=dev)
    need = torch.empty(B, dtype=torch.float64, device=dev)
    floor = torch.empty(B, dtype=torch.int64, device=dev)
    kept = torch.empty(B, dtype=torch.int64, device=dev)
    stride = logits.stride(0)
    _maxima_kernel[(B, n_parts)](logits, temperature, *params, maxima, V, stride, blocks, **has,
                                 BLOCK=BLOCK, PART_BLOCKS=sizes["PART_BLOCKS"], **cfg)  # fmt: skip
    if few:
        seeds, offsets, cand_x, cand_i, out = few
        _few_kernel[(B,)](logits, seeds, offsets, temperature, *params, maxima, cand_x, cand_i,
                          done, out, V, stride, blocks, HAS_TOPP=has["HAS_TOPP"], BLOCK=BLOCK,
                          FEW_CAP=cand_x.shape[1], MAX_BLOCKS=sizes["MAX_BLOCKS"],
                          num_warps=few_warps)  # fmt: skip
    scratch = (maxima, prefix, counts, masses, topk_key, need)
    max_parts = next_power_of_2(n_parts)
    for topp, on in ((False, has["HAS_TOPK"]), (True, has["HAS_TOPP"])):
        for level in range(LEVELS) if on else ():
            _level_kernel[(B, n_parts)](logits, temperature, *params, *scratch, floor, done, V,
                                        stride, blocks, n_parts, TOPP=topp, LEVEL=level, **has,
                                        **meta, **sizes, MAX_PARTS=max_parts, FEW=bool(few),
                                        **cfg)  # fmt: skip
    _finish_kernel[(B,)](temperature, *params, *scratch[1:], done, kept, V, n_parts, **has,
                         RADIX_BITS=RADIX_BITS, MAX_PARTS=max_parts, FEW=bool(few),
                         **cfg)  # fmt: skip
    return kept, done
