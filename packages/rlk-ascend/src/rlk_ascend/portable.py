"""Portable PyTorch implementations of every rlk op with fixed-order reductions (the RL
objectives are in :mod:`rlk_ascend.portable_losses` and :mod:`rlk_ascend.portable_ppo`, on the
primitives here).

These run on any torch device (CPU in CI, an Ascend NPU through torch-npu) and never import
torch_npu. Every op computes in fp32 and rounds once to its output dtype.

Why the bits cannot depend on the batch: the only floating-point operations used on values are
elementwise (``+ - * /``, ``sqrt``, ``exp``, ``log``, ``max``, casts) and ``amax`` (exact, so
its order does not matter). Every sum is written out here as elementwise adds in one order that
depends only on constants of the op and the length of the reduction:

- :func:`fixed_sum`: the reduced dimension is cut into chunks of a constant size starting at
  index 0 (zero padded), each chunk is summed by a pairwise tree of elementwise adds
  (``x[:h] + x[h:]``), and the chunk sums are added to an fp32 accumulator starting at 0 in
  ascending order. No library reduction (``torch.sum``, ``matmul``) decides an order.
- :func:`dot`: GEMM-like products ``a @ b.T`` as elementwise fp32 products followed by
  :func:`fixed_sum` over the shared dimension in chunks of :data:`DOT_CHUNK`. This is slow
  (vector units, not a matrix unit) but its order holds by construction on any device. Blocks
  over the output (``max_elements``, the only tuning knob) only bound memory: each output
  element is computed by the same operations in any block.
- Attention: per sequence, keys in tiles of :data:`KV_TILE` aligned to the sequence's position 0,
  online softmax in ascending tile order. A query skips (``torch.where`` keeps its state) the
  tiles after its position, and masked keys contribute exact ``+0``, so training, prefill,
  chunked prefill, decode and paged attention give the same bits by construction.
- Backward: ``linear``, ``rms_norm``, ``logprobs`` and ``linear_logprobs`` have explicit
  backward passes built from the same primitives (weight gradients sum over rows in chunks of
  :data:`DOT_CHUNK` rows from row 0, in ascending order). The other ops use autograd through
  their forward; with one exception their backward is elementwise. Attention's backward is
  autograd through the per-sequence forward, in query blocks of the constant :data:`Q_BLOCK`:
  its sums over broadcast dimensions (dK/dV over the queries of a block, dQ over a KV tile) are
  torch reductions of one sequence's tensors, whose shapes do not depend on the rest of the
  batch, so they are deterministic and batch-invariant, but their order inside a block is
  torch's (not fixed here); blocks are accumulated in a fixed order.

Assumption this rests on: elementwise ops give an element the same bits wherever it sits in a
tensor. IEEE ``+ - * / sqrt`` guarantee it; ``exp``/``log`` depend on the device's math library
(on CPU, torch uses one vectorised implementation for all positions; the tests check it).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

#: Chunk of every dot-product reduction: GEMM K, the head dim of attention scores, the sum over
#: N of dX, and the sum over rows of weight gradients (row chunks aligned to row 0).
DOT_CHUNK = 32
#: Chunk of reductions along one row: RMSNorm's sum of squares, log-sum-exp and entropy over the
#: vocabulary, loss and group sums.
ROW_CHUNK = 256
#: Attention KV tile, aligned to logical position 0 of each sequence.
KV_TILE = 32
#: Attention query block, aligned to the first query of a sequence. A constant, not a tuning
#: knob: dK and dV sum over the queries of a block (torch's order), then over blocks in
#: ascending order, so the partition must not move.
Q_BLOCK = 64

#: The elements of one block's product tensor (memory bound). Never changes bits.
DEFAULT_MAX_ELEMENTS = 1 << 22
_max_elements: contextvars.ContextVar[int] = contextvars.ContextVar(
    "rlk_ascend_max_elements", default=DEFAULT_MAX_ELEMENTS
)

#: Ops whose blocking follows ``max_elements``; the conformance kit forces each config.
TUNABLE = ("linear", "linear_logprobs")
CONFIGS = ({"max_elements": 1 << 24}, {"max_elements": 1 << 16}, {"max_elements": 1 << 10})


def tuning_configs(op: str) -> list[dict[str, int]]:
    return [dict(c) for c in CONFIGS] if op in TUNABLE else []


@contextlib.contextmanager
def use_config(op: str, config: Mapping[str, Any]) -> Iterator[None]:
    token = _max_elements.set(int(config["max_elements"]))
    try:
        yield
    finally:
        _max_elements.reset(token)


# --------------------------------------------------------------------------------------------
# Fixed-order primitives
# --------------------------------------------------------------------------------------------


def _tree(x: torch.Tensor) -> torch.Tensor:
    """Pairwise sum over the last dim (a power of two): element i is added to element i + h."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def fixed_sum(x: torch.Tensor, chunk: int, acc: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 sum over the last dim in one fixed order: ``acc + tree(chunk 0) + tree(chunk 1) ...``.

    ``x [..., n]`` -> ``[...]``. Chunks of ``chunk`` (a power of two) start at index 0; the last
    is zero padded. ``acc`` (default 0) lets a caller continue a sum over a later range of
    chunk-aligned indices in the same order.
    """
    x = x.float()
    n = x.shape[-1]
    if acc is None:
        acc = x.new_zeros(x.shape[:-1])
    if n == 0:
        return acc
    chunks = -(-n // chunk)
    if chunks * chunk != n:
        x = F.pad(x, (0, chunks * chunk - n))
    parts = _tree(x.unflatten(-1, (chunks, chunk)))
    for i in range(chunks):
        acc = acc + parts[..., i]
    return acc


def dot(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``a [M, R] @ b [N, R].T`` -> ``[M, N]``, reducing R with :func:`fixed_sum`.

    Products are exact fp32 products of the fp32 inputs. ``acc [M, N]`` continues an earlier
    sum (over earlier, :data:`DOT_CHUNK`-aligned ranges of R) in the same order.
    """
    a, b = a.float(), b.float()
    m, r = a.shape
    n = b.shape[0]
    out = a.new_zeros(m, n) if acc is None else acc.clone()
    if m == 0 or n == 0 or r == 0:
        return out
    rp = -(-r // DOT_CHUNK) * DOT_CHUNK
    if rp != r:
        a, b = F.pad(a, (0, rp - r)), F.pad(b, (0, rp - r))
    limit = _max_elements.get()
    bn = max(1, min(n, limit // rp))
    bm = max(1, min(m, limit // (bn * rp)))
    for i in range(0, m, bm):
        for j in range(0, n, bn):
            prod = a[i : i + bm, None, :] * b[None, j : j + bn, :]
            out[i : i + bm, j : j + bn] = fixed_sum(prod, DOT_CHUNK, out[i : i + bm, j : j + bn])
    return out


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum over the last dim (Hillis-Steele: its order depends on n only)."""
    n, d = x.shape[-1], 1
    while d < n:
        x = torch.cat((x[..., :d], x[..., d:] + x[..., :-d]), dim=-1)
        d *= 2
    return x


# --------------------------------------------------------------------------------------------
# Dense layers
# --------------------------------------------------------------------------------------------


def _linear_fwd(x, weight, bias, out_dtype) -> torch.Tensor:
    y = dot(x, weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return _linear_fwd(x, weight, bias, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        dy = dy.float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dot(dy, weight.float().t()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = dot(dy.t(), x.float().t()).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = fixed_sum(dy.t(), DOT_CHUNK).to(bias.dtype)
        return dx, dw, db


def linear(x, weight, bias=None, *, table=None) -> torch.Tensor:
    """``x [T, K] @ weight [N, K].T + bias [N]`` -> ``[T, N]`` in x's dtype (fp32 accumulation)."""
    return _Linear.apply(x, weight, bias)


def _overflow_scale(total: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Where a sum of finite values overflowed to +/-inf: the power of two (< 1) that brings
    the largest magnitude ``amax`` into [1, 4), to multiply by exactly; 1 elsewhere."""
    over = total.isinf() & amax.isfinite()
    e = torch.frexp(torch.where(over, amax, 1.0)).exponent - 1
    return torch.where(over, torch.ldexp(torch.ones_like(amax), (-e).clamp(min=-126)), 1.0)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        if residual is not None:
            x = (x.float() + residual.float()).to(x.dtype)
        xf = x.float()
        h = xf.shape[-1]
        ss = fixed_sum(xf * xf, ROW_CHUNK)
        rstd = 1.0 / torch.sqrt(ss / h + eps)
        # Rows whose squares overflow fp32 (finite |x| above ~1.8e19): summed again after an
        # exact scaling by a power of two, as the float64 reference does not overflow.
        inv = _overflow_scale(ss, xf.abs().amax(-1) if h else ss)
        xs = xf * inv[:, None]
        rescued = 1.0 / torch.sqrt(fixed_sum(xs * xs, ROW_CHUNK) / h + eps * inv * inv) * inv
        rstd = torch.where(inv < 1, rescued, rstd)
        y = (xf * rstd[:, None] * weight.float()).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.has_residual = residual is not None
        if residual is None:
            return y
        return y, x

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, rstd = ctx.saved_tensors
        xhat = s.float() * rstd[:, None]
        dy = dy.float()
        g = dy * weight.float()
        dot_gx = fixed_sum(g * xhat, ROW_CHUNK) / xhat.shape[-1]
        dx = rstd[:, None] * (g - xhat * dot_gx[:, None])
        if ds is not None:
            dx = dx + ds.float()
        dw = fixed_sum((dy * xhat).t(), DOT_CHUNK).to(weight.dtype)
        dx = dx.to(s.dtype)
        return dx, dw, None, dx if ctx.has_residual else None


def rms_norm(x, weight, eps=1e-6, residual=None, *, table=None):
    """RMSNorm of ``x [T, H]`` with ``weight [H]``; with ``residual`` returns ``(y, x + r)``.
    ``x`` may be a heads view ``[tokens, heads, H]`` (no residual): normalised as its rows."""
    if x.dim() == 3:
        return _RMSNorm.apply(x.reshape(-1, x.shape[-1]), weight, eps, None).view(x.shape)
    return _RMSNorm.apply(x, weight, eps, residual)


def silu_and_mul(x, up=None, *, table=None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``: ``[T, 2I]`` -> ``[T, I]``; with ``up``: ``silu(x) * up``
    (elementwise, fp32)."""
    gate, up = x.float().chunk(2, dim=-1) if up is None else (x.float(), up.float())
    return (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)


def apply_rotary(x, cos, sin, k=None, *, table=None):
    """Rotate-half RoPE: ``x [T, H, D]``, ``cos``/``sin [T, D]`` (elementwise, fp32); with
    ``k [T, Hk, D]`` returns ``(x', k')``."""
    if k is not None:
        return apply_rotary(x, cos, sin, table=table), apply_rotary(k, cos, sin, table=table)
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    out1 = x1 * c[..., :half] - x2 * s[..., :half]
    out2 = x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat((out1, out2), dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def _attend(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """One sequence: ``q [nq, Hq, D]``, ``k``/``v [nk, Hk, D]`` -> fp32 ``[nq, Hq, D]``.

    Query i sits at position ``nk - nq + i``. Keys are read in tiles of KV_TILE from position 0;
    each query's state (running max, sum, accumulator) changes only on tiles it can see.
    """
    nq, hq, d = q.shape
    nk, hk, _ = k.shape
    g = hq // hk
    if nq == 0:
        return q.new_zeros(q.shape, dtype=torch.float32)
    qf = q.float().reshape(nq, hk, g, d)
    pad = -(-nk // KV_TILE) * KV_TILE - nk
    kf = F.pad(k.float(), (0, 0, 0, 0, 0, pad))
    vf = F.pad(v.float(), (0, 0, 0, 0, 0, pad))
    outs = []
    for s0 in range(0, nq, Q_BLOCK):
        qc = qf[s0 : s0 + Q_BLOCK]
        n = qc.shape[0]
        qpos = torch.arange(nk - nq + s0, nk - nq + s0 + n, device=q.device)
        last = nk - nq + s0 + n - 1 if causal else nk - 1
        m = qc.new_full((n, hk, g), -math.inf)
        den = qc.new_zeros((n, hk, g))
        acc = qc.new_zeros((n, hk, g, d))
        for t0 in range(0, last + 1, KV_TILE):
            kt = kf[t0 : t0 + KV_TILE].permute(1, 0, 2)  # [Hk, TILE, D]
            vt = vf[t0 : t0 + KV_TILE].permute(1, 0, 2)
            s = fixed_sum(qc[:, :, :, None, :] * kt[None, :, None], DOT_CHUNK) * scale
            kpos = torch.arange(t0, t0 + KV_TILE, device=q.device)
            visible = (kpos < nk)[None, :].expand(n, KV_TILE)
            if causal:
                visible = visible & (kpos[None, :] <= qpos[:, None])
            vis = visible[:, None, None, :]  # [n, 1, 1, TILE]
            s = torch.where(vis, s, -math.inf)
            # The max only shifts the exponent; it is a constant for autograd.
            m_new = torch.maximum(m, s.detach().amax(-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            pv = torch.where(vis[..., None], p[..., None] * vt[None, :, None], 0.0)
            den_new = den * alpha + fixed_sum(p, KV_TILE)
            acc_new = acc * alpha[..., None] + fixed_sum(pv.transpose(-1, -2), KV_TILE)
            if causal:  # a tile after the query's position leaves its state untouched
                active = (t0 <= qpos)[:, None, None]
                m_new = torch.where(active, m_new, m)
                den_new = torch.where(active, den_new, den)
                acc_new = torch.where(active[..., None], acc_new, acc)
            m, den, acc = m_new, den_new, acc_new
        outs.append(acc / den[..., None])
    return torch.cat(outs).reshape(nq, hq, d)


def attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    causal=True,
    scale=None,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    table=None,
) -> torch.Tensor:
    """Packed varlen attention (queries are each sequence's last tokens) -> ``[Tq, Hq, D]``.
    The offsets are read on the host; a sequence longer than a ``max_seqlen_*`` bound is a
    ``ValueError``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    nq = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
    nk = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)]
    for name, bound, lens in (
        ("max_seqlen_q", max_seqlen_q, nq),
        ("max_seqlen_k", max_seqlen_k, nk),
    ):
        if bound is not None and max(lens, default=0) > bound:
            raise ValueError(f"a sequence is longer than {name} = {bound}")
    # split (not slicing) so that each sequence's gradient is written once, never accumulated.
    qs, ks, vs = q.split(nq), k.split(nk), v.split(nk)
    outs = [_attend(qs[b], ks[b], vs[b], causal, scale) for b in range(len(nq))]
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs).to(q.dtype)


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=None, *, k_new=None,
    v_new=None, slots=None, table=None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention against a paged cache: gathers each sequence's tokens in logical order
    and runs :func:`attention`'s per-sequence code, so the bits equal :func:`attention`'s. With
    ``k_new``/``v_new`` and ``slots``: stores them in their slots first."""
    if k_new is not None:
        page_size = k_cache.shape[1]
        k_cache[slots // page_size, slots % page_size] = k_new
        v_cache[slots // page_size, slots % page_size] = v_new
    if scale is None:
        scale = q.shape[-1] ** -0.5
    page = k_cache.shape[1]
    cu_q, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    outs = [q.new_zeros((0, *q.shape[1:]), dtype=torch.float32)]
    for b, n in enumerate(lens):
        pages = block_table[b, : -(-n // page)].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        outs.append(_attend(q[cu_q[b] : cu_q[b + 1]], k, v, True, scale))
    return torch.cat(outs).to(q.dtype)


# --------------------------------------------------------------------------------------------
# Log-probabilities
# --------------------------------------------------------------------------------------------


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z = logits / temperature`` in fp32, and NaN where that overflows a finite logit: such a
    row is outside the domain of ``rlk.logprobs``, its results are NaN (as in the kernels)."""
    x = logits.float()
    z = x / temperature
    return torch.where(z.isinf() & x.isfinite(), math.nan, z)


def _lp_rows(z: torch.Tensor, targets: torch.Tensor):
    """fp32 ``z [T, V]`` (already divided by the temperature) -> (logprob, lse, entropy) [T]."""
    m = z.amax(-1)
    # 0 where z equals the max (a +inf logit too: it counts 1, and the lse is +inf)
    d = torch.where(z == m[:, None], 0.0, z - m[:, None])
    e = torch.exp(d)
    s = fixed_sum(e, ROW_CHUNK)
    log_s = torch.log(s)
    lse = m + log_s
    lp = z.gather(1, targets[:, None])[:, 0] - lse
    # -sum p log p = log s - sum(e d) / s, with p log p = 0 where p = 0 (a -inf logit); NaN
    # with a +inf logit, as p = softmax(z) is in IEEE arithmetic.
    entropy = log_s - fixed_sum(e * torch.where(e > 0, d, 0.0), ROW_CHUNK) / s
    entropy = torch.where(m == math.inf, math.nan, entropy)
    return lp, lse, entropy


def _dz(z, targets, lse, entropy, g_lp, g_ent) -> torch.Tensor:
    """Gradient with respect to ``z``: ``g_lp * (onehot - p) - g_ent * p * (log p + H)``."""
    logp = z - lse[:, None]
    p = torch.exp(logp)
    dz = -p * g_lp[:, None]
    dz = dz.scatter_add(1, targets[:, None], g_lp[:, None])
    safe_logp = torch.where(p > 0, logp, 0.0)  # p = 0 at a -inf logit: no 0 * -inf
    return dz - p * (safe_logp + entropy[:, None]) * g_ent[:, None]


class _Logprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        z = _scaled(logits, temperature)
        lp, lse, entropy = _lp_rows(z, targets)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        return lp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, entropy = ctx.saved_tensors
        z = _scaled(logits, ctx.temperature)
        dz = _dz(z, targets, lse, entropy, g_lp.float(), g_ent.float())
        return (dz / ctx.temperature).to(logits.dtype), None, None


def logprobs(logits, targets, temperature=1.0, return_entropy=False, *, table=None):
    """``logits [T, V]``, ``targets [T]`` -> fp32 log-probabilities ``[T]`` (and entropy)."""
    lp, entropy = _Logprobs.apply(logits, targets, float(temperature))
    return (lp, entropy) if return_entropy else lp


def _row_block(vocab: int) -> int:
    """Rows per block of linear_logprobs: a multiple of DOT_CHUNK (keeps dW's row chunks)."""
    rows = _max_elements.get() // max(vocab, 1)
    return max(DOT_CHUNK, rows // DOT_CHUNK * DOT_CHUNK)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, logits_dtype):
        t = hidden.shape[0]
        lp = hidden.new_empty(t, dtype=torch.float32)
        lse, entropy = torch.empty_like(lp), torch.empty_like(lp)
        rb = _row_block(weight.shape[0])
        for i in range(0, t, rb):
            logits = _linear_fwd(hidden[i : i + rb], weight, bias, logits_dtype)
            z = _scaled(logits, temperature)
            lp[i : i + rb], lse[i : i + rb], entropy[i : i + rb] = _lp_rows(z, targets[i : i + rb])
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.logits_dtype = temperature, logits_dtype
        return lp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        t, v = hidden.shape[0], weight.shape[0]
        dh = hidden.new_empty(hidden.shape, dtype=torch.float32)
        dw = weight.new_zeros(weight.shape, dtype=torch.float32)
        db = weight.new_zeros(v, dtype=torch.float32)
        wf = weight.float()
        rb = _row_block(v)
        for i in range(0, t, rb):
            rows = slice(i, i + rb)
            logits = _linear_fwd(hidden[rows], weight, bias, ctx.logits_dtype)
            z = _scaled(logits, temperature)
            dz = _dz(z, targets[rows], lse[rows], entropy[rows], g_lp[rows], g_ent[rows])
            # The gradient that an unfused linear would receive, in the logits' dtype.
            dl = (dz / temperature).to(ctx.logits_dtype).float()
            dh[rows] = dot(dl, wf.t())
            dw = dot(dl.t(), hidden[rows].float().t(), acc=dw)
            if bias is not None:
                db = fixed_sum(dl.t(), DOT_CHUNK, acc=db)
        db = db.to(bias.dtype) if bias is not None else None
        return dh.to(hidden.dtype), dw.to(weight.dtype), db, None, None, None


def linear_logprobs(
    hidden,
    weight,
    targets,
    bias=None,
    temperature=1.0,
    return_entropy=False,
    logits_dtype=None,
    *,
    table=None,
):
    """:func:`logprobs` of ``linear(hidden, weight, bias)`` rounded to ``logits_dtype``, in row
    blocks (memory bounded by a block, independent of T); bitwise equal to the unfused path."""
    lp, entropy = _LinearLogprobs.apply(
        hidden, weight, bias, targets, float(temperature), logits_dtype or hidden.dtype
    )
    return (lp, entropy) if return_entropy else lp


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def sample(logits, seeds, offsets, *, temperature, top_k, top_p, table=None) -> torch.Tensor:
    """Seeded per-row sampling (temperature, top-k, top-p, Gumbel-max with Philox uniforms of
    :mod:`rlk_reference.philox`) -> int64 ``[B]``; every row is computed on its own. A row with
    a NaN logit, an invalid temperature (< 0, infinite, NaN), top-k (< 0) or top-p (outside
    (0, 1]), or a finite logit whose ``logit / temperature`` overflows fp32, draws no token: -1."""
    from rlk_reference.philox import philox_uniform

    with torch.no_grad():
        b, vocab = logits.shape
        # None: that filter is off for every row.
        if top_k is None:
            top_k = torch.zeros(b, dtype=torch.int64, device=logits.device)
        if top_p is None:
            top_p = torch.ones(b, dtype=torch.float32, device=logits.device)
        x = logits.float()
        greedy = temperature == 0
        z = x / torch.where(greedy, 1.0, temperature.float())[:, None]
        keep = torch.ones_like(z, dtype=torch.bool)
        use_k = (top_k > 0) & (top_k < vocab)
        if bool(use_k.any()):
            kmax = int(top_k[use_k].max())
            top = torch.topk(z, kmax, dim=-1).values  # sorted descending; values are exact
            kth = top.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])
            keep = torch.where(use_k[:, None], z >= kth, keep)
        use_p = top_p < 1.0
        if bool(use_p.any()):
            zk = z.masked_fill(~keep, -math.inf)
            e = torch.exp(zk - zk.amax(-1, keepdim=True))
            p = e / fixed_sum(e, ROW_CHUNK)[:, None]
            desc = p.sort(dim=-1, descending=True).values
            reached = prefix_sum(desc) >= top_p[:, None].float()
            first = reached.int().argmax(-1)  # the first sorted value whose mass reaches top_p
            t = desc.gather(1, first[:, None])
            nucleus = (p >= t) | ~reached.any(-1, keepdim=True)
            keep = torch.where(use_p[:, None], keep & nucleus, keep)
        u = philox_uniform(seeds, offsets, vocab).to(x.device)
        score = torch.where(keep, z - torch.log(-torch.log(u)), -math.inf)
        token = torch.where(greedy, x.argmax(-1), score.argmax(-1))
        # Invalid per-row values (reachable where the host does not check them) draw no token,
        # nor does a row outside the domain: a finite logit whose z overflows float32.
        t = temperature.float()
        valid = (t >= 0) & (t < math.inf) & (top_k >= 0) & (top_p > 0) & (top_p <= 1)
        overflow = (z.isinf() & x.isfinite()).any(-1) & ~greedy
        return torch.where(x.isnan().any(-1) | ~valid | overflow, -1, token)
