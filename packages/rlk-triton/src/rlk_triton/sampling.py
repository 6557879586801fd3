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
  run (CPU, or ``RLK_VALIDATE``). So does a row whose parameters are invalid (a temperature
  negative, infinite or NaN, a negative top-k, a top-p outside (0, 1]), which ``rlk.sample``
  checks on the host only where value checks run (:func:`~rlk_triton.sampling_filters._valid`),
  and a row outside the domain, with a finite logit whose ``z`` overflows fp32 (bf16 3e38 at
  temperature 1e-3): the pick counts that logit as it counts a NaN, and the block maxima mark
  its block as one holding a NaN, so that no pass skips it.

The filters' keys, block maxima and threshold passes are in :mod:`rlk_triton.sampling_filters`;
the pick, the candidate step, the kernels that run a whole row and the launchers are here.
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import cdiv, jit, next_power_of_2, tl
from rlk_triton.sampling_filters import (
    NAN_BLOCK,
    _block_maxima,
    _filters,
    _finish_kernel,
    _key,
    _kth_largest_key,
    _level_kernel,
    _live_blocks,
    _load_maxima,
    _mass_terms,
    _maxima_kernel,
    _may_keep,
    _row_kept,
    _row_z_max,
    _topk_kept,
    _undecided,
    _valid,
)

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


#: The largest vocabulary whose masses cannot overflow (checked by :func:`sample`).
MAX_VOCAB = 2**22
#: Blocks whose maxima the pick loads at once (the bits of one int64 mask).
PICK_SPAN = tl.constexpr(32)


@jit
def _pick_block(x, ok, offs, V, temperature, kept, seed, offset, best, best_i, n_bad):
    """The running Gumbel-max pick ``(best, best_i, n_bad)`` after one block of logits ``x``:
    the largest ``z + g`` over its tokens with key >= ``kept``, the lowest index among ties;
    ``n_bad`` counts the logits no token can be drawn beside: NaN, and finite ones whose
    ``z`` overflows fp32 (outside the domain, as in the reference)."""
    z = tl.math.div_rn(x, temperature)
    over = (tl.abs(z) == float("inf")) & (tl.abs(x) != float("inf"))
    n_bad += tl.sum(((x != x) | over).to(tl.int32), axis=0)
    g = -tl.log(-tl.log(philox_uniform(offs, seed, offset)))
    score = tl.where(ok & (_key(z) >= kept), z + g, float("-inf"))
    bv = tl.max(score, axis=0)
    bi = tl.min(tl.where(score == bv, offs, V), axis=0)
    take = bv > best
    return tl.where(take, bv, best), tl.where(take, bi, best_i), n_bad


@jit
def _pick_range(row_ptr, V, lo, hi, temperature, kept, seed, offset, maxima_ptr,
                BLOCK: tl.constexpr):  # fmt: skip
    """``(best, best_i, n_nan)`` over the tokens ``lo <= v < hi`` (``lo`` a multiple of BLOCK):
    the largest ``z + g`` among the kept tokens and its lowest index (temperature 0: the largest
    logit), and the count of NaN logits and (temperature > 0) of finite logits whose ``z``
    overflows. A block only wins with a strictly larger value, so the lowest index wins ties:
    ranges merged in ascending order give the one-pass result. A block skipped here holds
    neither: its maximum says so (:func:`~rlk_triton.sampling_filters._block_maxima`)."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    n_nan = tl.zeros([], tl.int32)  # NaN (or overflowing) logits: no token can be drawn
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
            best, best_i, n_nan = _pick_block(x, ok, offs, V, temperature, kept, seed, offset,
                                              best, best_i, n_nan)  # fmt: skip
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
                    best, best_i, n_nan = _pick_block(x, ok, offs, V, temperature, kept, seed,
                                                      offset, best, best_i, n_nan)  # fmt: skip
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
        _block_maxima(row_ptr, V, 0, n_blocks, temperature, maxima_ptr, BLOCK)
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
        draws = (n_nan == 0) & _valid(temperature, k, p)
        tl.store(out_ptr + pid, tl.where(draws, best_i, -1).to(tl.int64))


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
        temperature = tl.load(temp_ptr + pid)
        kept = tl.load(kept_ptr + pid)  # -1: invalid top-k / top-p (the threshold's finish)
        best, best_i, n_nan = _pick_range(
            logits_ptr + pid.to(tl.int64) * stride, V, lo, hi, temperature, kept.to(tl.uint32),
            tl.load(seeds_ptr + pid), tl.load(offsets_ptr + pid),
            maxima_ptr + pid.to(tl.int64) * tl.cdiv(V, BLOCK), BLOCK,
        )  # fmt: skip
        # A row with invalid parameters draws no token: counted as a NaN, the merge gives -1.
        draws = (kept >= 0) & _valid(
            temperature, tl.zeros([], tl.int64), tl.full([], 1.0, tl.float32)
        )
        at = pid * tl.num_programs(1) + part
        tl.store(best_ptr + at, best)
        tl.store(index_ptr + at, best_i)
        tl.store(nan_ptr + at, tl.where(draws, n_nan, 1))


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
