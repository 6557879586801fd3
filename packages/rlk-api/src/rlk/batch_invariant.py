"""``rlk.batch_invariant()``: make unmodified PyTorch code use rlk's batch-invariant GEMM.

Inside the context, the CPU and CUDA kernels of these aten ops are replaced (through
``torch.library.Library("aten", "IMPL")``) by implementations built on the selected backend's
``linear`` op, whose output rows depend only on their own input rows:

================================  ============================================================
aten op                           served by
================================  ============================================================
``mm``, ``addmm``, ``bmm``, ``mv``  ``linear`` (``bmm``: one ``linear`` per batch entry).
                                  ``F.linear`` and ``torch.matmul`` decompose into these
                                  (checked on torch 2.13: 2-D ``mm``/``addmm``, N-D inputs
                                  viewed as 2-D ``mm``/``addmm``, batched ``bmm``).
``sum.dim_IntList``, ``mean.dim``   over the last dim only: ``linear(x.float(), ones[1, H])``,
                                  a fixed-order fp32 row sum, rounded once.
``_softmax``, ``_log_softmax``      over the last dim only: ``amax`` (exact), elementwise
and their ``_backward_data``      ``exp``/``log`` in fp32, and the row sum above.
================================  ============================================================

Autograd is untouched: these run below it, so the backward of ``mm`` is again ``mm`` and is
served by ``linear`` as well (dX batch-invariant; dW is a fixed-order sum over rows).

Not covered (these run the stock kernels, which may change with the batch size):

- Calls whose dtype rlk does not serve (float64, integers, complex) go to the original kernel,
  on purpose: integer math is exact, and rlk's float64 reference backend itself calls ``mm``.
- Reductions over any dim but the last one, or over several dims; ``sum()``/``mean()`` of a
  whole tensor; ``out=`` variants; ``baddbmm``, ``addbmm``, ``addmv``, ``dot``, ``einsum``
  paths that do not reach ``mm``/``bmm``; convolutions; ``scaled_dot_product_attention``;
  ``layer_norm``/``rms_norm``; ``nll_loss``/``cross_entropy`` reductions over the batch
  (their ``_log_softmax`` is covered); cuDNN/cuBLASLt fused epilogues reached by other ops.
- Devices other than CPU and CUDA (ROCm builds of torch use the CUDA key and are covered).
- Code Inductor compiles: it generates its own kernels from decompositions, and its extern
  GEMMs are ``out=`` calls, so a graph ``torch.compile`` built with Inductor (the default) runs
  none of these overrides. A graph compiled without Inductor (``backend="aot_eager"``) calls
  the aten kernels and is served. rlk's own ops in a compiled graph are ``torch.ops.rlk``
  operators and stay rlk's either way (``tests/test_library.py`` shows all three).

The override is process-wide (the dispatcher is global), for every thread, while at least one
``batch_invariant()`` context is open; contexts nest, and the original kernels come back when
the outermost one exits. Elementwise ops (``exp``, ``add``) are left to PyTorch: they compute
each element on its own, so they are batch-invariant already.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlk.plugins import BackendImpl
from rlk.selection import backend_impl, registry

__all__ = ["batch_invariant"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_KEYS = ("CPU", "CUDA")

_lock = threading.RLock()
_depth = 0
_lib: torch.library.Library | None = None
_original: dict[tuple[str, str], Any] = {}
# The backends requested by the open contexts, with a token each; the latest one serves.
_backends: list[tuple[object, BackendImpl | str | None]] = []


def _impl(device: torch.device) -> BackendImpl:
    want = _backends[-1][1] if _backends else None
    if isinstance(want, BackendImpl):
        return want
    if isinstance(want, str):
        return registry().load(want)
    return backend_impl(device)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T + bias`` by the backend's linear, outside autograd."""
    with torch.no_grad():
        return _impl(x.device).ops["linear"](
            x.contiguous(), w.contiguous(), None if bias is None else bias.contiguous()
        )


def _serves(*ts: torch.Tensor) -> bool:
    return all(t.dtype in _FLOATS for t in ts)


def _same_dtype(op: str, *ts: torch.Tensor) -> None:
    if len({t.dtype for t in ts}) > 1:
        raise RuntimeError(
            f"rlk.batch_invariant: {op} expects operands of one dtype, got "
            + ", ".join(str(t.dtype) for t in ts)
        )


def _call_original(op: str, keyset, *args, **kwargs):
    key = "CUDA" if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) else "CPU"
    return _original[(op, key)].call_boxed(keyset, *args, **kwargs)


# ---- GEMMs -------------------------------------------------------------------------------


def _mm(keyset, a, b):
    if not _serves(a, b):
        return _call_original("mm", keyset, a, b)
    _same_dtype("mm", a, b)
    return _linear(a, b.t())


def _addmm(keyset, inp, a, b, *, beta=1, alpha=1):
    if not _serves(inp, a, b):
        return _call_original("addmm", keyset, inp, a, b, beta=beta, alpha=alpha)
    _same_dtype("addmm", inp, a, b)
    n = b.shape[1]
    row_bias = inp.dim() == 1 or (inp.dim() == 2 and inp.shape[0] == 1)
    if beta == 1 and alpha == 1 and row_bias and inp.shape[-1] == n:
        return _linear(a, b.t(), inp.reshape(n))  # the F.linear path: bias fused, rounded once
    y = _linear(a, b.t())
    if alpha != 1:
        y = y * alpha
    if beta == 0:
        return y
    return y + (inp if beta == 1 else inp * beta)


def _bmm(keyset, a, b):
    if not _serves(a, b):
        return _call_original("bmm", keyset, a, b)
    _same_dtype("bmm", a, b)
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    for i in range(a.shape[0]):
        out[i] = _linear(a[i], b[i].t())
    return out


def _mv(keyset, mat, vec):
    if not _serves(mat, vec):
        return _call_original("mv", keyset, mat, vec)
    _same_dtype("mv", mat, vec)
    return _linear(vec[None, :], mat)[0]


# ---- Row reductions over the last dim ----------------------------------------------------


def _last_dim(x: torch.Tensor, dim) -> bool:
    if x.dim() == 0 or x.numel() == 0 or x.shape[-1] == 0:
        return False
    if dim is None:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim)
    return len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim of ``x``: ``[..., H] -> [..., 1]``, in a fixed order."""
    h = x.shape[-1]
    rows = x.reshape(-1, h).to(torch.float32)
    ones = torch.ones(1, h, dtype=torch.float32, device=x.device)
    return _linear(rows, ones).reshape(*x.shape[:-1], 1)


def _sum(keyset, x, dim, keepdim=False, *, dtype=None):
    out_dtype = dtype or x.dtype
    if not (_serves(x) and out_dtype in _FLOATS and _last_dim(x, dim)):
        return _call_original("sum.dim_IntList", keyset, x, dim, keepdim, dtype=dtype)
    s = _row_sum(x).to(out_dtype)
    return s if keepdim else s.squeeze(-1)


def _mean(keyset, x, dim, keepdim=False, *, dtype=None):
    out_dtype = dtype or x.dtype
    if not (_serves(x) and out_dtype in _FLOATS and _last_dim(x, dim)):
        return _call_original("mean.dim", keyset, x, dim, keepdim, dtype=dtype)
    s = (_row_sum(x) / x.shape[-1]).to(out_dtype)
    return s if keepdim else s.squeeze(-1)


def _softmax_parts(x):
    xf = x.to(torch.float32)
    z = xf - xf.amax(-1, keepdim=True)
    e = torch.exp(z)
    return z, e, _row_sum(e)


def _log_softmax(keyset, x, dim, half_to_float):
    if not (_serves(x) and _last_dim(x, dim)):
        return _call_original("_log_softmax", keyset, x, dim, half_to_float)
    z, _, s = _softmax_parts(x)
    return (z - torch.log(s)).to(torch.float32 if half_to_float else x.dtype)


def _softmax(keyset, x, dim, half_to_float):
    if not (_serves(x) and _last_dim(x, dim)):
        return _call_original("_softmax", keyset, x, dim, half_to_float)
    _, e, s = _softmax_parts(x)
    return (e / s).to(torch.float32 if half_to_float else x.dtype)


def _log_softmax_backward(keyset, grad, out, dim, input_dtype):
    if not (_serves(grad, out) and _last_dim(out, dim)):
        return _call_original("_log_softmax_backward_data", keyset, grad, out, dim, input_dtype)
    g = grad.to(torch.float32)
    return (g - torch.exp(out.to(torch.float32)) * _row_sum(g)).to(input_dtype)


def _softmax_backward(keyset, grad, out, dim, input_dtype):
    if not (_serves(grad, out) and _last_dim(out, dim)):
        return _call_original("_softmax_backward_data", keyset, grad, out, dim, input_dtype)
    g = grad.to(torch.float32)
    o = out.to(torch.float32)
    return (o * (g - _row_sum(g * o))).to(input_dtype)


_OVERRIDES: dict[str, Callable[..., Any]] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "mv": _mv,
    "sum.dim_IntList": _sum,
    "mean.dim": _mean,
    "_softmax": _softmax,
    "_log_softmax": _log_softmax,
    "_softmax_backward_data": _softmax_backward,
    "_log_softmax_backward_data": _log_softmax_backward,
}


def _install() -> None:
    global _lib
    if not hasattr(torch.library, "get_kernel"):
        raise RuntimeError(
            "rlk.batch_invariant needs torch.library.get_kernel (torch >= 2.9) to keep the "
            f"original kernels for the cases it does not serve; this is torch {torch.__version__}"
        )
    keys = [k for k in _KEYS if k == "CPU" or torch.cuda.is_available()]
    for op in _OVERRIDES:
        for key in keys:
            _original[(op, key)] = torch.library.get_kernel(f"aten::{op}", key)
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": that is the point.
        warnings.simplefilter("ignore", UserWarning)
        for op, fn in _OVERRIDES.items():
            for key in keys:
                lib.impl(op, fn, key, with_keyset=True)
    _lib = lib


def _uninstall() -> None:
    global _lib
    if _lib is not None:
        _lib._destroy()
    _lib = None
    _original.clear()


@contextlib.contextmanager
def batch_invariant(backend: str | BackendImpl | None = None) -> Iterator[None]:
    """Serve ``mm``/``addmm``/``bmm``/``mv`` and last-dim ``sum``/``mean``/``softmax``/
    ``log_softmax`` of unmodified PyTorch code with rlk's batch-invariant ``linear``.

    ``backend``: ``None`` uses the backend rlk selects for each call's device (``RLK_BACKEND``,
    :func:`rlk.use_backend`); a name or a :class:`BackendImpl` forces one. CPU and CUDA tensors
    of dtype bf16/fp16/fp32 are served; see this module's docstring for what is not covered.
    Process-wide while open; nests; the original kernels are restored when the outermost
    context exits. Example::

        with rlk.batch_invariant():
            logits = model(input_ids).logits   # row i independent of the batch size
    """
    global _depth
    if backend is not None and not isinstance(backend, (str, BackendImpl)):
        raise TypeError(
            f"batch_invariant: backend must be a name or a BackendImpl, got {type(backend)}"
        )
    if isinstance(backend, str):
        registry().load(backend)  # a typo fails here, not at the first matmul
    token = object()
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
        _backends.append((token, backend))
    try:
        yield
    finally:
        with _lock:
            _backends[:] = [e for e in _backends if e[0] is not token]
            _depth -= 1
            if _depth == 0:
                _uninstall()
