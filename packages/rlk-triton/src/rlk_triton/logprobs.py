"""Log-probabilities (and entropy) of targets from logits: ``[T, V] -> [T]``, read once.

Numerics (the contract of :func:`rlk.logprobs`): ``z = logit / temperature`` is a correctly
rounded fp32 division (skipped at temperature 1, where it is the identity); a finite logit whose
``z`` overflows makes ``z`` NaN (:func:`scale_logits`), so its row's results are NaN. The
vocabulary is cut into :data:`VOCAB_LEAVES` equal contiguous leaves of
``leaf_len = ceil(V / VOCAB_LEAVES)`` logits (a function of V alone). Each leaf is read from a
fresh state in chunks of ``chunk = min(CHUNK, next_pow2(leaf_len))`` logits, in ascending order:
a block of rows keeps its running max ``m`` and, per column of the chunk, running sums of
``exp(z - m)`` and ``exp(z - m) * (z - m)`` (rescaled when ``m`` grows), elementwise work whose
order is fixed by the chunk sequence alone (:func:`accumulate`); one fixed binary tree
(:func:`tree_sum`) adds the columns, giving the leaf's ``(m, s, t)``. The leaves are then merged
by one fixed binary tree of adjacent pairs (:func:`merge_tree`):
``m = max(m_a, m_b)``, ``s = s_a e^(m_a-m) + s_b e^(m_b-m)``,
``t = (t_a + (m_a-m) s_a) e^(m_a-m) + (t_b + (m_b-m) s_b) e^(m_b-m)``; at the root
``lse = m + log(s)`` and ``entropy = log(s) - t / s``. No ``tl.sum`` is used: its order follows
num_warps and the layout, so it would let a launch config change bits.

Why leaves: a contiguous, aligned block of ``VOCAB_LEAVES / n`` leaves is a subtree, so a rank
of a vocabulary-parallel group of ``n`` ranks (V a multiple of ``VOCAB_LEAVES``) computes its
subtree's ``(m, s, t)`` from its own logits (:func:`leaf_states` with the global V and its
offset, then :func:`merge_states`), and the ranks' triples merged by the top of the tree give
the single-device bits (``rlk.parallel.vocab_parallel_linear_logprobs``). ``linear_logprobs``
runs these same kernels on slices of rows.

Backward: ``dlogits = (g_lp * (onehot(target) - p) - g_ent * p * (log p + H)) / temperature``
with ``p = exp(z - lse)`` recomputed from the saved per-row ``lse`` and entropy ``H``;
it is elementwise, so any tiling (and any vocabulary split) gives the same bits.
"""

from __future__ import annotations

import torch

from rlk.parallel import VOCAB_LEAVES
from rlk_triton import _bounds, tuning
from rlk_triton._triton import cdiv, jit, tl

#: Largest number of logits per chunk of a leaf: sets the reduction order (each column adds its
#: chunks in ascending order, one tree over the columns at the end). A constant of the op, never
#: a tuning choice; a power of two.
CHUNK = 1024

# VOCAB_LEAVES, the vocabulary leaves merged by the fixed tree, is a constant of the op: it is
# defined with the vocabulary-parallel contract in rlk.parallel (imported above).


def leaf_geometry(vocab: int) -> tuple[int, int]:
    """``(leaf_len, chunk)`` of a vocabulary of ``vocab`` logits: functions of ``vocab`` alone."""
    leaf_len = max(1, -(-vocab // VOCAB_LEAVES))
    return leaf_len, min(CHUNK, 1 << (leaf_len - 1).bit_length())


# --------------------------------------------------------------------------------------------
# Row arithmetic shared with the fused linear+logprobs kernel
# --------------------------------------------------------------------------------------------


@jit
def pair_sums(x, LEVELS: tl.constexpr):
    """``x [R, N] -> [R, N >> LEVELS]``: element j sums columns ``[j << LEVELS, (j + 1) <<
    LEVELS)`` by a fixed binary tree of adjacent pairs (``N`` a multiple of ``2**LEVELS``).

    Every step adds exactly two numbers, and a two-term fp32 sum has one result whatever the
    order, so the bits do not depend on how Triton lays ``x`` out over threads (``tl.sum``'s
    order does: it follows num_warps and the layout).
    """
    for _ in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        x = a + b
    return x


@jit
def tree_sum(x, LOG2N: tl.constexpr):
    """Sum ``x [R, 2**LOG2N]`` along axis 1 by the fixed binary tree of :func:`pair_sums`."""
    return tl.reshape(pair_sums(x, LOG2N), [x.shape[0]])


@jit
def scale_logits(x, temperature, UNIT: tl.constexpr = False):
    """``z = x / temperature`` in fp32, correctly rounded (``/`` may be approximate on GPU).

    A finite ``x`` whose ``z`` overflows (bf16 3e38 at temperature 1e-3) is outside the op's
    domain: its ``z`` is NaN, so that it counts as a NaN logit and its row's log-probabilities,
    entropy and gradient are NaN (the contract of ``rlk.logprobs``), never a plausible -inf or
    0. Elsewhere ``z`` is the quotient itself: ordinary rows keep their bits.

    ``UNIT``: the launcher saw ``temperature == 1.0``, and ``x / 1`` is ``x`` in IEEE arithmetic
    (NaN, infinities and signed zeros included, and nothing overflows), so the division is
    skipped: the same bits."""
    xf = x.to(tl.float32)
    if UNIT:
        return xf
    z = tl.math.div_rn(xf, temperature)
    return tl.where((tl.abs(z) == float("inf")) & (tl.abs(xf) != float("inf")), float("nan"), z)


@jit
def _minus(x, ref):
    """``x - ref`` for ``x <= ref``, and exactly 0 where they are equal (``inf - inf`` too)."""
    return tl.where(x == ref, 0.0, x - ref)


@jit
def accumulate(m, sv, tv, z, valid, ENTROPY: tl.constexpr):
    """Add one chunk ``z [R, CHUNK]`` (fp32, where ``valid``) to a block of rows' running state.

    ``m [R]`` is the running row max. ``sv``/``tv [R, CHUNK]`` hold, per column of the chunk, the
    sums over the chunks seen so far of ``exp(z - m)`` and ``exp(z - m) * (z - m)``. Each column
    adds its chunks in ascending order and all of this is elementwise, so the bits cannot depend
    on how Triton lays the tile out over threads; only the row max crosses columns, and a max is
    exact in any order. A chunk with no valid logit leaves the state bitwise unchanged.
    """
    zm = tl.where(valid, z, float("-inf"))
    m_new = tl.maximum(m, tl.max(zm, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    # Differences to the max are 0 where equal (the same value for finite numbers), so a +inf
    # logit counts 1 instead of exp(inf - inf) = NaN: the row's log-sum-exp is then +inf.
    d = _minus(m, ref)[:, None]  # <= 0; -inf before the first finite logit
    a = tl.exp(d)
    # The kernel is bound by this per-element arithmetic, so with the entropy two block-uniform
    # branches skip work whose result is already known; each takes values equal bit for bit to
    # the full expression's, so the branches never change a bit. With every row's max finite,
    # zm - ref is exactly _minus(zm, ref) (x - x is +0.0; -inf and NaN pass through). Without
    # the entropy the branch costs more than it saves (H200, T = 16384, V = 151936: 1896 ->
    # 2015 us, against 3117 -> 2582 with the entropy, both branches there).
    if ENTROPY and tl.sum((tl.abs(ref) == float("inf")).to(tl.int32), axis=0) == 0:
        w = zm - ref[:, None]
    else:
        w = _minus(zm, ref[:, None])
    e = tl.exp(w)
    if ENTROPY:
        # Rescale to the new max: sum e^(z-m')(z-m') = a * (t + (m - m') * s); a row whose
        # max did not move (d == 0) keeps t as it is, so when no row's max moved (the usual
        # chunk once the row's largest logits are behind) there is nothing to do.
        if tl.sum(tl.sum((d != 0.0).to(tl.int32), axis=1), axis=0) > 0:
            tv = tl.where(d == 0.0, tv, tl.where(sv > 0, (tv + d * sv) * a, 0.0))
        tv = tl.where(e > 0, tv + e * w, tv)
    sv = sv * a + e
    return m_new, sv, tv


@jit
def merge_pair(ma, sa, ta, mb, sb, tb, ENTROPY: tl.constexpr):
    """Merge two leaves' ``(m, s, t)`` (elementwise). An empty leaf (``m = -inf, s = 0``) is an
    exact identity; every product and add is written out, and launches have FP contraction off,
    so each device evaluates the same expression."""
    m = tl.maximum(ma, mb)
    ref = tl.where(m == float("-inf"), 0.0, m)
    da = _minus(ma, ref)
    db = _minus(mb, ref)
    ea = tl.exp(da)
    eb = tl.exp(db)
    s = sa * ea + sb * eb
    if ENTROPY:
        t = tl.where(sa > 0, (ta + da * sa) * ea, 0.0) + tl.where(sb > 0, (tb + db * sb) * eb, 0.0)
    else:
        t = ta
    return m, s, t


@jit
def merge_tree(m, s, t, LOG2N: tl.constexpr, ENTROPY: tl.constexpr):
    """Merge ``[R, 2**LOG2N]`` leaf states along axis 1 by the fixed tree of adjacent pairs."""
    for _ in tl.static_range(LOG2N):
        ma, mb = tl.split(tl.reshape(m, [m.shape[0], m.shape[1] // 2, 2]))
        sa, sb = tl.split(tl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
        ta, tb = tl.split(tl.reshape(t, [t.shape[0], t.shape[1] // 2, 2]))
        m, s, t = merge_pair(ma, sa, ta, mb, sb, tb, ENTROPY)
    return tl.reshape(m, [m.shape[0]]), tl.reshape(s, [s.shape[0]]), tl.reshape(t, [t.shape[0]])


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _leaf_state_kernel(
    logits_ptr,
    targets_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zt_ptr,
    ok_ptr,
    T,
    V,
    stride_t,
    leaf_len,
    n_leaves,
    vocab,
    vocab_offset,
    temperature,
    CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    NSUB: tl.constexpr,
    UNIT: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    leaf = tl.program_id(1)
    row_ok = rows < T
    row_ptr = logits_ptr + rows.to(tl.int64)[:, None] * stride_t
    start = leaf * leaf_len
    end = tl.minimum(start + leaf_len, V)
    cols = tl.arange(0, CHUNK)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    sv = tl.zeros([ROWS, CHUNK], tl.float32)
    tv = tl.zeros([ROWS, CHUNK], tl.float32)
    # NSUB chunks per iteration only batches the loads; chunks are still added one at a time, and
    # a chunk past the leaf's end is an exact no-op, so NSUB never changes a bit.
    for c0 in range(0, tl.cdiv(leaf_len, CHUNK), NSUB):
        for j in tl.static_range(NSUB):
            offs = start + (c0 + j) * CHUNK + cols
            valid = row_ok[:, None] & (offs < end)[None, :]
            x = tl.load(row_ptr + offs[None, :], mask=valid, other=0.0)
            m, sv, tv = accumulate(m, sv, tv, scale_logits(x, temperature, UNIT), valid, ENTROPY)
    out = rows.to(tl.int64) * n_leaves + leaf
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, tree_sum(sv, LOG2_CHUNK), mask=row_ok)
    if ENTROPY:
        tl.store(t_ptr + out, tree_sum(tv, LOG2_CHUNK), mask=row_ok)
    # The program whose leaf holds the target also reads the target's logit.
    tgt = tl.load(targets_ptr + rows, mask=row_ok, other=0)
    # A target outside the vocabulary (possible in default mode, see rlk_triton._bounds) is
    # never read: the first leaf's program makes its scaled logit NaN and clears the flag.
    bad = row_ok & ((tgt < 0) | (tgt >= vocab))
    if leaf == 0:
        tl.store(zt_ptr + rows, tl.full([ROWS], float("nan"), tl.float32), mask=bad)
        tl.store(ok_ptr + rows * 0, tl.zeros([ROWS], tl.int32), mask=bad)
    tgt = tgt - vocab_offset
    mine = row_ok & (tgt >= start) & (tgt < end)
    x_t = tl.load(logits_ptr + rows.to(tl.int64) * stride_t + tgt, mask=mine, other=0.0)
    tl.store(zt_ptr + rows, scale_logits(x_t, temperature, UNIT), mask=mine)


@jit
def _merge_kernel(
    m_ptr,
    s_ptr,
    t_ptr,
    zt_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    T,
    n_leaves,
    BLOCK_T: tl.constexpr,
    NL: tl.constexpr,
    LOG2_NL: tl.constexpr,
    FINAL: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, NL)
    ok = row_ok[:, None] & (cols < n_leaves)[None, :]
    idx = rows.to(tl.int64)[:, None] * n_leaves + cols[None, :]
    m = tl.load(m_ptr + idx, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + idx, mask=ok, other=0.0)
    if ENTROPY:
        t = tl.load(t_ptr + idx, mask=ok, other=0.0)
    else:
        t = s
    m, s, t = merge_tree(m, s, t, LOG2_NL, ENTROPY)
    if FINAL:
        log_s = tl.log(s)
        lse = m + log_s
        zt = tl.load(zt_ptr + rows, mask=row_ok, other=0.0)
        tl.store(out0_ptr + rows, zt - lse, mask=row_ok)
        # A NaN target logit (a NaN in the row, or a target out of range) makes the saved
        # log-sum-exp NaN too, so the row's gradient is NaN rather than a plausible number.
        tl.store(out1_ptr + rows, tl.where(zt != zt, zt, lse), mask=row_ok)
        if ENTROPY:
            # With a +inf logit p = softmax(z) is NaN in IEEE arithmetic (inf - inf), and so
            # is the entropy, as in the reference.
            ent = tl.where(m == float("inf"), float("nan"), log_s - tl.math.div_rn(t, s))
            tl.store(out2_ptr + rows, ent, mask=row_ok)
    else:
        tl.store(out0_ptr + rows, m, mask=row_ok)
        tl.store(out1_ptr + rows, s, mask=row_ok)
        if ENTROPY:
            tl.store(out2_ptr + rows, t, mask=row_ok)


@jit
def _logprobs_bwd_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    ent_ptr,
    g_lp_ptr,
    g_ent_ptr,
    dlogits_ptr,
    T,
    V,
    stride_t,
    stride_dt,
    temperature,
    col0,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UNIT: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    # Column j of these logits is vocabulary entry col0 + j (a slice of a larger vocabulary).
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_t + cols[None, :], mask=ok, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    log_p = scale_logits(x, temperature, UNIT) - lse[:, None]
    p = tl.exp(log_p)
    onehot = ((cols + col0)[None, :] == tgt[:, None]).to(tl.float32)
    dz = g_lp[:, None] * (onehot - p)
    if ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        # d entropy / dz_j = -p_j * (log p_j + entropy), whose limit is 0 where p_j = 0
        dz = dz - g_ent[:, None] * tl.where(p > 0, p * (log_p + ent[:, None]), 0.0)
    dx = dz if UNIT else tl.math.div_rn(dz, temperature)  # dz / 1 == dz
    tl.store(
        dlogits_ptr + rows64[:, None] * stride_dt + cols[None, :],
        dx.to(dlogits_ptr.dtype.element_ty),
        mask=ok,
    )


# --------------------------------------------------------------------------------------------
# Tuning: launch parameters only (rows per program, loads batched per iteration, warps)
# --------------------------------------------------------------------------------------------


def _choose_fwd(T: int, V: int) -> int:
    # 2 rows x 4 warps: 1.90 ms at T=16384, V=151936 bf16 on an H200 against 2.33 ms for 4 rows
    # x 8 warps (scripts/kernel_sweep.py --parts logprobs).
    return 0 if T < 2048 else 3


def _choose_bwd(T: int, V: int) -> int:
    return 0 if T < 64 else 1


TUNING = {
    "logprobs.fwd": tuning.Rule(
        configs=(
            {"ROWS": 1, "NSUB": 4, "num_warps": 4},
            {"ROWS": 4, "NSUB": 2, "num_warps": 8},
            {"ROWS": 2, "NSUB": 1, "num_warps": 2},
            {"ROWS": 2, "NSUB": 1, "num_warps": 4},
        ),
        choose=_choose_fwd,
    ),
    "logprobs.bwd": tuning.Rule(
        configs=(
            {"BLOCK_T": 1, "BLOCK_V": 2048, "num_warps": 4},
            {"BLOCK_T": 4, "BLOCK_V": 1024, "num_warps": 8},
            {"BLOCK_T": 2, "BLOCK_V": 128, "num_warps": 2},
        ),
        choose=_choose_bwd,
    ),
}

#: Under the Triton interpreter (CPU), whose cost is per program and per op: many rows per
#: program. Extra candidates, so the tuning-invariance checks run them beside the GPU ones.
CPU_TUNING = {
    "logprobs.fwd": tuning.preferring(
        TUNING["logprobs.fwd"], {"ROWS": 64, "NSUB": 1, "num_warps": 4}
    ),
    "logprobs.bwd": tuning.preferring(
        TUNING["logprobs.bwd"], {"BLOCK_T": 64, "BLOCK_V": 1024, "num_warps": 4}
    ),
}


# --------------------------------------------------------------------------------------------
# Launchers, autograd, public function
# --------------------------------------------------------------------------------------------


def _unit(temperature: float) -> bool:
    """Whether the kernels may skip the division by ``temperature`` (it is 1: the same bits)."""
    return float(temperature) == 1.0


def leaf_states(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    table,
    vocab: int | None = None,
    vocab_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-leaf states of ``logits [T, V_local]``: ``(m, s, t or None)`` fp32 ``[T, n]`` and the
    scaled target logit ``zt`` fp32 ``[T]``.

    ``vocab`` (default ``V_local``) is the whole vocabulary, which sets the leaves;
    ``logits`` are its columns ``[vocab_offset, vocab_offset + V_local)``, which must start on a
    leaf boundary. ``zt`` is written only where the target lies in those columns (0 elsewhere),
    and is NaN where the target is outside ``[0, vocab)``: that is reported as a bad index
    (``ValueError`` on CPU, an asynchronous device-side assertion on a GPU).
    """
    T, V = logits.shape
    vocab = V if vocab is None else vocab
    leaf_len, chunk = leaf_geometry(vocab)
    if vocab_offset % leaf_len:
        raise ValueError(f"vocab_offset {vocab_offset} is not on a leaf boundary ({leaf_len})")
    n = max(1, -(-V // leaf_len)) if vocab == V else V // leaf_len
    dev = logits.device
    m = torch.empty(T, n, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if entropy else None
    zt = torch.zeros(T, dtype=torch.float32, device=dev)
    if T:
        ok = _bounds.flag(dev)
        cfg = dict(tuning.config(table, "logprobs.fwd", T=T, V=V))
        rows = cfg.pop("ROWS")
        _leaf_state_kernel[(cdiv(T, rows), n)](
            logits,
            targets,
            m,
            s,
            t if entropy else s,
            zt,
            ok,
            T,
            V,
            logits.stride(0),
            leaf_len,
            n,
            vocab,
            vocab_offset,
            float(temperature),
            CHUNK=chunk,
            LOG2_CHUNK=chunk.bit_length() - 1,
            ROWS=rows,
            UNIT=_unit(temperature),
            ENTROPY=entropy,
            **cfg,
        )
        _bounds.report(ok, f"logprobs: targets out of range (the vocabulary has {vocab} entries)")
    return m, s, t, zt


#: Rows per program of the merge kernel; rows are independent, so it changes no bit.
_MERGE_ROWS = 64


def merge_states(m, s, t, zt=None, *, final: bool):
    """Merge leaf states ``[T, n]`` (n leaves in order, n <= a power of two ``NL``; missing leaves
    are empty) by the fixed tree. ``final``: returns ``(logprobs, lse, entropy or None)`` with
    ``zt`` the scaled target logits; else the subtree's ``(m, s, t or None)``, fp32 ``[T]``."""
    T, n = m.shape
    entropy = t is not None
    nl = 1 << (n - 1).bit_length()
    outs = [torch.empty(T, dtype=torch.float32, device=m.device) for _ in range(3)]
    if T:
        _merge_kernel[(cdiv(T, _MERGE_ROWS),)](
            m,
            s,
            t if entropy else s,
            zt if final else m,
            *outs,
            T,
            n,
            BLOCK_T=_MERGE_ROWS,
            NL=nl,
            LOG2_NL=nl.bit_length() - 1,
            FINAL=final,
            ENTROPY=entropy,
        )
    return outs[0], outs[1], (outs[2] if entropy else None)


def logprobs_forward(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, table
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernels: returns ``(logprobs, lse, entropy or None)``, all fp32 [T]."""
    m, s, t, zt = leaf_states(logits, targets, temperature, entropy, table)
    return merge_states(m, s, t, zt, final=True)


def logprobs_backward(
    logits, targets, lse, ent, g_lp, g_ent, temperature: float, table, out=None, col0: int = 0
) -> torch.Tensor:
    """Launch the backward kernel: ``dlogits`` in the dtype of ``logits`` (or written into
    ``out``, a ``[T, V]`` tensor with unit column stride, e.g. columns of a larger buffer).
    ``col0``: the vocabulary index of the logits' first column (a target matches column
    ``target - col0``; one outside the columns matches none)."""
    T, V = logits.shape
    dlogits = (
        torch.empty_like(logits, memory_format=torch.contiguous_format) if out is None else out
    )
    if T == 0:
        return dlogits
    entropy = ent is not None
    cfg = dict(tuning.config(table, "logprobs.bwd", T=T, V=V))
    bt, bv = cfg.pop("BLOCK_T"), cfg.pop("BLOCK_V")
    _logprobs_bwd_kernel[(cdiv(T, bt), cdiv(V, bv))](
        logits,
        targets,
        lse,
        ent if entropy else lse,
        g_lp,
        g_ent if entropy else g_lp,
        dlogits,
        T,
        V,
        logits.stride(0),
        dlogits.stride(0),
        float(temperature),
        col0,
        BLOCK_T=bt,
        BLOCK_V=bv,
        UNIT=_unit(temperature),
        ENTROPY=entropy,
        **cfg,
    )
    return dlogits


def _grads(logits, targets, lse, ent, g_lp, g_ent, temperature, table):
    """dlogits from the gradients of the log-probabilities and (with ``ent``) the entropy;
    a missing gradient (None) is zero."""
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
    if ent is not None:
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
    else:
        g_ent = None
    return logprobs_backward(logits, targets, lse, ent, g_lp, g_ent, temperature, table)


class LogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, return_entropy, table):
        lp, lse, ent = logprobs_forward(logits, targets, temperature, return_entropy, table)
        ctx.save_for_backward(logits, targets, lse, ent if return_entropy else lse)
        ctx.temperature, ctx.entropy, ctx.table = temperature, return_entropy, table
        return (lp, ent) if return_entropy else lp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        logits, targets, lse, ent = ctx.saved_tensors
        ent = ent if ctx.entropy else None
        dlogits = _grads(logits, targets, lse, ent, g_lp, g_ent, ctx.temperature, ctx.table)
        return dlogits, None, None, None, None


def _split_forward(logits, targets, temperature=1.0, return_entropy=False, *, table):
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    lp, lse, ent = logprobs_forward(
        logits, targets.contiguous(), float(temperature), bool(return_entropy), table
    )
    return ((lp, ent) if return_entropy else (lp,)), (lse,)


def _split_backward(
    grads, outs, extras, needs, logits, targets, temperature=1.0, return_entropy=False, *, table
):
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ent = outs[1] if return_entropy else None
    g_ent = grads[1] if return_entropy else None
    dlogits = _grads(
        logits, targets.contiguous(), extras[0], ent, grads[0], g_ent, float(temperature), table
    )
    return (dlogits,)


#: ``logprobs``' forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`LogprobsFunction`; the extra is the
#: log-sum-exp.
AUTOGRAD = {"logprobs": (_split_forward, _split_backward)}


def logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    table: tuning.TuningTable,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` under ``softmax(logits / temperature)``.

    Shapes: ``logits [T, V]`` (bf16/fp16/fp32, rows contiguous), ``targets`` int64 ``[T]`` ->
    float32 ``[T]``; with ``return_entropy`` also the entropy, float32 ``[T]``. Differentiable
    with respect to ``logits``.

    Example::

        lp, ent = logprobs(logits, tokens, 1.0, True, table=backend.default_table())
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    return LogprobsFunction.apply(logits, targets, float(temperature), bool(return_entropy), table)
