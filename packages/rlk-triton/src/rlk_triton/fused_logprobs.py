"""Log-probabilities from hidden states, ``[T, H] x [V, H] -> [T]``, with bounded memory.

``linear_logprobs(h, W, t)`` must equal ``logprobs(linear(h, W), t)`` bitwise (rule 4 of the
numerics contract). It does so by construction: it runs the very kernels of those two ops, the
batch-invariant GEMM of :mod:`rlk_triton.gemm` and the row kernels of :mod:`rlk_triton.logprobs`,
on slices small enough that ``[T, V]`` is never held. Every output row of both kernels depends
only on its own input row, so slicing changes no bit.

- Forward: tokens in slices of ``_rows_per_slice(V)`` rows (a constant per vocabulary size):
  logits of the slice in ``logits_dtype`` -> log-probability, log-sum-exp and entropy per row.
- Backward: the vocabulary in slices of whole vocabulary leaves (the leaves of
  :mod:`rlk_triton.logprobs`, as many as fit in :data:`VOCAB_SLICE` rows of W, at least one);
  a slice of one longer leaf in sub-slices of ``VOCAB_SLICE`` rows (or as many as
  ``_FWD_SLICE_ELEMS`` elements hold where that is more; a multiple of 64) from the leaf's
  start, a slice of several leaves as one sub-slice. Per sub-slice: recompute the logits
  ``[T, sub]``, turn them into ``dlogits`` with the saved log-sum-exp (elementwise, in place),
  then ``dW[sub] = dlogits.T @ h`` (a complete sum over tokens in one GEMM: ascending, fixed),
  ``dbias[sub]`` (its row sums, from the same launch), and the fp32 dh product of the leaf
  part, ``dlogits[:, part] @ W[part]``, accumulated into the leaf's partial (split at
  multiples of BLOCK_K, the leaf's one K chain). The leaf partials of dh are added by the fixed
  binary tree over the :data:`~rlk_triton.logprobs.VOCAB_LEAVES` leaves (an empty leaf is an
  exact identity). So dW/dbias are deterministic, dh of a token depends only on that token,
  and a vocabulary-parallel rank's dh is a subtree of the one-device tree
  (:func:`backward_slices`); nothing is batch-dependent and nothing uses atomics.

Extra memory: one ``[T, sub]`` buffer that holds a sub-slice's logits and then its dlogits
(logits of another dtype than the model's take a second buffer), and at most
``log2(VOCAB_LEAVES) + 1`` fp32 ``[T, H]`` partial sums of the dh tree, independent of V; the
logits ``[T, V]`` never exist. That pass computes the logits twice (forward and backward): four
GEMMs of the size of the forward's in all, against three where the logits are kept.

Beyond :func:`bwd_tokens` tokens (:data:`BWD_TOKENS`, fewer where ``T x H`` would pass
:data:`BWD_ELEMS`) that memory would keep growing with T, so the backward runs in two passes
over chunks of tokens, each computing the logits again (a fifth GEMM):
:func:`weight_grads` gives dW and dbias, slices of :data:`DW_SLICE` vocabulary rows each summed
over chunks of :data:`DW_TOKENS` tokens into an fp32 accumulator that continues the one
product's K chain; then the path above gives dh for each chunk of :data:`DH_TOKENS` tokens (a
token's dh depends only on that token). The same bits as one pass; extra memory bounded by
these constants, whatever T: about 1.25 GiB at the one-pass bound (the dh tree's four partials
of ``2**26`` fp32 elements, a 256 MiB logits buffer), against 8 GiB for the fp32 logits of
16384 tokens of a 128256-token vocabulary.
"""

from __future__ import annotations

import torch

from rlk_triton import gemm, tree_gemm, tuning
from rlk_triton import logprobs as lp_mod

#: Most rows of W per backward slice (a slice holds whole vocabulary leaves, at least one).
#: Bounds memory; changes no bit (dh is summed per leaf, by the leaf tree).
VOCAB_SLICE = 8192

#: Elements of a forward logits slice (bounds forward memory; changes no bit).
_FWD_SLICE_ELEMS = 1 << 27

#: Most tokens of a one-pass backward; longer batches take two passes (bounds its logits
#: buffer to [BWD_TOKENS, VOCAB_SLICE]; changes no bit). At 16384 a 16k-token sequence of an
#: 8B-shaped model takes one pass: four GEMMs of the lm_head's size, not five (on an H100,
#: 16384 x 4096 tokens of a 128256-row lm_head: 120 ms a step, against 148 ms in two passes).
BWD_TOKENS = 16384
#: Most elements of the one-pass backward's [T, H] (bounds the dh tree's fp32 partials; at
#: H = 4096, 16384 tokens; changes no bit).
BWD_ELEMS = 1 << 26
#: Tokens per dh chunk of the two-pass backward (at most :func:`bwd_tokens`; changes no bit).
#: Small chunks cost no time there: on an H100, 32768 x 4096 tokens of a 128256-row lm_head
#: took 296 ms and 1.32 GiB a step in chunks of 1024, 306 ms and 2.48 GiB in chunks of 16384.
DH_TOKENS = 1024
#: Vocabulary rows per slice of the two-pass backward's dW (its fp32 accumulator holds
#: [DW_SLICE, H]; changes no bit).
DW_SLICE = 2048
#: Tokens per chunk of that dW sum (the logits buffer holds [DW_TOKENS, DW_SLICE]): a multiple
#: of 64, of every BLOCK_K, so that the chunks continue one K chain.
DW_TOKENS = 8192


def _rows_per_slice(v: int) -> int:
    return max(1, _FWD_SLICE_ELEMS // max(v, 1))


def _logits(h, weight, bias, logits_dtype, table, out=None):
    """``h @ weight.T + bias`` rounded to ``logits_dtype``: the GEMM kernel of ``linear``
    (into ``out`` when given)."""
    return gemm._matmul(h, weight.t(), bias, logits_dtype, table, "linear.fwd", out=out)


def _dlogits_into(view, hidden, weight, bias, targets, lse, ent, g_lp, g_ent, temperature,
                  logits_dtype, table, col0):  # fmt: skip
    """dlogits of ``hidden``'s tokens over ``weight``'s rows into ``view`` ([tokens, rows] in
    hidden's dtype, unit column stride), the rows' first being vocabulary entry ``col0`` (a
    target outside them matches none of their columns). Logits of the model's dtype are
    computed into ``view`` and turned into dlogits there; others get a tensor of their own,
    rounded once into ``view``. Every element is per (token, row): slicing changes no bit."""
    in_place = logits_dtype == hidden.dtype
    logits = _logits(hidden, weight, bias, logits_dtype, table, view if in_place else None)
    d = lp_mod.logprobs_backward(
        logits, targets, lse, ent, g_lp, g_ent, temperature, table,
        out=view if in_place else None, col0=col0,
    )  # fmt: skip
    if not in_place:
        view.copy_(d)


def _rows(x, c):
    """``x[c]``, or None for None (the entropy terms when entropy is off)."""
    return None if x is None else x[c]


def linear_leaf_states(
    hidden, weight, targets, bias, temperature, entropy, logits_dtype, table, vocab, vocab_offset
):
    """A vocabulary-parallel rank's forward: ``weight`` holds rows ``[vocab_offset, +V_local)``
    of a ``vocab``-row lm_head. Returns its subtree's ``(m, s, t or None)`` and the scaled
    target logit ``zt`` (0 where the target is another rank's), fp32 ``[T]`` each."""
    T = hidden.shape[0]
    dev = hidden.device
    out = [torch.empty(T, dtype=torch.float32, device=dev) for _ in range(4)]
    step = _rows_per_slice(weight.shape[0])
    # One buffer for every slice's logits: a new tensor per slice would live beside the last
    # one until the assignment, twice the memory.
    buf = torch.empty(min(step, T), weight.shape[0], dtype=logits_dtype, device=dev)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        logits = _logits(hidden[r0:r1], weight, bias, logits_dtype, table, out=buf[: r1 - r0])
        m, s, t, zt = lp_mod.leaf_states(
            logits, targets[r0:r1], temperature, entropy, table, vocab, vocab_offset
        )
        for dst, src in zip(out, (*lp_mod.merge_states(m, s, t, final=False), zt)):
            if src is not None:
                dst[r0:r1] = src
    return out[0], out[1], (out[2] if entropy else None), out[3]


def linear_logprobs_forward(
    hidden, weight, targets, bias, temperature, entropy, logits_dtype, table
):
    """Returns ``(logprobs, lse, entropy or None)``, fp32 ``[T]`` each: the whole vocabulary's
    subtree (the root) finished, as the unfused ``logprobs`` finishes its root."""
    m, s, t, zt = linear_leaf_states(
        hidden, weight, targets, bias, temperature, entropy, logits_dtype, table,
        weight.shape[0], 0,
    )  # fmt: skip
    col = (None if x is None else x[:, None] for x in (m, s, t))
    return lp_mod.merge_states(*col, zt, final=True)


def backward_slices(
    hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype, table,
    need_h, need_w, need_b, vocab=None, vocab_offset=0,
):  # fmt: skip
    """The backward over ``weight``'s rows (a vocabulary-parallel rank's rows ``[vocab_offset,
    +V_local)`` of a ``vocab``-row lm_head): ``(dh as the fp32 value of the rank's leaf subtree,
    dW, dbias)``, each None where not needed."""
    T, H = hidden.shape
    V = weight.shape[0]
    vocab = V if vocab is None else vocab
    leaf_len, _ = lp_mod.leaf_geometry(vocab)
    count = lp_mod.VOCAB_LEAVES if vocab == V else V // leaf_len
    per = max(1, VOCAB_SLICE // leaf_len)
    dw = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(bias) if need_b else None

    # Rows of a logits sub-slice: VOCAB_SLICE, or as many as the forward's slice holds when
    # that is more (few tokens), so that a short batch launches fewer, wider kernels; a
    # multiple of 64 (of every BLOCK_K), so that a leaf's dh product split at sub-slices is
    # the leaf's one K chain (gemm.k_loop_from).
    sub_rows = max(64, max(VOCAB_SLICE, _FWD_SLICE_ELEMS // max(T, 1)) // 64 * 64)
    # Only a slice of one leaf is cut, from the leaf's start; slices of several leaves are one
    # sub-slice (at most VOCAB_SLICE rows).
    step = sub_rows if per == 1 else per * leaf_len
    buf = None

    def sub_slice_dlogits(u0, u1):
        """dlogits of rows [u0, u1) in hidden's dtype (a view of the one reused buffer), with
        dW and dbias of those rows (:func:`_dlogits_into`)."""
        nonlocal buf
        if buf is None:  # as wide as the widest sub-slice: a slice holds at most `per` leaves
            width = min(step, V, per * leaf_len)
            buf = torch.empty(T, width, dtype=hidden.dtype, device=hidden.device)
        view = buf[:, : u1 - u0]
        _dlogits_into(
            view, hidden, weight[u0:u1], _rows(bias, slice(u0, u1)), targets, lse, ent, g_lp,
            g_ent, temperature, logits_dtype, table, vocab_offset + u0,
        )  # fmt: skip
        # dW and dbias rows written in place: no temporary, no copy.
        if need_w:
            gemm._matmul(view.t(), hidden, None, weight.dtype, table, "linear.bwd_dw",
                         rows=db[u0:u1] if need_b else None, out=dw[u0:u1])  # fmt: skip
        elif need_b:
            gemm._row_sums_into(view.t(), db[u0:u1])
        return view

    def leaf_partials():
        """Each leaf's fp32 dh partial ``dlogits[:, leaf] @ W[leaf]`` (None for an empty leaf
        or when dh is not needed), in leaf order. Slices of ``per`` whole leaves; a slice of
        one leaf in sub-slices of ``sub_rows`` rows, over which the leaf accumulates its
        product in order: the bits of its one product."""
        for first in range(0, count, per):
            v0, v1 = first * leaf_len, min(V, (first + per) * leaf_len)
            leaves = range(first, min(first + per, count))
            if v0 >= v1:
                yield from [None] * len(leaves)
                continue
            parts = {}
            for u0 in range(v0, v1, step):
                u1 = min(v1, u0 + step)
                dlogits = sub_slice_dlogits(u0, u1)
                for leaf in leaves if need_h else ():
                    a0, a1 = max(u0, leaf * leaf_len), min(u1, (leaf + 1) * leaf_len, V)
                    if a0 >= a1:
                        continue
                    parts[leaf] = gemm._matmul(
                        dlogits[:, a0 - u0 : a1 - u0], weight[a0:a1], None, torch.float32,
                        table, "linear.bwd_dx", out=parts.get(leaf), accumulate=leaf in parts,
                    )  # fmt: skip
            for leaf in leaves:
                yield parts.pop(leaf, None)

    dh = tree_gemm.tree_combine(leaf_partials())  # count: a power of two
    if need_h and dh is None:  # no vocabulary rows at all
        dh = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    return dh, dw, db


def weight_grads(
    hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype, table,
    need_w, need_b, vocab_offset=0,
):  # fmt: skip
    """``(dW, dbias)`` (None where not needed) of ``weight``'s rows (a vocabulary-parallel
    rank's rows from ``vocab_offset``), with memory bounded whatever T: per slice of
    :data:`DW_SLICE` vocabulary rows, the tokens in chunks of :data:`DW_TOKENS`, each chunk's
    logits turned into dlogits (as :func:`backward_slices` does) and its product with the
    chunk's hidden rows (or a column of ones, for dbias) added into fp32 accumulators by the
    GEMM continuing its K chain. So dW has the bits of one product over all tokens, and dbias
    those of its row sums (``tl.dot`` with ones, the chain of :func:`~rlk_triton.gemm.row_sums`):
    the bits of :func:`backward_slices`."""
    T, H = hidden.shape
    V = weight.shape[0]
    dw = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(bias) if need_b else None
    if T == 0 or V == 0 or not (need_w or need_b):
        return (dw.zero_() if need_w else None), (db.zero_() if need_b else None)
    rows, tokens = min(DW_SLICE, V), min(DW_TOKENS, T)
    dev = hidden.device
    buf = torch.empty(tokens, rows, dtype=hidden.dtype, device=dev)
    acc = torch.empty(rows, H, dtype=torch.float32, device=dev) if need_w else None
    acc_b = torch.empty(rows, 1, dtype=torch.float32, device=dev) if need_b else None
    ones = torch.ones(tokens, 1, dtype=hidden.dtype, device=dev) if need_b else None
    for u0 in range(0, V, rows):
        u1 = min(V, u0 + rows)
        for t0 in range(0, T, tokens):
            t1 = min(T, t0 + tokens)
            c = slice(t0, t1)
            view = buf[: t1 - t0, : u1 - u0]
            _dlogits_into(
                view, hidden[c], weight[u0:u1], _rows(bias, slice(u0, u1)), targets[c], lse[c],
                _rows(ent, c), g_lp[c], _rows(g_ent, c), temperature, logits_dtype, table,
                vocab_offset + u0,
            )  # fmt: skip
            if need_w:
                gemm._matmul(view.t(), hidden[t0:t1], None, torch.float32, table,
                             "linear.bwd_dw", out=acc[: u1 - u0], accumulate=t0 > 0)  # fmt: skip
            if need_b:
                gemm._matmul(view.t(), ones[: t1 - t0], None, torch.float32, table,
                             "linear.bwd_dw", out=acc_b[: u1 - u0], accumulate=t0 > 0)  # fmt: skip
        # One rounding of each fp32 sum, round-to-nearest-even as the GEMM's store rounds.
        if need_w:
            dw[u0:u1].copy_(acc[: u1 - u0])
        if need_b:
            db[u0:u1].copy_(acc_b[: u1 - u0, 0])
    return dw, db


def bwd_tokens(hidden_size: int) -> int:
    """Most tokens of a one-pass backward at this hidden size: :data:`BWD_TOKENS`, fewer where
    ``tokens x hidden_size`` would pass :data:`BWD_ELEMS`; at least 1."""
    return max(1, min(BWD_TOKENS, BWD_ELEMS // max(1, hidden_size)))


def backward(
    hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype, table,
    need_h, need_w, need_b, dh_dtype, vocab=None, vocab_offset=0,
):  # fmt: skip
    """``(dh in dh_dtype, dW, dbias)``, each None where not needed, of ``weight``'s rows (a
    vocabulary-parallel rank's, as in :func:`backward_slices`): one pass up to
    :func:`bwd_tokens` tokens; beyond, :func:`weight_grads`, then dh per chunk of
    :data:`DH_TOKENS` tokens (no more than :func:`bwd_tokens`), rounded to ``dh_dtype`` chunk by
    chunk (fp32 keeps a rank's subtree value for the exchange). The same bits either way."""
    T, H = hidden.shape
    chunk = bwd_tokens(H)
    if chunk >= T:  # one pass
        dh, dw, db = backward_slices(
            hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype,
            table, need_h, need_w, need_b, vocab, vocab_offset,
        )  # fmt: skip
        return (dh.to(dh_dtype) if need_h else None), dw, db
    dw, db = weight_grads(
        hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype, table,
        need_w, need_b, vocab_offset,
    )  # fmt: skip
    if not need_h:
        return None, dw, db
    dh = torch.empty(hidden.shape, dtype=dh_dtype, device=hidden.device)
    chunk = min(chunk, DH_TOKENS)
    for t0 in range(0, T, chunk):
        c = slice(t0, min(T, t0 + chunk))
        dh[c], _, _ = backward_slices(
            hidden[c], weight, targets[c], bias, lse[c], _rows(ent, c), g_lp[c], _rows(g_ent, c),
            temperature, logits_dtype, table, True, False, False, vocab, vocab_offset,
        )  # fmt: skip
    return dh, dw, db


def _grads(hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype,
           needs, table):  # fmt: skip
    """``(dhidden, dweight, dbias)``, each None unless ``needs`` asks; a missing gradient of
    the log-probabilities or the entropy (None) is zero."""
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
    if ent is not None:
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
    else:
        g_ent = None
    need_h, need_w, need_b = needs[0], needs[1], bias is not None and needs[2]
    return backward(
        hidden, weight, targets, bias, lse, ent, g_lp, g_ent, temperature, logits_dtype,
        table, need_h, need_w, need_b, hidden.dtype,
    )  # fmt: skip


class LinearLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, entropy, logits_dtype, table):
        lp, lse, ent = linear_logprobs_forward(
            hidden, weight, targets, bias, temperature, entropy, logits_dtype, table
        )
        ctx.save_for_backward(hidden, weight, targets, bias, lse, ent)
        ctx.temperature, ctx.entropy = temperature, entropy
        ctx.logits_dtype, ctx.table = logits_dtype, table
        return (lp, ent) if entropy else lp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        hidden, weight, targets, bias, lse, ent = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dh, dw, db = _grads(
            hidden, weight, targets, bias, lse, ent if ctx.entropy else None, g_lp, g_ent,
            ctx.temperature, ctx.logits_dtype, (needs[0], needs[1], needs[3]), ctx.table,
        )  # fmt: skip
        return dh, dw, None, db, None, None, None, None


def _split_forward(hidden, weight, targets, bias=None, temperature=1.0, return_entropy=False,
                   logits_dtype=None, *, table):  # fmt: skip
    logits_dtype = hidden.dtype if logits_dtype is None else logits_dtype
    lp, lse, ent = linear_logprobs_forward(
        hidden.contiguous(), weight, targets.contiguous(), bias, float(temperature),
        bool(return_entropy), logits_dtype, table,
    )  # fmt: skip
    return ((lp, ent) if return_entropy else (lp,)), (lse,)


def _split_backward(grads, outs, extras, needs, hidden, weight, targets, bias=None,
                    temperature=1.0, return_entropy=False, logits_dtype=None, *, table):  # fmt: skip
    logits_dtype = hidden.dtype if logits_dtype is None else logits_dtype
    ent, g_ent = (outs[1], grads[1]) if return_entropy else (None, None)
    return _grads(
        hidden.contiguous(), weight, targets.contiguous(), bias, extras[0], ent, grads[0], g_ent,
        float(temperature), logits_dtype, needs, table,
    )  # fmt: skip


#: ``linear_logprobs``' forward and backward as two calls (``rlk.plugins.OpAutograd``; the
#: ``torch.compile`` path): the launches of :class:`LinearLogprobsFunction`; the extra is the
#: log-sum-exp.
AUTOGRAD = {"linear_logprobs": (_split_forward, _split_backward)}


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logits_dtype: torch.dtype | None = None,
    *,
    table: tuning.TuningTable,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (and entropy) of ``targets`` under ``softmax(linear(hidden, weight))``.

    Shapes: ``hidden [T, H]``, ``weight [V, H]``, ``bias [V]``, ``targets`` int64 ``[T]`` ->
    float32 ``[T]`` (and entropy float32 ``[T]``). Logits are rounded to ``logits_dtype``
    (default ``hidden.dtype``) before the softmax, so the result equals
    ``logprobs(linear(hidden, weight, bias).to(logits_dtype), targets)`` bitwise.

    Example::

        lp = linear_logprobs(h, lm_head_w, tokens, table=backend.default_table())
    """
    logits_dtype = hidden.dtype if logits_dtype is None else logits_dtype
    hidden = hidden.contiguous()
    targets = targets.contiguous()
    return LinearLogprobsFunction.apply(
        hidden,
        weight,
        targets,
        bias,
        float(temperature),
        bool(return_entropy),
        logits_dtype,
        table,
    )
