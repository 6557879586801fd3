"""Opt-in torch_npu fused operators. UNVERIFIED: none of this has run on an Ascend NPU.

By default the ascend backend serves every op with :mod:`rlk_ascend.portable`. Setting
``RLK_ASCEND_FUSED=1`` (or a comma-separated list of op names) serves the ops below with
torch_npu's fused operators instead. Whether they keep rlk's contract (fp32 compute rounded
once, a fixed reduction order independent of the number of rows, deterministic weight
gradients) is not documented by Huawei and has not been measured: run
``rlk conformance --backend ascend --full`` on the NPU with the variable set before trusting them.

The module object ``npu`` passed to :func:`fused_op` is ``torch_npu`` itself; this file never
imports it (tests pass a stand-in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: op -> the torch_npu operator that may serve it (opt-in, unverified).
FUSED = {
    "rms_norm": "npu_rms_norm",
    "silu_and_mul": "npu_swiglu",
    "apply_rotary": "npu_rotary_mul",
}

#: Fused operators that are not mapped, and why (they stay on the portable code).
NOT_MAPPED = {
    "attention": (
        "npu_fusion_attention: its KV tiling and softmax order are internal to CANN and not "
        "documented as aligned to position 0, so training == prefill == decode is not promised"
    ),
    "paged_attention": (
        "npu_fused_infer_attention_score: the same, and its split over pages may follow the "
        "page size; it must equal the portable attention bit for bit, which it cannot"
    ),
}


def requested(value: str) -> tuple[str, ...]:
    """The ops named by ``RLK_ASCEND_FUSED``: "" or "0" none, "1" or "all" every candidate."""
    value = value.strip()
    if value in ("", "0"):
        return ()
    if value in ("1", "all"):
        return tuple(FUSED)
    ops = tuple(o.strip() for o in value.split(",") if o.strip())
    unknown = [o for o in ops if o not in FUSED]
    if unknown:
        raise ValueError(
            f"RLK_ASCEND_FUSED names {', '.join(unknown)}, which has no fused candidate; "
            f"the candidates are {', '.join(FUSED)} (or 1/all)"
        )
    return ops


def _rms_norm(npu: Any) -> Callable:
    def rms_norm(x, weight, eps=1e-6, residual=None, *, table=None):
        if weight.dtype != x.dtype:
            raise TypeError(
                f"npu_rms_norm needs weight in x's dtype ({x.dtype}), got {weight.dtype}; "
                "unset RLK_ASCEND_FUSED to use the portable rms_norm"
            )
        if residual is not None:
            s = (x.float() + residual.float()).to(x.dtype)
            return npu.npu_rms_norm(s, weight, epsilon=eps)[0], s
        return npu.npu_rms_norm(x.contiguous(), weight, epsilon=eps)[0]  # (a heads view)

    return rms_norm


def _silu_and_mul(npu: Any) -> Callable:
    def silu_and_mul(x, up=None, *, table=None):
        # npu_swiglu: swish(first half) * second half along dim, as rlk's gate/up order; it
        # takes the two halves in one tensor.
        if up is not None:
            x = torch.cat([x, up], dim=-1)
        return npu.npu_swiglu(x.contiguous(), dim=-1)

    return silu_and_mul


def _apply_rotary(npu: Any) -> Callable:
    def apply_rotary(x, cos, sin, k=None, *, table=None):
        if k is not None:
            return apply_rotary(x, cos, sin), apply_rotary(k, cos, sin)
        if cos.dtype != x.dtype:
            raise TypeError(
                f"npu_rotary_mul needs cos/sin in x's dtype ({x.dtype}), got {cos.dtype}; "
                "unset RLK_ASCEND_FUSED to use the portable apply_rotary"
            )
        # [T, H, D] as [1, T, H, D] (BSND) with cos/sin broadcast over heads: [1, T, 1, D].
        out = npu.npu_rotary_mul(x[None], cos[None, :, None, :], sin[None, :, None, :])
        return out[0]

    return apply_rotary


_BUILDERS = {"rms_norm": _rms_norm, "silu_and_mul": _silu_and_mul, "apply_rotary": _apply_rotary}


def fused_op(op: str, npu: Any) -> Callable:
    """The rlk op ``op`` served by ``npu``'s fused operator (``npu`` is the torch_npu module)."""
    return _BUILDERS[op](npu)
