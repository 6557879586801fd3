"""Log-probabilities from hidden states, ``[T, H] x [V, H] -> [T]``, with bounded memory.

``linear_logprobs(h, W, t)`` must equal ``logprobs(linear(h, W), t)`` bitwise (rule 4 of the
numerics contract). It does so by construction: it runs the very kernels of those two ops, the
batch-invariant GEMM of :mod:`rlk_triton.gemm` and the row kernels of :mod:`rlk_triton.logprobs`,
on slices small enough that ``[T, V]`` is never held. Every output row of both kernels depends
only on its own input row, so slicing changes no bit.

- Forward: tokens in slices of ``_rows_per_slice(V)`` rows (a constant per vocabulary size):
  logits of the slice in ``logits_dtype`` -> log-probability, log-sum-exp and entropy per row.
- Backward: the vocabulary in slices of :data:`VOCAB_SLICE` rows of W. Per slice: recompute the
  logits ``[T, slice]``, turn them into ``dlogits`` with the saved log-sum-exp (elementwise), then
  ``dW[slice] = dlogits.T @ h`` (a complete sum over tokens in one GEMM: ascending, fixed),
  ``dbias[slice]`` (fixed-order column sums), and ``dh += dlogits @ W[slice]`` in fp32, slices
  added in ascending order. So dW/dbias are deterministic and dh of a token depends only on that
  token: nothing is batch-dependent and nothing uses atomics.

Extra memory: one logits slice plus a fp32 ``[T, H]`` accumulator for dh (and its slice
partial), independent of V; the logits ``[T, V]`` never exist.
"""

from __future__ import annotations

import torch

from rlk_triton import gemm, tuning
from rlk_triton import logprobs as lp_mod

#: Rows of W per backward slice. Fixed: it sets the order in which dh's per-slice partials are
#: summed (ascending slices), so it is a constant of the op, never a tuning choice.
VOCAB_SLICE = 8192

#: Elements of a forward logits slice (bounds forward memory; changes no bit).
_FWD_SLICE_ELEMS = 1 << 27


def _rows_per_slice(v: int) -> int:
    return max(1, _FWD_SLICE_ELEMS // max(v, 1))


def _logits(h, weight, bias, logits_dtype, table):
    """``h @ weight.T + bias`` rounded to ``logits_dtype``: the GEMM kernel of ``linear``."""
    return gemm._matmul(h, weight.t(), bias, logits_dtype, table, "linear.fwd")


def linear_logprobs_forward(
    hidden, weight, targets, bias, temperature, entropy, logits_dtype, table
):
    """Returns ``(logprobs, lse, entropy or None)``, fp32 ``[T]`` each."""
    T = hidden.shape[0]
    lp = torch.empty(T, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if entropy else None
    step = _rows_per_slice(weight.shape[0])
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        logits = _logits(hidden[r0:r1], weight, bias, logits_dtype, table)
        lp_s, lse_s, ent_s = lp_mod.logprobs_forward(
            logits, targets[r0:r1], temperature, entropy, table
        )
        lp[r0:r1], lse[r0:r1] = lp_s, lse_s
        if entropy:
            ent[r0:r1] = ent_s
    return lp, lse, ent


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
        table = ctx.table
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        if ctx.entropy:
            g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        else:
            ent = g_ent = None
        need_h, need_w, need_b = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            (bias is not None and ctx.needs_input_grad[3]),
        )
        T, H = hidden.shape
        V = weight.shape[0]
        dh = torch.zeros(T, H, dtype=torch.float32, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        db = torch.empty_like(bias) if need_b else None
        for v0 in range(0, V, VOCAB_SLICE):
            v1 = min(V, v0 + VOCAB_SLICE)
            w_s = weight[v0:v1]
            b_s = bias[v0:v1] if bias is not None else None
            logits = _logits(hidden, w_s, b_s, ctx.logits_dtype, table)
            # Targets shifted into the slice's columns: a target outside the slice matches none.
            dlogits = lp_mod.logprobs_backward(
                logits, targets - v0, lse, ent, g_lp, g_ent, ctx.temperature, table
            )
            del logits
            if dlogits.dtype != hidden.dtype:
                dlogits = dlogits.to(hidden.dtype)
            if need_w:
                dw[v0:v1] = gemm._matmul(
                    dlogits.t(), hidden, None, weight.dtype, table, "linear.bwd_dw"
                )
            if need_b:
                db[v0:v1] = gemm._bias_grad(dlogits, bias.dtype)
            if need_h:
                dh += gemm._matmul(dlogits, w_s, None, torch.float32, table, "linear.bwd_dx")
        dh = dh.to(hidden.dtype) if need_h else None
        return dh, dw, None, db, None, None, None, None


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
