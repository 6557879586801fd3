"""The dense layers: ``linear``, ``rms_norm``, ``silu_and_mul``, ``apply_rotary``.

Each checks its arguments (:func:`check_linear` is public: ``rlk.parallel`` checks its
linears with it), then calls the selected backend.
"""

from __future__ import annotations

import math

import torch

from rlk import _validate as chk
from rlk import selection
from rlk._catalog import Operator, no_extras, op
from rlk.ops._common import _call, _rows, _unrows, f32, rows_out

#: The ops declared here (``rlk`` exports them).
__all__ = ["linear", "rms_norm", "silu_and_mul", "apply_rotary"]

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


@op(
    "gemm",
    grad_args=("x", "weight", "bias"),
    unit_grads=("x",),
    operator=Operator(
        "Tensor x, Tensor weight, Tensor? bias",
        outputs=lambda a: [rows_out(a["x"], a["weight"].shape[0], a["x"].dtype)],
        extras=no_extras,
    ),
)
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


def _heads_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., heads, D]`` as the ``[T, heads, D]`` view that :func:`rms_norm`'s backends read
    in place (any token stride; heads and D contiguous), or None where ``x`` is not so laid out
    (it must then be contiguous)."""
    if x.dim() < 3 or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return None
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:  # leading dims that no single token stride covers
        return None


@op(
    "norm",
    grad_args=("x", "weight", "residual"),
    unit_grads=("x", "residual"),
    operator=Operator(
        "Tensor x, Tensor weight, float eps, Tensor? residual",
        # the output, and the sum x + residual where there is a residual
        outputs=lambda a: [
            torch.empty_like(a["x"]) for _ in range(1 + (a["residual"] is not None))
        ],
        extras=lambda a: [f32(a["x"].shape[0], like=a["x"])],  # each row's 1 / rms
        saved_outputs=lambda a: () if a["residual"] is None else (1,),  # s = x + residual
        same_grad=(("residual", "x"),),  # x and residual enter through their sum
    ),
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

    For Qwen3's per-head q/k norm pass ``x [..., heads, head_dim]`` and ``weight [head_dim]``.
    Without ``residual`` such an ``x`` may be a view with any token stride, its heads and
    head_dim contiguous (q or k as column views of a fused q/k/v product): backends read it in
    place or copy it first, the bits are the same. Any other ``x`` must be contiguous.

    Contract: one row's output depends only on that row; the sum of squares runs in fixed-size
    chunks in a fixed order; the weight gradient reduces over rows in a fixed partition and order.

    Example::

        y, h = rlk.rms_norm(attn_out, w, 1e-6, residual=h)
    """
    heads = None
    if _plain_norm_args(x, weight, eps, residual):
        device = x.device
    else:
        if residual is None and isinstance(x, torch.Tensor) and not x.is_contiguous():
            heads = _heads_view(x)
        chk.tensor(
            "x", x, dtypes=chk.FLOAT_DTYPES, min_ndim=1, nonempty_last=True,
            contiguous=heads is None,
        )  # fmt: skip
        chk.tensor("weight", weight, dtypes=chk.FLOAT_DTYPES, ndim=1)
        eps = chk.positive_float("eps", eps)
        if residual is not None:
            chk.tensor("residual", residual, dtypes=chk.FLOAT_DTYPES)
            chk.same_dtype(x=x, residual=residual)
            chk.shape("residual", residual, x.shape, "the shape of x")
        device = chk.same_device(x=x, weight=weight, residual=residual)
        chk.shape("weight", weight, (x.shape[-1],), "H = x.shape[-1]")
    if heads is not None and not selection._compiling():  # (torch.ops.rlk.rms_norm takes rows)
        return _call("rms_norm", device, heads, weight, eps, None).view(x.shape)
    if residual is None:
        return _unrows(_call("rms_norm", device, _rows(x), weight, eps, None), *x.shape)
    y, s = _call("rms_norm", device, _rows(x), weight, eps, _rows(residual))
    return _unrows(y, *x.shape), _unrows(s, *x.shape)


@op(
    "activation",
    grad_args=("x", "up"),
    unit_grads=("x", "up"),
    operator=Operator(
        "Tensor x, Tensor? up",
        outputs=lambda a: [
            rows_out(a["x"], a["x"].shape[1] // (1 if a["up"] is not None else 2), a["x"].dtype)
        ],
        extras=no_extras,
        omitted_if_none=("up",),
    ),
)
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


@op(
    "rotary",
    grad_args=("x", "k"),
    unit_grads=("x", "k"),
    operator=Operator(
        "Tensor x, Tensor cos, Tensor sin, Tensor? k",
        outputs=lambda a: [torch.empty_like(t) for t in (a["x"], a["k"]) if t is not None],
        extras=no_extras,
        grads=("x", "cos", "sin", "k"),  # the eager backward differentiates cos and sin too
        omitted_if_none=("k",),
    ),
)
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

    ``x`` and ``k`` may be views with any token stride (a column slice of a fused q/k/v
    product); backends read such rows in place or copy them first, the bits are the same.

    Contract: elementwise; each element depends only on its own input, cos and sin.

    Example::

        q, k = rlk.apply_rotary(q, cos[position_ids], sin[position_ids], k=k)
    """
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, ndim=3, contiguous=False)
    chk.tensor("cos", cos, dtypes=chk.FLOAT_DTYPES, ndim=2)
    chk.tensor("sin", sin, dtypes=chk.FLOAT_DTYPES, ndim=2)
    if k is not None:
        chk.tensor("k", k, dtypes=chk.FLOAT_DTYPES, ndim=3, contiguous=False)
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
