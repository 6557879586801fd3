"""The top-k and top-p filters of :mod:`rlk_triton.sampling`: keys, block maxima, thresholds.

Both filters are thresholds on an order-preserving uint32 key of ``z = logit / temperature``,
found by radix passes on exact integer counts (top-k) and int64 fixed-point masses (top-p),
so any order of the sums finds the same key (the reasons are in :mod:`rlk_triton.sampling`'s
docstring). Here: the keys, the block maxima that let a pass skip blocks, the one-program
threshold of a row (:func:`_row_kept`) and the passes of the split threshold, a launch per
pass over (row, part) programs (launched by ``sampling._split_threshold``).
"""

from __future__ import annotations

from rlk_triton._triton import jit, tl

#: Fixed point of the top-p masses: a token adds ``floor(exp(z - z_max) * MASS_SCALE)`` (int64).
#: The max adds 2**40 itself, so a mass of up to 2**22 tokens stays below 2**63 and is exact in
#: any order; a term's truncation costs under 2**-40 of that max's share.
MASS_SCALE = tl.constexpr(2.0**40)
#: The block-maximum key of a block holding a NaN logit (or a finite logit whose z overflows):
#: above every key, so such a block is never skipped (and its NaN is counted where it is
#: loaded).
NAN_BLOCK = tl.constexpr(0xFFFFFFFF)


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


@jit
def _mass_terms(z, z_max, on):
    """The top-p mass terms of ``z`` (fp32, the row's largest ``z_max``), int64: 0 off ``on``
    and for NaN; ``z == z_max`` adds exactly MASS_SCALE, infinities included."""
    e = tl.exp(tl.where(z == z_max, 0.0, z - z_max))
    return tl.where(on & (e == e), (e * MASS_SCALE).to(tl.int64), 0)


@jit
def _block_maxima(row_ptr, V, b_lo, b_hi, temperature, maxima_ptr, BLOCK: tl.constexpr):
    """Blocks ``b_lo <= b < b_hi`` of the row: each block's largest logit as a key into
    ``maxima_ptr[b]`` (int32 bits); :data:`NAN_BLOCK` for a block with a NaN, or with a finite
    logit whose ``x / temperature`` overflows (outside the domain: the row draws no token, and
    the pick must read the block to count it). The division is monotone and odd, so such a
    logit exists exactly where the block's largest finite ``|x|`` divided overflows: one
    division a block."""
    cols = tl.arange(0, BLOCK)
    for b in range(b_lo, b_hi):
        offs = b * BLOCK + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        has_nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
        big = tl.max(tl.where(tl.abs(x) != float("inf"), tl.abs(x), 0.0), axis=0)
        over = tl.math.div_rn(big, temperature) == float("inf")
        key = tl.where(has_nan | over, NAN_BLOCK, _key(tl.max(x, axis=0)))
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
def _valid(temperature, k, p):
    """Whether a row's parameters are valid: ``temperature`` finite and >= 0, ``top_k >= 0``,
    ``top_p`` in (0, 1] (false for NaN). ``rlk.sample`` checks them on the host only where that
    costs no device read; elsewhere a row failing this draws no token (-1), as one with a NaN
    logit does, instead of sampling from a distribution nobody asked for."""
    return (temperature >= 0.0) & (temperature < float("inf")) & (k >= 0) & (p > 0.0) & (p <= 1.0)


@jit
def _params(temp_ptr, topk_ptr, topp_ptr, row, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):
    """``(temperature, k, p)`` of a row; a filter the host passed as None reads as off (its
    pointer is not read)."""
    temperature = tl.load(temp_ptr + row)
    k = tl.zeros([], tl.int64)
    p = tl.full([], 1.0, tl.float32)
    if HAS_TOPK:
        k = tl.load(topk_ptr + row)
    if HAS_TOPP:
        p = tl.load(topp_ptr + row)
    return temperature, k, p


@jit
def _filters(temp_ptr, topk_ptr, topp_ptr, row, V, HAS_TOPK: tl.constexpr,
             HAS_TOPP: tl.constexpr):  # fmt: skip
    """``(temperature, k, p, topk_on, topp_on)`` of a row (:func:`_params`). Greedy rows, and
    rows whose parameters are invalid (:func:`_valid`: they draw no token), filter nothing."""
    temperature, k, p = _params(temp_ptr, topk_ptr, topp_ptr, row, HAS_TOPK, HAS_TOPP)
    sampled = (temperature != 0.0) & _valid(temperature, k, p)
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
    temperature, _, _, topk_on, topp_on = _filters(temp_ptr, topk_ptr, topp_ptr, row, V,
                                                   HAS_TOPK, HAS_TOPP)  # fmt: skip
    if topk_on | topp_on:
        _block_maxima(logits_ptr + row.to(tl.int64) * stride, V, b_lo,
                      tl.minimum(b_lo + PART_BLOCKS, n_blocks), temperature,
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
    # -1, outside the keys' uint32 range: the row's parameters are invalid, it draws no token.
    kept64 = tl.where(_valid(temperature, k, p), kept.to(tl.int64), -1)
    tl.store(kept_ptr + row, kept64)
