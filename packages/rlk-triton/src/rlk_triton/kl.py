"""Per-token KL estimates on padded ``[B, L]`` tensors: ``kl_penalty``.

Semantics: the docstring of ``rlk.kl_penalty`` (the arguments arrive validated and
normalised). Elementwise in fp32: each output depends on its own token only, and the
backward is elementwise too (no atomics, no sums).
"""

from __future__ import annotations

import torch

from rlk_triton import tuning
from rlk_triton._objectives import _max2, _min2
from rlk_triton._triton import cdiv, jit, tl

KL_CODES = {"k1": 0, "k2": 1, "k3": 2, "abs": 3}


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@jit
def _kl_terms(d, clamp, KIND: tl.constexpr, CLAMP: tl.constexpr, ST: tl.constexpr):
    """``(kl, d kl / d d)`` per token for ``d = logprobs - ref_logprobs``."""
    if KIND == 0:
        kl = d
        dkl = tl.zeros_like(d) + 1.0
    elif KIND == 1:
        kl = d * d * 0.5
        dkl = d
    elif KIND == 2:
        raw = tl.exp(-d) + d - 1.0
        dkl = 1.0 - tl.exp(-d)
        kl = raw
        if CLAMP:
            kl = _min2(_max2(raw, -clamp), clamp)
            # A clamped value has gradient 0, a NaN one NaN (as autograd through the reference).
            dkl = tl.where((raw >= -clamp) & (raw <= clamp), dkl, tl.where(raw == raw, 0.0, raw))
    else:
        kl = tl.abs(d)
        dkl = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    if ST:  # straight through: the gradient of k2
        dkl = d
    return kl, dkl


@jit
def _kl_load(lp_ptr, ref_ptr, old_ptr, offs, ok, BIAS: tl.constexpr):
    lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    d = lp - tl.load(ref_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if BIAS:
        w = tl.exp(lp - tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32))
    else:
        w = d
    return d, w


@jit
def _kl_fwd_kernel(
    lp_ptr,
    ref_ptr,
    old_ptr,
    out_ptr,
    N,
    clamp,
    KIND: tl.constexpr,
    CLAMP: tl.constexpr,
    ST: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    d, w = _kl_load(lp_ptr, ref_ptr, old_ptr, offs, ok, BIAS)
    kl, _ = _kl_terms(d, clamp, KIND, CLAMP, ST)
    if BIAS:
        kl = kl * w
    tl.store(out_ptr + offs, kl, mask=ok)


@jit
def _kl_bwd_kernel(
    lp_ptr,
    ref_ptr,
    old_ptr,
    g_ptr,
    dlp_ptr,
    N,
    clamp,
    KIND: tl.constexpr,
    CLAMP: tl.constexpr,
    ST: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    d, w = _kl_load(lp_ptr, ref_ptr, old_ptr, offs, ok, BIAS)
    kl, dkl = _kl_terms(d, clamp, KIND, CLAMP, ST)
    if BIAS:  # d (kl * w) = (dkl + kl) * w, since dw / dlp = w
        dkl = (dkl + kl) * w
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(dlp_ptr + offs, (g * dkl).to(dlp_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Tuning: launch parameters only
# --------------------------------------------------------------------------------------------


TUNING = {
    "kl_penalty.fwd": tuning.Rule(
        configs=(
            {"BLOCK": 1024, "num_warps": 4},
            {"BLOCK": 4096, "num_warps": 8},
            {"BLOCK": 128, "num_warps": 1},
        ),
    ),
    "kl_penalty.bwd": tuning.Rule(
        configs=(
            {"BLOCK": 1024, "num_warps": 4},
            {"BLOCK": 4096, "num_warps": 8},
            {"BLOCK": 128, "num_warps": 1},
        ),
    ),
}


# --------------------------------------------------------------------------------------------
# Launchers, autograd, public function
# --------------------------------------------------------------------------------------------


def _kl_operands(lp, ref, old, kind, clamp):
    """``((lp, ref, old), flags)``: the kernels' operands, contiguous (``old``: ``lp`` itself
    when not given), and their flags."""
    lp, ref = lp.contiguous(), ref.contiguous()
    old = lp if old is None else old.contiguous()
    flags = dict(
        KIND=KL_CODES[kind.rstrip("+")],
        CLAMP=clamp is not None,
        ST=kind.endswith("+"),
        BIAS=old is not lp,
    )
    return (lp, ref, old), flags


def _kl_forward(lp, ref, old, kind, clamp, table):
    """``(out, operands, flags)``: the forward launch, and what the backward reads
    (:func:`_kl_operands`)."""
    (lp, ref, old), flags = _kl_operands(lp, ref, old, kind, clamp)
    out = torch.empty(lp.shape, dtype=torch.float32, device=lp.device)
    n = lp.numel()
    if n:
        cfg = dict(tuning.config(table, "kl_penalty.fwd", N=n))
        block = cfg.pop("BLOCK")
        _kl_fwd_kernel[(cdiv(n, block),)](
            lp, ref, old, out, n, float(clamp or 0.0), BLOCK=block, **flags, **cfg
        )
    return out, (lp, ref, old), flags


def _kl_backward(g, lp, ref, old, flags, clamp, table):
    """d loss / d logprobs from the output's gradient ``g`` (the backward launch)."""
    dlp = torch.empty_like(lp)
    n = lp.numel()
    if n:
        cfg = dict(tuning.config(table, "kl_penalty.bwd", N=n))
        block = cfg.pop("BLOCK")
        _kl_bwd_kernel[(cdiv(n, block),)](
            lp, ref, old, g.contiguous(), dlp, n, float(clamp or 0.0), BLOCK=block, **flags, **cfg
        )
    return dlp


class KLPenaltyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, ref, old, kind, clamp, table):
        out, saved, flags = _kl_forward(lp, ref, old, kind, clamp, table)
        ctx.save_for_backward(*saved)
        ctx.flags, ctx.clamp, ctx.table = flags, clamp, table
        return out

    @staticmethod
    def backward(ctx, g):
        dlp = _kl_backward(g, *ctx.saved_tensors, ctx.flags, ctx.clamp, ctx.table)
        return dlp, None, None, None, None, None


def _split_forward(logprobs, ref_logprobs, kind, *, clamp, old_logprobs, table):
    out, _, _ = _kl_forward(logprobs, ref_logprobs, old_logprobs, kind, clamp, table)
    return (out,), ()


def _split_backward(grads, outs, extras, needs, logprobs, ref_logprobs, kind, *, clamp,
                    old_logprobs, table):  # fmt: skip
    # The forward's inputs give the launch the forward's operands again.
    operands, flags = _kl_operands(logprobs, ref_logprobs, old_logprobs, kind, clamp)
    g = grads[0]
    if g is None:
        g = torch.zeros(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    return (_kl_backward(g, *operands, flags, clamp, table),)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k3",
    *,
    clamp: float | None = 10.0,
    old_logprobs: torch.Tensor | None = None,
    table: tuning.TuningTable,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` -> fp32 ``[B, L]`` (semantics: :func:`rlk.kl_penalty`),
    differentiable with respect to ``logprobs``. ``kind`` is one of rlk's names (``k1``, ``k2``,
    ``k3``, ``abs``, ``k1+``, ``k3+``, ``abs+``).

    Example::

        kl = kl_penalty(lp, ref_lp, "k3", table=table)
    """
    old = None if old_logprobs is None else old_logprobs.detach()
    return KLPenaltyFunction.apply(logprobs, ref_logprobs.detach(), old, kind, clamp, table)


#: Forward and backward as two calls, for the torch.compile path (rlk._library): the
#: backward launches its kernel alone, on the inputs, as KLPenaltyFunction's does.
AUTOGRAD = {"kl_penalty": (_split_forward, _split_backward)}
