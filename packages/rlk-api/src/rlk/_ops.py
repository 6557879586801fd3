"""The public operators. Each validates its inputs, then calls the selected backend.

Every op here has the same contract on every backend (docs/guide.md, "The numerics
contract"): an output element depends only on its own logical inputs, reductions have one fixed
order, tuning never changes bits, and backward is deterministic. Validation raises
``TypeError``/``ValueError`` naming the argument before any kernel is launched.

Backends receive normalised arguments: the leading dimensions of row-wise ops are flattened to
one (``[..., H] -> [T, H]``), defaults are resolved (``scale``, ``logits_dtype``,
``norm_length``), the sampling parameters of :func:`sample` are per-row tensors, and the RL
objectives get rlk's names for verl's (KL kinds, estimators), ``is_max`` for ``tis_cap``,
``norm_std`` as ``"group"``/``"batch"``/``"none"`` and ``reject`` as ``{option: (lower,
upper)}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rlk import _validate as chk
from rlk._plugins import backend_impl

#: ``policy_loss`` aggregations (see its docstring; docs/objectives.md maps verl's and TRL's).
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "row-mean-token-mean",
    "row-mean-token-sum-norm",
)
RATIO_LEVELS = ("token", "sequence")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
#: verl's rejection-sampling options (``rollout_rs``), in the order they are applied.
REJECT_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
#: verl's KL names -> rlk's.
KL_ALIASES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "kl+": "k1+",
    "k2+": "k2",
    "mse+": "k2",
    "low_var_kl+": "k3+",
}
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce++", "reinforce++-baseline")
#: verl's estimator names -> rlk's.
ADV_ALIASES = {
    "reinforce_plus_plus": "reinforce++",
    "reinforce_plus_plus_baseline": "reinforce++-baseline",
}
NORM_STD = ("group", "batch", "none")


def _call(op: str, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    return backend_impl(device).ops[op](*args, **kwargs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # A 2-D tensor as it is: a reshape is a few microseconds of host time per call.
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _unrows(y: torch.Tensor, *shape: int) -> torch.Tensor:
    return y if y.dim() == len(shape) else y.reshape(shape)


# --------------------------------------------------------------------------------------------
# Dense layers
# --------------------------------------------------------------------------------------------


_FLOAT_DTYPES = frozenset(chk.FLOAT_DTYPES)


def _plain_linear_args(x: object, weight: object, bias: object) -> bool:
    """Whether ``x``, ``weight`` (and ``bias``) pass every check of :func:`check_linear`, in a
    few comparisons: a decode step makes hundreds of these calls, each worth microseconds of
    host time. False sends them through the named checks, which say what is wrong."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return False
    dtype = x.dtype
    if (
        dtype not in _FLOAT_DTYPES
        or weight.dtype != dtype
        or weight.dim() != 2
        or x.dim() == 0
        or x.shape[-1] == 0
        or weight.shape[1] != x.shape[-1]
        or weight.device != x.device
        or not (x.is_contiguous() and weight.is_contiguous())
    ):
        return False
    return bias is None or (
        isinstance(bias, torch.Tensor)
        and bias.dtype == dtype
        and bias.dim() == 1
        and bias.shape[0] == weight.shape[0]
        and bias.device == x.device
        and bias.is_contiguous()
    )


def check_linear(x: object, weight: object, bias: object) -> torch.device:
    """The checks of :func:`linear`'s arguments (also those of ``rlk.parallel``'s linears);
    returns their device."""
    if _plain_linear_args(x, weight, bias):
        return x.device
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
    return device


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
    device = check_linear(x, weight, bias)
    y = _call("linear", device, _rows(x), weight, bias)
    return _unrows(y, *x.shape[:-1], weight.shape[0])


def _plain_norm_args(x: object, weight: object, eps: object, residual: object) -> bool:
    """Whether :func:`rms_norm`'s arguments pass all its checks, in a few comparisons (a model
    layer makes four such calls); False sends them through the named checks."""
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and type(eps) is float
        and 0.0 < eps < math.inf
    ):
        return False
    if (
        x.dtype not in _FLOAT_DTYPES
        or weight.dtype not in _FLOAT_DTYPES
        or x.dim() == 0
        or weight.dim() != 1
        or x.shape[-1] == 0
        or weight.shape[0] != x.shape[-1]
        or weight.device != x.device
        or not (x.is_contiguous() and weight.is_contiguous())
    ):
        return False
    return residual is None or (
        isinstance(residual, torch.Tensor)
        and residual.dtype == x.dtype
        and residual.shape == x.shape
        and residual.device == x.device
        and residual.is_contiguous()
    )


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
    if _plain_norm_args(x, weight, eps, residual):
        device = x.device
    else:
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
        return _unrows(_call("rms_norm", device, _rows(x), weight, eps, None), *x.shape)
    y, s = _call("rms_norm", device, _rows(x), weight, eps, _rows(residual))
    return _unrows(y, *x.shape), _unrows(s, *x.shape)


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation: ``silu(x[..., :I]) * x[..., I:]``, or ``silu(x) * up``.

    Shapes: ``x [..., 2I]`` -> ``[..., I]`` (gate first, up second, as in a fused gate_up
    projection); or ``x`` (the gate) and ``up`` both ``[..., I]`` -> ``[..., I]``, which spares
    the copy that concatenating two projections would make. Computed in fp32, rounded once to
    ``x.dtype``; both forms give the same bits for the same gate and up values.

    Contract: elementwise; each output depends only on its own gate and up values.

    Example::

        h = rlk.silu_and_mul(rlk.linear(x, w_gate_up))
        h = rlk.silu_and_mul(rlk.linear(x, w_gate), rlk.linear(x, w_up))
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, min_ndim=1, nonempty_last=True)
    if up is not None:
        chk.tensor("up", up, dtypes=chk.FLOAT_DTYPES)
        chk.same_dtype(x=x, up=up)
        chk.same_device(x=x, up=up)
        chk.shape("up", up, x.shape, "the shape of x")
        return _unrows(_call("silu_and_mul", x.device, _rows(x), _rows(up)), *x.shape)
    if x.shape[-1] % 2:
        raise ValueError(f"x.shape[-1] must be even (gate and up halves), got {x.shape[-1]}")
    y = _call("silu_and_mul", x.device, _rows(x))
    return _unrows(y, *x.shape[:-1], x.shape[-1] // 2)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding, NeoX / HF "rotate half" convention.

    Shapes: ``x [T, H, D]``, ``cos``/``sin [T, D]`` (one row per token, already gathered by
    position; fp32 or the dtype of ``x``). Returns ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, computed in fp32 and rounded once.

    With ``k [T, Hk, D]`` (the keys, in ``x``'s dtype; any number of heads) returns the pair
    ``(x', k')``, both rotated by one kernel that reads cos and sin once for both: each is
    bitwise what its own call returns.

    Contract: elementwise; each element depends only on its own input, cos and sin.

    Example::

        q, k = rlk.apply_rotary(q, cos[position_ids], sin[position_ids], k=k)
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, ndim=3)
    chk.tensor("cos", cos, dtypes=chk.FLOAT_DTYPES, ndim=2)
    chk.tensor("sin", sin, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if k is not None:
        chk.tensor("k", k, dtypes=chk.FLOAT_DTYPES, ndim=3)
        chk.same_dtype(x=x, k=k)
    device = chk.same_device(x=x, cos=cos, sin=sin, k=k)
    chk.same_dtype(cos=cos, sin=sin)
    if cos.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"cos/sin must be float32 or x's dtype {x.dtype}, got {cos.dtype}")
    T, _, D = x.shape
    if D % 2:
        raise ValueError(f"x's head dim must be even, got {D}")
    chk.shape("cos", cos, (T, D), "[T, D] of x")
    chk.shape("sin", sin, (T, D), "[T, D] of x")
    if k is None:  # a one-tensor call passes no k
        return _call("apply_rotary", device, x, cos, sin)
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must be [T, Hk, D] with T={T} and D={D} of x, got {tuple(k.shape)}")
    return _call("apply_rotary", device, x, cos, sin, k)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


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

    The caches may be strided views (any page, token and head strides; ``D`` contiguous), such
    as the key and value halves of a serving engine's blocks.

    Contract: bitwise equal to :func:`attention` on the same logical sequence, whatever the page
    size, the page order in memory, the caches' strides, or the batch.

    Example::

        o = rlk.paged_attention(q, kc, vc, block_table, seq_lens, cu_q)   # decode: 1 query/seq
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
    return_entropy = chk.flag("return_entropy", return_entropy)
    return _call("logprobs", logits.device, logits, targets, temperature, return_entropy)


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
    return_entropy = chk.flag("return_entropy", return_entropy)
    return _call(
        "linear_logprobs",
        device,
        hidden,
        weight,
        targets,
        bias,
        temperature,
        return_entropy,
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


def _check_mask(mask: object, shape: tuple[int, ...], of: str = "logprobs") -> torch.Tensor:
    mask = chk.tensor("mask", mask, dtypes=(torch.bool, *chk.FLOAT_DTYPES), ndim=2)
    if of == "logprobs":
        chk.shape("mask", mask, shape, "[B, L] of logprobs")
    elif mask.shape[0] != shape[0]:
        raise ValueError(f"mask must be [N, L] with N = {of} = {shape[0]}, got {tuple(mask.shape)}")
    if (
        mask.dtype != torch.bool
        and chk.value_checks_enabled(mask)
        and not bool(((mask == 0) | (mask == 1)).all())
    ):
        raise ValueError("mask must hold only 0 and 1 (or be a bool tensor)")
    return mask


def _alias(name: str, v: object, options: tuple[str, ...], aliases: dict[str, str]) -> str:
    """``v`` if it is one of ``options``, its rlk name if it is a peer's alias, else an error."""
    if isinstance(v, str) and v in aliases:
        return aliases[v]
    return chk.choice(name, v, options + tuple(aliases))


def _bound(name: str, v: object) -> float | None:
    return None if v is None else chk.positive_float(name, v)


def _count(name: str, v: object, device: torch.device) -> float | torch.Tensor | None:
    """A positive count or scale: a Python number, or a 0-d tensor on the op's device (so that a
    count summed over ranks on the GPU needs no host sync)."""
    if v is None:
        return None
    if not isinstance(v, torch.Tensor):
        return chk.positive_float(name, v)
    if v.dim() != 0 or v.dtype == torch.bool or v.is_complex():
        raise TypeError(f"{name} must be a number or a 0-d real tensor, got {v.dtype} {v.shape}")
    if v.device != device:
        raise ValueError(f"{name} is on {v.device} but logprobs is on {device}")
    if chk.value_checks_enabled(v) and not bool(torch.isfinite(v) & (v > 0)):
        raise ValueError(f"{name} must be finite and > 0, got {float(v)}")
    return v


def _reject(reject: object) -> dict[str, tuple[float | None, float]] | None:
    """verl's rejection options -> ``{option: (lower, upper)}`` in :data:`REJECT_OPTIONS` order.

    ``*_k1`` options take ``(lower, upper)`` bounds of ``exp(k1)`` (one number ``u`` means
    ``(1/u, u)``); ``*_k2``/``*_k3`` options take one upper bound."""
    if reject is None:
        return None
    if not isinstance(reject, Mapping) or not reject:
        raise TypeError(
            "reject must be a non-empty dict {option: threshold}, got "
            f"{type(reject).__name__}{'' if reject else ' (empty)'}"
        )
    out: dict[str, tuple[float | None, float]] = {}
    for option in REJECT_OPTIONS:
        if option not in reject:
            continue
        spec = reject[option]
        where = f"reject[{option!r}]"
        if option.endswith("k1"):
            if isinstance(spec, tuple | list):
                if len(spec) != 2:
                    raise ValueError(f"{where} must be (lower, upper), got {spec!r}")
                lo, hi = (chk.positive_float(where, s) for s in spec)
                if lo > hi:
                    raise ValueError(f"{where} must have lower <= upper, got {spec!r}")
            else:
                hi = chk.positive_float(where, spec)
                lo = 1.0 / hi
            out[option] = (lo, hi)
        else:
            out[option] = (None, chk.positive_float(where, spec))
    unknown = [k for k in reject if k not in REJECT_OPTIONS]
    if unknown:
        raise ValueError(
            f"reject has unknown options {unknown}; the options are {', '.join(REJECT_OPTIONS)}"
        )
    return out


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
    ratio_level: str = "token",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    is_level: str | None = "token",
    is_mode: str = "truncate",
    is_min: float | None = None,
    is_max: float | None = None,
    is_normalize: bool | float | torch.Tensor = False,
    reject: Mapping[str, Any] | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/GSPO clipped policy-gradient loss on padded ``[B, L]`` tensors.

    Shapes: ``logprobs`` (differentiable), ``old_logprobs``, ``mask`` (bool or 0/1: response
    tokens), ``rollout_logprobs`` ``[B, L]``; ``advantages`` ``[B, L]`` or ``[B]`` (one per
    sequence). Dtypes bf16/fp16/fp32; the loss and metrics are 0-d fp32 and every sum runs in
    fp32 in a fixed order. Only ``logprobs`` gets a gradient. Mapping of every verl 0.9.1 / TRL
    1.16 setting to these arguments: ``docs/objectives.md``.

    **Ratio.** ``ratio_level="token"``: ``r = exp(logprobs - old_logprobs)`` per token.
    ``"sequence"`` (GSPO): every token of a sequence takes ``s = exp(mean(logprobs -
    old_logprobs))`` over its tokens, and its gradient is that of ``s * exp(lp - sg(lp))`` (the
    sequence ratio's gradient, spread evenly over the tokens).

    **Per token**, with advantage ``A``: ``pg = max(-A * r, -A * clamp(r, 1 - clip_low, 1 +
    clip_high))``; dual clip (``clip_c > 1``; verl's default ``clip_ratio_c=3.0``, off here by
    default): tokens with ``A < 0`` take ``min(pg, -A * clip_c)``.

    **Importance sampling against the rollout engine** (``rollout_logprobs``; no gradient):
    ``pg *= w`` with ``log w = old_logprobs - rollout_logprobs`` per token (``is_level="token"``)
    or summed over the sequence (``"sequence"``: the product of the token ratios), clamped to
    ``[-20, 20]``; ``is_level=None``: no weights (``rollout_logprobs`` for ``reject`` only).
    ``is_mode="truncate"`` clamps ``w`` to ``[is_min, is_max]``; ``"mask"`` sets ``w = 0``
    outside that range (IcePop / TRL ``*_mask``). ``tis_cap`` is the old name of ``is_max``.
    ``is_normalize=True`` divides ``w`` by its mean over the batch (over tokens, or over
    sequences at sequence level; left alone when that mean is <= 1e-8, as verl); a number or
    0-d tensor divides by that value instead (the mean over the whole batch when the batch is
    split into micro-batches: ``metrics["is_weight_mean"]`` of a call on the whole batch).

    **Rejection** (verl ``rollout_rs``): ``reject={option: threshold}`` removes tokens or whole
    sequences from ``mask`` (and so from every count and metric) where the rollout policy
    strays. Per token ``k1 = rollout - old``, ``k2 = k1^2 / 2``, ``k3 = exp(-k1) - 1 + k1``
    (estimators of KL(rollout || old), log-ratios clamped to ``[-20, 20]``); options
    ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}`` (over the sequence's tokens),
    ``seq_max_k{2,3}``. ``*_k1`` options keep ``lower <= exp(stat) <= upper`` (threshold
    ``(lower, upper)``, or ``u`` for ``(1/u, u)``); the others keep ``stat <= threshold``. A
    token stays if every option keeps it. Statistics use the given ``mask``.

    **Aggregation** ``agg`` of the masked ``pg`` (``n_b`` tokens of sequence ``b``; ``S`` =
    sequences with ``n_b > 0``, or ``num_seqs``; ``R`` = rows ``B``, or ``num_seqs``; ``N`` = all
    tokens, or ``num_tokens``; ``Ln`` = ``norm_length``, default ``L``):

    - ``token-mean``: ``sum / N`` (verl ``token-mean``; TRL ``bnpo``, and ``dapo`` with
      ``num_tokens``);
    - ``token-sum``: ``sum``;
    - ``seq-mean-token-sum``: ``sum_b (sum of b) / S``;
    - ``seq-mean-token-mean``: ``sum_b (mean of b) / S``;
    - ``seq-mean-token-sum-norm``: ``sum / (S * Ln)`` (verl, Dr. GRPO);
    - ``row-mean-token-mean``: ``sum_b (sum of b / max(n_b, 1)) / R`` (TRL ``grpo``: empty rows
      count);
    - ``row-mean-token-sum-norm``: ``sum / (R * Ln)`` (TRL ``dr_grpo`` with ``norm_length =
      max_completion_length``).

    A zero denominator gives a loss of 0. With ``num_tokens``/``num_seqs`` set to the totals of
    the whole batch, the losses of its micro-batches add up to the loss of the whole batch (under
    data parallelism, multiply by the world size if the gradients are averaged over ranks).
    ``num_tokens``/``num_seqs`` are numbers or 0-d tensors on the device.

    Returns ``(loss, metrics)``: 0-d fp32 ``loss``, differentiable with respect to ``logprobs``,
    and 0-d detached fp32 metrics over the tokens kept: ``clip_fraction`` (tokens whose clipped
    term was taken), ``approx_kl`` (mean of ``old - new``), ``ratio_mean``, ``ratio_max``; with
    dual clip ``dual_clip_fraction``; with importance weights ``is_weight_mean`` (mean of the
    bounded weights before ``is_normalize``, over the tokens or sequences of ``mask``); with
    ``reject`` ``reject_fraction`` (tokens of ``mask`` removed).

    Example::

        loss, m = rlk.policy_loss(lp, old_lp, adv, mask, agg="seq-mean-token-mean")
        # verl defaults (vanilla, clip 0.2, dual clip 3.0, token-mean) with token TIS at 2.0:
        loss, m = rlk.policy_loss(lp, old_lp, adv, mask, clip_c=3.0,
                                  rollout_logprobs=rollout_lp, is_max=2.0)
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
    if rollout_logprobs is not None:
        rollout_logprobs = _check_padded("rollout_logprobs", rollout_logprobs, shape)
    device = chk.same_device(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        rollout_logprobs=rollout_logprobs,
    )
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
    ratio_level = chk.choice("ratio_level", ratio_level, RATIO_LEVELS)
    if is_level is not None:
        is_level = chk.choice("is_level", is_level, IS_LEVELS)
    is_mode = chk.choice("is_mode", is_mode, IS_MODES)
    if tis_cap is not None:
        if is_max is not None:
            raise ValueError("tis_cap is the old name of is_max: give one of them")
        is_max = tis_cap
    is_min, is_max = _bound("is_min", is_min), _bound("is_max", is_max)
    if is_min is not None and is_max is not None and is_min > is_max:
        raise ValueError(f"is_min must be <= is_max, got {is_min} > {is_max}")
    if not isinstance(is_normalize, bool):
        is_normalize = _count("is_normalize", is_normalize, device)
    reject = _reject(reject)
    if rollout_logprobs is None:
        given = [n for n, v in (("is_min", is_min), ("is_max", is_max), ("reject", reject)) if v]
        if is_normalize is not False:
            given.append("is_normalize")
        if is_level == "sequence" or is_mode != "truncate":
            given.append("is_level/is_mode")
        if given:
            raise ValueError(
                f"{', '.join(given)} need rollout_logprobs (importance sampling / rejection)"
            )
    elif is_level is None and (
        is_min is not None or is_max is not None or is_normalize is not False
    ):
        raise ValueError("is_min/is_max/tis_cap/is_normalize weigh tokens: is_level is None")
    for name, v, modes in (
        ("num_tokens", num_tokens, ("token-mean",)),
        ("num_seqs", num_seqs, tuple(m for m in AGG_MODES if m.startswith(("seq", "row")))),
        ("norm_length", norm_length, tuple(m for m in AGG_MODES if m.endswith("-norm"))),
    ):
        if v is not None and agg not in modes:
            raise ValueError(f"{name} applies to agg {', '.join(modes)}, not {agg!r}")
    num_tokens = _count("num_tokens", num_tokens, device)
    num_seqs = _count("num_seqs", num_seqs, device)
    if norm_length is not None:
        norm_length = chk.positive_float("norm_length", norm_length)
    elif agg.endswith("-norm"):
        norm_length = float(shape[1])
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
        ratio_level=ratio_level,
        rollout_logprobs=rollout_logprobs,
        is_level=is_level,
        is_mode=is_mode,
        is_min=is_min,
        is_max=is_max,
        is_normalize=is_normalize,
        reject=reject,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k3",
    *,
    clamp: float | None = 10.0,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and a reference, ``[B, L]`` -> fp32 ``[B, L]``.

    With ``d = logprobs - ref_logprobs``: ``k1 = d``; ``abs = |d|``; ``k2 = d^2 / 2``;
    ``k3 = exp(-d) + d - 1`` (the low-variance estimator), clamped to ``[-clamp, clamp]``
    (verl: 10; ``clamp=None``: no clamp, as TRL). The straight-through kinds ``k1+``, ``k3+``,
    ``abs+`` have the value of ``k1``/``k3``/``abs`` and the gradient of ``k2`` (``d``). verl's
    names are accepted: ``kl`` = ``k1``, ``mse`` = ``k2``, ``low_var_kl`` = ``k3``,
    ``low_var_kl+`` = ``k3+``, ``kl+`` = ``k1+``, ``k2+``/``mse+`` = ``k2``.

    ``old_logprobs`` (TRL's ``use_bias_correction_kl``): the estimate is multiplied by the
    token's importance ratio ``exp(logprobs - old_logprobs)``, which is differentiated too.
    Differentiable with respect to ``logprobs``; every element is computed on its own.

    Example::

        kl = rlk.kl_penalty(lp, ref_lp, "low_var_kl")            # verl use_kl_loss default
        kl = rlk.kl_penalty(lp, ref_lp, "k3", clamp=None, old_logprobs=old_lp)   # TRL beta > 0
    """
    logprobs = _check_padded("logprobs", logprobs)
    shape = tuple(logprobs.shape)
    ref_logprobs = _check_padded("ref_logprobs", ref_logprobs, shape)
    kind = _alias("kind", kind, KL_KINDS, KL_ALIASES)
    if clamp is not None:
        clamp = chk.positive_float("clamp", clamp)
    if old_logprobs is not None:
        old_logprobs = _check_padded("old_logprobs", old_logprobs, shape)
    device = chk.same_device(
        logprobs=logprobs, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs
    )
    return _call(
        "kl_penalty", device, logprobs, ref_logprobs, kind, clamp=clamp, old_logprobs=old_logprobs
    )


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    norm_std: bool | str = True,
    eps: float = 1e-6,
    group_ids: torch.Tensor | None = None,
    estimator: str = "grpo",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outcome-reward advantages, one per response: ``rewards [N]`` -> fp32 ``[N]``.

    Groups (the responses of one prompt) are given by ``group_size`` (contiguous groups of that
    size, at least 2: TRL's ``num_generations``) or by ``group_ids`` (int ``[N]``, any values in
    any order, groups of any size: verl's ``uid`` index). A group's sums run over its members in
    their order in ``rewards``, in a fixed order, so a group's advantages do not depend on the
    rest of the batch (except with ``norm_std="batch"`` and the ``reinforce++`` estimators).

    ``estimator``:

    - ``grpo``: ``(r - mean_g) / (std_g + eps)`` with the unbiased (Bessel) std of the group
      (``norm_std=True`` or ``"group"``); ``r - mean_g`` (``False`` or ``"none"``: Dr. GRPO);
      ``(r - mean_g) / (std_batch + eps)`` (``"batch"``: the unbiased std of all ``N`` rewards,
      TRL ``scale_rewards="batch"``). A group of one has mean 0 and std 1 (verl).
    - ``rloo``: ``r - mean of the other members`` = ``n / (n - 1) * (r - mean_g)``; a group of
      one keeps ``r`` (verl).
    - ``reinforce++-baseline``: ``r - mean_g`` (a group of one: ``r``), then whitened over the
      response tokens of the batch: ``(v - mu) / sqrt(var + 1e-8)`` with the token-weighted
      mean and unbiased variance (each response weighs its ``mask`` token count).
    - ``reinforce++``: ``r`` whitened the same way (no groups; verl's ``gamma = 1``).

    verl's names ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline`` are accepted.
    ``mask`` (``[N, L]`` bool or 0/1) is required by, and only allowed with, the two
    ``reinforce++`` estimators. ``norm_std`` and ``eps`` apply to ``grpo`` only. Not
    differentiable.

    Example::

        adv = rlk.grpo_advantages(rewards, group_size=8)                  # TRL: eps=1e-4
        adv = rlk.grpo_advantages(rewards, group_ids=uid, estimator="rloo")   # verl rloo
    """
    rewards = chk.tensor("rewards", rewards, dtypes=chk.FLOAT_DTYPES, ndim=1)
    n = rewards.numel()
    estimator = _alias("estimator", estimator, ADV_ESTIMATORS, ADV_ALIASES)
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (a group needs a baseline), got {group_size}; "
                "groups of one: pass group_ids"
            )
        if n % group_size:
            raise ValueError(f"rewards has {n} entries, not a multiple of group_size={group_size}")
    if group_ids is not None:
        chk.tensor("group_ids", group_ids, dtypes=(torch.int32, torch.int64), ndim=1)
        chk.shape("group_ids", group_ids, (n,), "one per reward")
    grouped = estimator != "reinforce++"
    if grouped and (group_size is None) == (group_ids is None):
        raise ValueError(f"estimator {estimator!r} needs exactly one of group_size and group_ids")
    if not grouped and (group_size is not None or group_ids is not None):
        raise ValueError("estimator 'reinforce++' uses no groups: drop group_size/group_ids")
    if isinstance(norm_std, bool):
        norm_std = "group" if norm_std else "none"
    elif norm_std not in NORM_STD:  # a truthy string such as "False" must not switch it on
        raise TypeError(
            f"norm_std must be a bool or one of {', '.join(map(repr, NORM_STD))}, got {norm_std!r}"
        )
    eps = chk.positive_float("eps", eps)
    if estimator.startswith("reinforce++"):
        if mask is None:
            raise ValueError(f"estimator {estimator!r} needs mask (token counts for whitening)")
        mask = _check_mask(mask, (n,), of="rewards.numel()")
    elif mask is not None:
        raise ValueError(f"mask applies to the reinforce++ estimators, not {estimator!r}")
    device = chk.same_device(rewards=rewards, group_ids=group_ids, mask=mask)
    return _call(
        "grpo_advantages",
        device,
        rewards,
        group_size,
        norm_std=norm_std,
        eps=eps,
        group_ids=group_ids,
        estimator=estimator,
        mask=mask,
    )


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


#: What a sampling parameter must be: in words, and as a test that works elementwise on a
#: tensor and on a Python number alike. Each test is false for NaN.
_SAMPLE_RULES = {
    "offsets": (">= 0", lambda v: v >= 0),
    "temperature": ("finite and >= 0 (0 = greedy)", lambda v: (v >= 0) & (v < math.inf)),
    "top_k": (">= 0 (0 = off)", lambda v: v >= 0),
    "top_p": ("in (0, 1] (1 = off)", lambda v: (v > 0) & (v <= 1)),
}


def _per_row(
    name: str, value: object, b: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A sampling parameter as a ``[b]`` tensor. A Python number is checked here, on the host,
    always (no device work); a tensor's values only when value checks are on (a device read)."""
    rule, ok = _SAMPLE_RULES.get(name, (None, None))
    if isinstance(value, torch.Tensor):
        want = (torch.int64, torch.int32) if dtype == torch.int64 else chk.FLOAT_DTYPES
        chk.tensor(name, value, dtypes=want, ndim=1)
        chk.shape(name, value, (b,), "one per row of logits")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but logits is on {device}")
        value = value.to(dtype)
        if ok and b and chk.value_checks_enabled(value) and not bool(ok(value).all()):
            raise ValueError(f"{name} must be {rule}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a [B] tensor, got {type(value).__name__}")
    if dtype == torch.int64 and not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if dtype == torch.int64 and not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    if ok and not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value}")
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
    Each parameter is a number or a per-row ``[B]`` tensor. Numbers are checked always, on the
    host; tensors' values when value checks are on (on CPU, or with ``RLK_VALIDATE``): NaN, a
    negative ``temperature``/``top_k``/``offsets`` and ``top_p`` outside (0, 1] are errors.
    A row of ``logits`` with a NaN has no token to draw: a ``ValueError`` where value checks
    run, and the token ``-1`` for that row otherwise (every backend; no host synchronisation).
    The Triton backends add the top-p masses as exact int64 fixed-point sums, so with ``top_p``
    other than the number 1.0 they take vocabularies of up to 2**22 (``ValueError`` above).

    Example::

        tok = rlk.sample(logits, seeds, step_offsets, temperature=0.7, top_p=0.9)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    if chk.value_checks_enabled(logits) and bool(logits.isnan().any()):
        raise ValueError("logits has NaN: no token can be drawn (without value checks: -1)")
    b, vocab = logits.shape
    device = logits.device
    seeds = _per_row("seeds", seeds, b, torch.int64, device)
    offsets = _per_row("offsets", offsets, b, torch.int64, device)
    temperature = _per_row("temperature", temperature, b, torch.float32, device)
    # A filter given as the number that turns it off reaches the backend as None (off for
    # every row), so that a backend can skip it without reading the device.
    off_k = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 0
    off_p = isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 1.0
    top_k = None if off_k else _per_row("top_k", top_k, b, torch.int64, device)
    top_p = None if off_p else _per_row("top_p", top_p, b, torch.float32, device)
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
