"""The public operators. Each validates its inputs, then calls the selected backend.

Every op here has the same contract on every backend (see ARCHITECTURE.md, "The numerics
contract"): an output element depends only on its own logical inputs, reductions have one fixed
order, tuning never changes bits, and backward is deterministic. Validation raises
``TypeError``/``ValueError`` naming the argument before any kernel is launched.

Backends receive normalised arguments: the leading dimensions of row-wise ops are flattened to
one (``[..., H] -> [T, H]``), defaults are resolved (``scale``, ``logits_dtype``) and the
sampling parameters of :func:`sample` are per-row tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlk import _validate as chk
from rlk._plugins import backend_impl

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs")


def _call(op: str, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    return backend_impl(device).ops[op](*args, **kwargs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------------------------
# Dense layers
# --------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``y = x @ weight.T + bias``.

    Shapes: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``.
    Dtypes: bf16/fp16/fp32, all the same; output in the input dtype, accumulation in fp32
    (fp32 inputs without TF32).

    Contract: each output row depends only on its input row; K is reduced in ascending order
    with one instruction kind, whatever the number of rows or the tile config. Backward: dX has
    the same numerics; dW and dbias sum over rows in a fixed partition and order (no atomics).

    Example::

        y = rlk.linear(torch.randn(8, 64), torch.randn(32, 64))   # [8, 32]
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, min_ndim=1, nonempty_last=True)
    chk.tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if bias is not None:
        chk.tensor("bias", bias, dtypes=chk.FLOAT_DTYPES, ndim=1)
    device = chk.same_device(x=x, weight=weight, bias=bias)
    chk.same_dtype(x=x, weight=weight, bias=bias)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        chk.shape("bias", bias, (weight.shape[0],), "N = weight.shape[0]")
    y = _call("linear", device, _rows(x), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally fused with the residual add that precedes it.

    Shapes: ``x [..., H]``, ``weight [H]``, ``residual`` like ``x``.
    Without ``residual``: returns ``y = x * rsqrt(mean(x^2) + eps) * weight``.
    With ``residual``: ``s = x + residual`` is rounded to ``x.dtype`` and returned too:
    ``(rms_norm(s), s)``, bitwise equal to the two unfused calls.
    The normalisation runs in fp32 and rounds once; the output is in ``x.dtype``.

    For Qwen3's per-head q/k norm pass ``x [T, heads, head_dim]`` and ``weight [head_dim]``.

    Contract: one row's output depends only on that row; the sum of squares runs in fixed-size
    chunks in a fixed order; the weight gradient reduces over rows in a fixed partition and order.

    Example::

        y, h = rlk.rms_norm(attn_out, w, 1e-6, residual=h)
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, min_ndim=1, nonempty_last=True)
    chk.tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=1)
    eps = chk.positive_float("eps", eps)
    if residual is not None:
        chk.tensor("residual", residual, dtypes=chk.FLOAT_DTYPES)
        chk.same_dtype(x=x, residual=residual)
        chk.shape("residual", residual, x.shape, "the shape of x")
    device = chk.same_device(x=x, weight=weight, residual=residual)
    chk.shape("weight", weight, (x.shape[-1],), "H = x.shape[-1]")
    if residual is None:
        return _call("rms_norm", device, _rows(x), weight, eps, None).reshape(x.shape)
    y, s = _call("rms_norm", device, _rows(x), weight, eps, _rows(residual))
    return y.reshape(x.shape), s.reshape(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(x[..., :I]) * x[..., I:]``.

    Shapes: ``x [..., 2I]`` -> ``[..., I]`` (gate first, up second, as in a fused gate_up
    projection). Computed in fp32, rounded once to ``x.dtype``.

    Example::

        h = rlk.silu_and_mul(rlk.linear(x, w_gate_up))
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, min_ndim=1, nonempty_last=True)
    if x.shape[-1] % 2:
        raise ValueError(f"x.shape[-1] must be even (gate and up halves), got {x.shape[-1]}")
    y = _call("silu_and_mul", x.device, _rows(x))
    return y.reshape(*x.shape[:-1], x.shape[-1] // 2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, NeoX / HF "rotate half" convention.

    Shapes: ``x [T, H, D]``, ``cos``/``sin [T, D]`` (one row per token, already gathered by
    position; fp32 or the dtype of ``x``). Returns ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, computed in fp32 and rounded once.

    Example::

        q = rlk.apply_rotary(q, cos[position_ids], sin[position_ids])
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, ndim=3)
    chk.tensor("cos", cos, dtypes=chk.FLOAT_DTYPES, ndim=2)
    chk.tensor("sin", sin, dtypes=chk.FLOAT_DTYPES, ndim=2)
    device = chk.same_device(x=x, cos=cos, sin=sin)
    chk.same_dtype(cos=cos, sin=sin)
    if cos.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"cos/sin must be float32 or x's dtype {x.dtype}, got {cos.dtype}")
    T, _, D = x.shape
    if D % 2:
        raise ValueError(f"x's head dim must be even, got {D}")
    chk.shape("cos", cos, (T, D), "[T, D] of x")
    chk.shape("sin", sin, (T, D), "[T, D] of x")
    return _call("apply_rotary", device, x, cos, sin)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def _check_qkv_heads(q: torch.Tensor, hk: int, d: int, kname: str) -> None:
    if q.shape[2] != d:
        raise ValueError(f"q's head dim {q.shape[2]} differs from {kname}'s head dim {d}")
    if hk == 0 or q.shape[1] % hk:
        raise ValueError(
            f"q's {q.shape[1]} heads must be a multiple of {kname}'s {hk} KV heads (GQA/MQA)"
        )


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else chk.positive_float("scale", scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Variable-length (packed) multi-head attention with GQA/MQA.

    Shapes: ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hk, D]`` with ``Hq % Hk == 0``;
    ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B + 1]`` offsets of each sequence.
    Sequence ``b`` has ``nq = cu_q[b+1] - cu_q[b]`` queries and ``nk >= nq`` keys; its queries
    are its *last* ``nq`` tokens (bottom-right aligned), which covers training (nq == nk),
    prefill, chunked prefill and decode (nq == 1). Returns ``[Tq, Hq, D]`` in q's dtype.
    ``scale`` defaults to ``1/sqrt(D)``.

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
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
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
    return _call("attention", device, q, k, v, cu_q, cu_k, causal, _scale(scale, q.shape[2]))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of new queries against a paged KV cache; the same bits as :func:`attention`.

    Shapes: ``q [Tq, Hq, D]``; ``k_cache``/``v_cache [pages, page_size, Hk, D]``;
    ``block_table`` int32 ``[B, max_pages]`` (page ids of each sequence in order);
    ``seq_lens`` int32 ``[B]``: cached tokens of each sequence *including* its new ones;
    ``cu_seqlens_q`` int32 ``[B + 1]``: the new queries, the last tokens of each sequence.
    Returns ``[Tq, Hq, D]``.

    Contract: bitwise equal to :func:`attention` on the same logical sequence, whatever the page
    size, the page order in memory, or the batch.

    Example::

        o = rlk.paged_attention(q, kc, vc, block_table, seq_lens, cu_q)   # decode: 1 query/seq
    """
    chk.tensor("q", q, dtypes=chk.FLOAT_DTYPES, ndim=3)
    chk.tensor("k_cache", k_cache, dtypes=chk.FLOAT_DTYPES, ndim=4)
    chk.tensor("v_cache", v_cache, dtypes=chk.FLOAT_DTYPES, ndim=4)
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
    )


# --------------------------------------------------------------------------------------------
# Log-probabilities
# --------------------------------------------------------------------------------------------


def _check_targets(targets: object, t: int, vocab: int) -> torch.Tensor:
    targets = chk.tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    chk.shape("targets", targets, (t,), "one per row")
    chk.index_range("targets", targets, 0, vocab, f"vocabulary of {vocab}")
    return targets


def logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target under ``softmax(logits / temperature)``, and its entropy.

    Shapes: ``logits [T, V]`` (bf16/fp16/fp32), ``targets`` int64 ``[T]`` -> float32 ``[T]``
    (and entropy float32 ``[T]`` with ``return_entropy``). ``logits`` is read once; the
    log-sum-exp runs over the vocabulary in fixed-size chunks in a fixed order.
    Differentiable with respect to ``logits``.

    Example::

        lp = rlk.logprobs(logits, sampled_tokens)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    chk.tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    chk.same_device(logits=logits, targets=targets)
    targets = _check_targets(targets, logits.shape[0], logits.shape[1])
    temperature = chk.positive_float("temperature", temperature)
    return _call("logprobs", logits.device, logits, targets, temperature, bool(return_entropy))


def check_linear_logprobs(hidden, weight, targets, bias, temperature, logits_dtype, vocab=None):
    """Validate :func:`linear_logprobs`' arguments (``weight`` may hold a slice of a
    ``vocab``-row lm_head): returns ``(device, targets, temperature, logits_dtype)``."""
    chk.tensor("hidden", hidden, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    chk.tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if bias is not None:
        chk.tensor("bias", bias, dtypes=chk.FLOAT_DTYPES, ndim=1)
    chk.tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    device = chk.same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    chk.same_dtype(hidden=hidden, weight=weight, bias=bias)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocabulary row")
    if bias is not None:
        chk.shape("bias", bias, (weight.shape[0],), "V = weight.shape[0]")
    targets = _check_targets(targets, hidden.shape[0], weight.shape[0] if vocab is None else vocab)
    temperature = chk.positive_float("temperature", temperature)
    if logits_dtype is None:
        logits_dtype = hidden.dtype
    if not isinstance(logits_dtype, torch.dtype) or logits_dtype not in chk.FLOAT_DTYPES:
        raise TypeError(f"logits_dtype must be one of bf16/fp16/fp32, got {logits_dtype!r}")
    return device, targets, temperature, logits_dtype


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs` of ``linear(hidden, weight, bias)`` without materialising the logits.

    Shapes: ``hidden [T, H]``, ``weight [V, H]``, ``bias [V]``, ``targets`` int64 ``[T]`` ->
    float32 ``[T]`` (and entropy). ``logits_dtype`` (default ``hidden.dtype``, what rollout
    engines materialise) is the dtype each logit is rounded to before the softmax, so that
    ``linear_logprobs(h, W, t) == logprobs(linear(h, W), t)`` bitwise. Extra memory is bounded
    by a chunk, independent of T. Backward gives dHidden, dWeight, dBias deterministically.

    Example::

        lp = rlk.linear_logprobs(h, lm_head.weight, targets)
    """
    device, targets, temperature, logits_dtype = check_linear_logprobs(
        hidden, weight, targets, bias, temperature, logits_dtype
    )
    return _call(
        "linear_logprobs",
        device,
        hidden,
        weight,
        targets,
        bias,
        temperature,
        bool(return_entropy),
        logits_dtype,
    )


# --------------------------------------------------------------------------------------------
# RL objectives
# --------------------------------------------------------------------------------------------


def _check_padded(name: str, t: object, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = chk.tensor(name, t, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if shape is not None:
        chk.shape(name, t, shape, "[B, L] of logprobs")
    return t


def _check_mask(mask: object, shape: tuple[int, ...]) -> torch.Tensor:
    mask = chk.tensor("mask", mask, dtypes=(torch.bool, *chk.FLOAT_DTYPES), ndim=2)
    chk.shape("mask", mask, shape, "[B, L] of logprobs")
    if (
        mask.dtype != torch.bool
        and chk.value_checks_enabled(mask)
        and not bool(((mask == 0) | (mask == 1)).all())
    ):
        raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
    return mask


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy-gradient loss on padded ``[B, L]`` tensors.

    Per token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:
    ``pg = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))``; with dual clip
    (``clip_c > 1``) tokens with ``A < 0`` take ``min(pg, -A * clip_c)``. With
    ``rollout_logprobs`` and ``tis_cap``, ``pg`` is multiplied by the truncated importance weight
    ``min(exp(old_logprobs - rollout_logprobs), tis_cap)`` (no gradient through it).

    ``advantages`` is ``[B, L]`` or ``[B]`` (one per sequence). ``mask`` (bool or 0/1) marks
    response tokens. ``agg``:

    - ``token-mean``: sum of masked ``pg`` over the batch / number of masked tokens;
    - ``seq-mean-token-sum``: mean over sequences of each sequence's masked sum;
    - ``seq-mean-token-mean``: mean over sequences of each sequence's masked mean;
    - ``seq-mean-token-sum-norm``: sum of masked ``pg`` over the batch / ``L`` (Dr. GRPO).

    Sequence means count only sequences with at least one response token; an empty batch gives
    a loss of 0. All sums run in fp32 in a fixed order. Returns ``(loss, metrics)``: a 0-d fp32
    loss, differentiable with respect to ``logprobs``, and 0-d detached fp32 tensors
    ``clip_fraction`` (tokens whose clipped term was taken), ``approx_kl`` (masked mean of
    ``old - new``), ``ratio_mean``, ``ratio_max`` and, with dual clip, ``dual_clip_fraction``.

    Example::

        loss, m = rlk.policy_loss(lp, old_lp, adv, mask, agg="seq-mean-token-mean")
    """
    logprobs = _check_padded("logprobs", logprobs)
    shape = tuple(logprobs.shape)
    old_logprobs = _check_padded("old_logprobs", old_logprobs, shape)
    advantages = chk.tensor("advantages", advantages, dtypes=chk.FLOAT_DTYPES, ndim=(1, 2))
    if advantages.dim() == 1:
        chk.shape("advantages", advantages, shape[:1], "[B] or [B, L] of logprobs")
    else:
        chk.shape("advantages", advantages, shape, "[B] or [B, L] of logprobs")
    mask = _check_mask(mask, shape)
    clip_low = chk.positive_float("clip_low", clip_low, allow_zero=True)
    clip_high = chk.positive_float("clip_high", clip_high, allow_zero=True)
    if clip_low >= 1:
        raise ValueError(
            f"clip_low must be < 1 (the ratio is clamped at 1 - clip_low), got {clip_low}"
        )
    if clip_c is not None:
        clip_c = chk.positive_float("clip_c", clip_c)
        if clip_c <= 1:
            raise ValueError(f"clip_c must be > 1 for dual clip, got {clip_c}")
    agg = chk.choice("agg", agg, AGG_MODES)
    if (rollout_logprobs is None) != (tis_cap is None):
        raise ValueError("rollout_logprobs and tis_cap must be given together (truncated IS)")
    if rollout_logprobs is not None:
        rollout_logprobs = _check_padded("rollout_logprobs", rollout_logprobs, shape)
        tis_cap = chk.positive_float("tis_cap", tis_cap)
    device = chk.same_device(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        rollout_logprobs=rollout_logprobs,
    )
    return _call(
        "policy_loss",
        device,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=clip_c,
        agg=agg,
        rollout_logprobs=rollout_logprobs,
        tis_cap=tis_cap,
    )


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token KL estimate between the policy and a reference, ``[B, L]`` -> fp32 ``[B, L]``.

    With ``d = logprobs - ref_logprobs``: ``k1 = d``; ``abs = |d|``; ``k2 = d^2 / 2``;
    ``k3 = exp(-d) + d - 1`` (the low-variance estimator), clamped to ``[-10, 10]``.
    Differentiable with respect to ``logprobs``.

    Example::

        kl = rlk.kl_penalty(lp, ref_lp, "k3")
    """
    logprobs = _check_padded("logprobs", logprobs)
    ref_logprobs = _check_padded("ref_logprobs", ref_logprobs, tuple(logprobs.shape))
    kind = chk.choice("kind", kind, KL_KINDS)
    device = chk.same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return _call("kl_penalty", device, logprobs, ref_logprobs, kind)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, norm_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages: ``(r - mean_g) / (std_g + eps)``.

    Shapes: ``rewards [N]`` with ``N = groups * group_size``, the responses of one prompt
    contiguous -> fp32 ``[N]``. ``std_g`` is the unbiased (Bessel) standard deviation of the
    group; with ``norm_std=False`` only the mean is subtracted (Dr. GRPO). Group sums run in a
    fixed order. ``group_size`` must be at least 2.

    Example::

        adv = rlk.grpo_advantages(rewards, group_size=8)
    """
    rewards = chk.tensor("rewards", rewards, dtypes=chk.FLOAT_DTYPES, ndim=1)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group needs a baseline), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}"
        )
    eps = chk.positive_float("eps", eps, allow_zero=True)
    return _call(
        "grpo_advantages", rewards.device, rewards, group_size, norm_std=bool(norm_std), eps=eps
    )


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def _per_row(
    name: str, value: object, b: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        want = (torch.int64, torch.int32) if dtype == torch.int64 else chk.FLOAT_DTYPES
        chk.tensor(name, value, dtypes=want, ndim=1)
        chk.shape(name, value, (b,), "one per row of logits")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but logits is on {device}")
        return value.to(dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")
    if dtype == torch.int64 and not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return torch.full((b,), value, dtype=dtype, device=device)


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Seeded per-row sampling with temperature, top-k and top-p; ``[B, V]`` -> int64 ``[B]``.

    Row ``b`` draws with a counter-based RNG (Philox-4x32-10 keyed by ``seeds[b]``, counter
    ``(vocab index, offsets[b])``), so its token depends only on its logits, seed and offset,
    never on the batch. Method: Gumbel-max over the filtered distribution: scale by
    ``1/temperature``; keep the ``top_k`` largest (ties kept; 0 = off); then keep the tokens with
    probability >= the largest threshold whose kept mass is >= ``top_p`` (1.0 = off); pick
    ``argmax(logit/temperature + gumbel)`` (lowest index on ties). ``temperature == 0`` is greedy.
    Each parameter is a number or a per-row ``[B]`` tensor.

    Example::

        tok = rlk.sample(logits, seeds, step_offsets, temperature=0.7, top_p=0.9)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    b, vocab = logits.shape
    device = logits.device
    seeds = _per_row("seeds", seeds, b, torch.int64, device)
    offsets = _per_row("offsets", offsets, b, torch.int64, device)
    temperature = _per_row("temperature", temperature, b, torch.float32, device)
    top_k = _per_row("top_k", top_k, b, torch.int64, device)
    top_p = _per_row("top_p", top_p, b, torch.float32, device)
    if chk.value_checks_enabled(logits) and b:
        if bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all()):
            raise ValueError("temperature must be finite and >= 0 (0 = greedy)")
        if bool((top_k < 0).any()):
            raise ValueError("top_k must be >= 0 (0 = off)")
        if bool(((top_p <= 0) | (top_p > 1)).any()):
            raise ValueError("top_p must be in (0, 1] (1 = off)")
        if bool((offsets < 0).any()):
            raise ValueError("offsets must be >= 0")
    return _call(
        "sample",
        device,
        logits,
        seeds,
        offsets,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
