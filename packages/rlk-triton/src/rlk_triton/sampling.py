"""Seeded per-row sampling: temperature, top-k, top-p, Gumbel-max with Philox-4x32-10 noise.

A row's token depends only on its logits, seed, offset and parameters. The filters' threshold
takes one program per row; the pick (the Gumbel-max over the kept tokens) takes one program per
row too, or, when rows are too few to fill the GPU, one per range of whole blocks of a row, the
ranges' picks merged as one pass over the row would (:data:`TUNING`): the same token either way.

- Noise: ``u`` from Philox-4x32-10 exactly as :mod:`rlk_reference.philox` specifies (key = the
  seed's two 32-bit words, counter = ``(v, offset_lo, offset_hi, 0)``), ``g = -log(-log(u))``.
- Filters without sorting: both are thresholds on an order-preserving uint32 key of
  ``z = logit / temperature``, found by a radix search, :data:`RADIX_BITS` bits per pass over
  the row. top-k: the largest key with ``count(key >= K) >= k`` (integer counts: exact in any
  order), i.e. the k-th largest z, ties kept (searched on the logits, then divided once: the
  division is monotone). top-p: the largest key with
  ``mass(key >= K) >= top_p * mass(all kept)``, masses ``sum exp(z - max)`` added by a fixed
  tree over blocks of :data:`BLOCK` and the blocks in ascending order. A mass can only shrink
  as K grows (terms drop to 0), so the search is consistent.
- Pick: ``argmax(z + g)`` over the kept tokens, the lowest index among ties; temperature 0 is
  the lowest-index argmax of the logits.
- Skipped blocks. With a filter on, a first pass writes each block's largest logit (as a key)
  to a scratch row. A top-k pass skips the blocks whose largest key is below its bucket: they
  add 0 to every count. The top-p passes and the pick skip the blocks that cannot hold a kept
  token (their largest logit, divided, falls short of the threshold): they would add exact
  zeros to the masses and -inf scores to the pick. Skipping changes no bit; a block with a NaN
  is never skipped.
- A row with a NaN logit draws no token: its result is -1 (as on every backend). Nothing is
  synchronised for it; ``rlk.sample`` rejects NaN logits with ``ValueError`` where value checks
  run (CPU, or ``RLK_VALIDATE``).
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._triton import jit, tl, triton
from rlk_triton.logprobs import tree_sum

#: Vocabulary block of a pass; sets the order of the top-p mass sums (a constant of the op).
BLOCK = 512
#: Key bits resolved per radix pass (2**RADIX_BITS candidate thresholds counted per pass).
RADIX_BITS = 4

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


#: The block-maximum key of a block holding a NaN logit: above every key, so such a block is
#: never skipped (and its NaN is counted where it is loaded).
NAN_BLOCK = tl.constexpr(0xFFFFFFFF)


@jit
def _block_maxima(row_ptr, V, maxima_ptr, BLOCK: tl.constexpr):
    """One pass over the row: each block's largest logit as a key (:data:`NAN_BLOCK` for a
    block with a NaN) into ``maxima_ptr`` (int32 bits); returns the row's largest logit."""
    cols = tl.arange(0, BLOCK)
    x_max = tl.full([], float("-inf"), tl.float32)
    for b0 in range(0, V, BLOCK):
        offs = b0 + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        has_nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
        key = tl.where(has_nan, NAN_BLOCK, _key(top))
        tl.store(maxima_ptr + b0 // BLOCK, key.to(tl.int32, bitcast=True))
        x_max = tl.maximum(x_max, top)
    return x_max


@jit
def _block_max(maxima_ptr, b0, BLOCK: tl.constexpr):
    return tl.load(maxima_ptr + b0 // BLOCK).to(tl.uint32, bitcast=True)


@jit
def _may_count(block_max, prefix):
    """Whether a block can hold a key >= ``prefix`` (the lowest key of the radix bucket): one
    whose largest key is below adds 0 to every count of the pass, so skipping it changes none."""
    return block_max >= prefix


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
def _topk_key(row_ptr, V, temperature, k, maxima_ptr, BLOCK: tl.constexpr,
              RADIX_BITS: tl.constexpr):  # fmt: skip
    """Key of the k-th largest z of the row.

    The search runs on the logits x, without dividing: z = x / temperature (correctly rounded,
    temperature > 0) is non-decreasing in x, so the k-th largest z is the k-th largest x divided
    once, and the tokens kept (z >= that z, ties included) are the same. A pass reads only the
    blocks that can hold a key of the current bucket (:func:`_may_count`)."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    cols = tl.arange(0, BLOCK)
    digits = tl.arange(0, NCAND).to(tl.uint32)
    prefix = tl.zeros([], tl.uint32)
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        cand = prefix | (digits << shift)
        count = tl.zeros([NCAND], tl.int32)
        for b0 in range(0, V, BLOCK):
            if _may_count(_block_max(maxima_ptr, b0, BLOCK), prefix):
                offs = b0 + cols
                ok = offs < V
                key = _key(tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32))
                hit = (key[None, :] >= cand[:, None]) & ok[None, :]
                count += tl.sum(hit.to(tl.int32), axis=1)
        prefix = _pick_digit(count, k, prefix, shift, NCAND)
    return _key(tl.math.div_rn(_unkey(prefix), temperature))


@jit
def _topp_key(
    row_ptr,
    V,
    temperature,
    p,
    kept,
    z_max,
    maxima_ptr,
    BLOCK: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """Largest key K with mass(key >= K) >= p * mass(all kept), among tokens with key >= kept."""
    NCAND: tl.constexpr = 1 << RADIX_BITS
    cols = tl.arange(0, BLOCK)
    digits = tl.arange(0, NCAND).to(tl.uint32)
    prefix = tl.zeros([], tl.uint32)
    need = tl.zeros([], tl.float32)
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        cand = prefix | (digits << shift)
        mass = tl.zeros([NCAND], tl.float32)
        for b0 in range(0, V, BLOCK):
            # Blocks without a token that top-k kept add exact zeros: skipped.
            if _may_keep(_block_max(maxima_ptr, b0, BLOCK), temperature, kept):
                offs = b0 + cols
                ok = offs < V
                x = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                z = tl.math.div_rn(x, temperature)
                key = _key(z)
                e = tl.where(ok & (key >= kept), tl.exp(z - z_max), 0.0)
                mass += tree_sum(
                    tl.where(key[None, :] >= cand[:, None], e[None, :], 0.0), LOG2_BLOCK
                )
        if level == 0:
            # candidate 0 is key 0: everything kept by top-k, the mass top_p is a fraction of
            need = p * tl.sum(tl.where(digits == 0, mass, 0.0), axis=0)
        prefix = _pick_digit(mass, need, prefix, shift, NCAND)
    return prefix


@jit
def _row_kept(row_ptr, V, temperature, k, p, maxima_ptr, BLOCK: tl.constexpr,
              LOG2_BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):  # fmt: skip
    """The smallest key a token of the row needs to be kept by top-k and top-p (0: all kept).
    With a filter, it first writes the row's block maxima, which let later passes skip
    blocks."""
    kept = tl.zeros([], tl.uint32)
    if ((k > 0) & (k < V)) | (p < 1.0):
        x_max = _block_maxima(row_ptr, V, maxima_ptr, BLOCK)
        if (k > 0) & (k < V):
            kept = _topk_key(row_ptr, V, temperature, k, maxima_ptr, BLOCK, RADIX_BITS)
        if p < 1.0:
            # The largest z is the largest logit divided once (the division is monotone).
            z_max = tl.math.div_rn(x_max, temperature)
            top_p_key = _topp_key(row_ptr, V, temperature, p, kept, z_max, maxima_ptr, BLOCK,
                                  LOG2_BLOCK, RADIX_BITS)  # fmt: skip
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
        for b0 in range(lo, hi, BLOCK):
            # A block without a kept token scores -inf everywhere and cannot win: skipped,
            # with its noise (a block with a NaN is never skipped: its NaN is counted here).
            if _may_keep(_block_max(maxima_ptr, b0, BLOCK), temperature, kept):
                offs = b0 + cols
                ok = offs < hi
                x = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                n_nan += tl.sum((x != x).to(tl.int32), axis=0)
                best, best_i = _pick_block(x, ok, offs, V, temperature, kept, seed, offset, best,
                                           best_i)  # fmt: skip
    return best, best_i, n_nan


@jit
def _sample_kernel(
    logits_ptr,
    seeds_ptr,
    offsets_ptr,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    maxima_ptr,
    out_ptr,
    V,
    stride,
    BLOCK: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """One program per row: the filters' threshold, then the pick over the whole row.
    ``maxima_ptr``: int32 ``[B, cdiv(V, BLOCK)]`` scratch for the block maxima."""
    pid = tl.program_id(0)
    row_ptr = logits_ptr + pid.to(tl.int64) * stride
    maxima_ptr += pid.to(tl.int64) * tl.cdiv(V, BLOCK)
    temperature = tl.load(temp_ptr + pid)
    kept = tl.zeros([], tl.uint32)
    if temperature != 0.0:
        kept = _row_kept(row_ptr, V, temperature, tl.load(topk_ptr + pid),
                         tl.load(topp_ptr + pid), maxima_ptr, BLOCK, LOG2_BLOCK,
                         RADIX_BITS)  # fmt: skip
    best, best_i, n_nan = _pick_range(row_ptr, V, 0, V, temperature, kept,
                                      tl.load(seeds_ptr + pid), tl.load(offsets_ptr + pid),
                                      maxima_ptr, BLOCK)  # fmt: skip
    tl.store(out_ptr + pid, tl.where(n_nan > 0, -1, best_i).to(tl.int64))


@jit
def _kept_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, maxima_ptr, kept_ptr, V, stride,
                 BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):  # fmt: skip
    """Split sampling, step 1 (one program per row): the filters' threshold of the row, and
    its block maxima where a filter is on."""
    pid = tl.program_id(0)
    temperature = tl.load(temp_ptr + pid)
    kept = tl.zeros([], tl.uint32)
    if temperature != 0.0:
        kept = _row_kept(logits_ptr + pid.to(tl.int64) * stride, V, temperature,
                         tl.load(topk_ptr + pid), tl.load(topp_ptr + pid),
                         maxima_ptr + pid.to(tl.int64) * tl.cdiv(V, BLOCK), BLOCK, LOG2_BLOCK,
                         RADIX_BITS)  # fmt: skip
    tl.store(kept_ptr + pid, kept.to(tl.int64))


@jit
def _pick_kernel(logits_ptr, seeds_ptr, offsets_ptr, temp_ptr, kept_ptr, maxima_ptr, best_ptr,
                 index_ptr, nan_ptr, V, stride, SPAN, BLOCK: tl.constexpr):  # fmt: skip
    """Split sampling, step 2 (a program per row and range of SPAN tokens): the range's pick."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
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
def _merge_kernel(best_ptr, index_ptr, nan_ptr, out_ptr, V, PARTS, BLOCK_P: tl.constexpr):
    """Split sampling, step 3 (one program per row): the ranges' picks merged as one pass over
    the row would: the largest value, the lowest index among ranges holding it."""
    pid = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    ok = p < PARTS
    best = tl.load(best_ptr + pid * PARTS + p, mask=ok, other=float("-inf"))
    idx = tl.load(index_ptr + pid * PARTS + p, mask=ok, other=V)
    n_nan = tl.sum(tl.load(nan_ptr + pid * PARTS + p, mask=ok, other=0), axis=0)
    top = tl.max(best, axis=0)
    # Where every range is at -inf the one-pass pick keeps index 0, which is range 0's index.
    best_i = tl.min(tl.where(ok & (best == top), idx, V), axis=0)
    tl.store(out_ptr + pid, tl.where(n_nan > 0, -1, best_i).to(tl.int64))


@jit
def _uniform_kernel(seeds_ptr, offsets_ptr, out_ptr, V, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = philox_uniform(offs, tl.load(seeds_ptr + pid), tl.load(offsets_ptr + pid))
    tl.store(out_ptr + pid.to(tl.int64) * V + offs, u, mask=offs < V)


#: Launch configs. ``programs``: the programs the pick should fill the GPU with. Below that
#: many rows, each row's pick is split into ranges of whole blocks (a program each), merged by
#: a third kernel; 0 keeps one program per row. Neither changes a bit: the filters' threshold
#: is one program's work per row either way, and ranges merge as one pass would.
TUNING = {
    "sample.fwd": tuning.Rule(
        configs=(
            {"num_warps": 4, "programs": 528},
            {"num_warps": 4, "programs": 0},
            {"num_warps": 8, "programs": 264},
            {"num_warps": 2, "programs": 2048},
        )
    ),
}


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's Philox uniforms, float32 ``[B, vocab]`` (for checking the RNG bit for bit
    against :func:`rlk_reference.philox.philox_uniform`)."""
    b = seeds.shape[0]
    out = torch.empty(b, vocab, dtype=torch.float32, device=seeds.device)
    if b and vocab:
        _uniform_kernel[(b, triton.cdiv(vocab, 1024))](
            seeds.contiguous(), offsets.contiguous(), out, vocab, BLOCK=1024
        )
    return out


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Seeded per-row sampling (semantics: :func:`rlk.sample`).

    Shapes: ``logits [B, V]`` (bf16/fp16/fp32); int64 ``seeds``, ``offsets``, ``top_k`` ``[B]``;
    float32 ``temperature`` (0 = greedy), ``top_p`` ``[B]`` -> int64 ``[B]``.

    Example::

        tok = sample(logits, seeds, offsets, temperature=t, top_k=k, top_p=p, table=table)
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if not B:
        return out
    cfg = dict(tuning.config(table, "sample.fwd", B=B, V=V))
    blocks = triton.cdiv(V, BLOCK)
    parts = min(blocks, triton.cdiv(cfg.pop("programs"), B))
    temperature = temperature.to(torch.float32).contiguous()
    params = (top_k.to(torch.int64).contiguous(), top_p.to(torch.float32).contiguous())
    seeds, offsets = seeds.contiguous(), offsets.contiguous()
    meta = dict(BLOCK=BLOCK, LOG2_BLOCK=BLOCK.bit_length() - 1, RADIX_BITS=RADIX_BITS)
    # Written and read only by rows with a filter on.
    maxima = torch.empty((B, blocks), dtype=torch.int32, device=logits.device)
    if parts <= 1:
        _sample_kernel[(B,)](logits, seeds, offsets, temperature, *params, maxima, out, V,
                             logits.stride(0), **meta, **cfg)  # fmt: skip
        return out
    span = triton.cdiv(blocks, parts) * BLOCK  # whole blocks: the one-pass blocks exactly
    parts = triton.cdiv(V, span)
    kept = torch.empty(B, dtype=torch.int64, device=logits.device)
    _kept_kernel[(B,)](logits, temperature, *params, maxima, kept, V, logits.stride(0), **meta,
                       **cfg)  # fmt: skip
    best = torch.empty((B, parts), dtype=torch.float32, device=logits.device)
    index = torch.empty((B, parts), dtype=torch.int32, device=logits.device)
    nans = torch.empty((B, parts), dtype=torch.int32, device=logits.device)
    _pick_kernel[(B, parts)](logits, seeds, offsets, temperature, kept, maxima, best, index,
                             nans, V, logits.stride(0), span, BLOCK=BLOCK, **cfg)  # fmt: skip
    _merge_kernel[(B,)](best, index, nans, out, V, parts,
                        BLOCK_P=triton.next_power_of_2(parts))  # fmt: skip
    return out
