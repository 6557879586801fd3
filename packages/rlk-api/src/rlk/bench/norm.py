"""``rlk bench`` family ``norm``: rms_norm (plain and fused with the residual add), silu_and_mul
and apply_rotary, against Liger-Kernel and ``torch.compile``.

Impls, all on the same random bf16 inputs and computing the same function (rlk's: in fp32,
rounded once to bf16; Liger's silu_and_mul and rotary also round intermediates to bf16):

- ``rlk``: the public op (``rlk.rms_norm``, ``rlk.silu_and_mul``, ``rlk.apply_rotary``);
- ``liger``: Liger-Kernel's autograd Functions ``LigerRMSNormFunction``,
  ``LigerFusedAddRMSNormFunction``, ``LigerSiLUMulFunction`` and ``LigerRopeFunction``;
- ``compile``: ``torch.compile`` of the plain PyTorch code in this file (``_rms_norm_ref`` and
  the others), compiled once per shape, before the timing.

Rows: ``<op>.fwd`` times the forward on inputs that do not require grad. ``<op>.fwd+bwd`` times
the forward on inputs that do, then ``torch.autograd.grad`` of every output, with a fixed random
upstream gradient, to every input (the norm weight included), so nothing accumulates in
``.grad``. Each impl is called once before it is timed (compilation, autotuning, first
allocations).

Bytes, for GB/s against the copy bandwidth: each pass reads each of its inputs once and writes
each of its outputs once; the norm weight, its gradient and per-row statistics are left out.
``fwd+bwd`` counts both passes, the backward reading the forward's input again. With ``e`` bytes
per element:

- rms_norm ``[T, H]``: fwd reads x, writes y: 2THe; bwd reads x and dy, writes dx: 3THe.
- rms_norm_residual: fwd reads x and r, writes y and s: 4THe; bwd reads s, dy and ds, writes dx
  (which is also dr): 4THe.
- silu_and_mul, gate and up ``[T, I]`` each -> ``[T, I]``: fwd 3TIe; bwd reads gate, up and dy,
  writes their two gradients: 5TIe.
- apply_rotary, q ``[T, Hq, D]`` and k ``[T, Hk, D]`` as a model rotates them, cos and sin
  ``[T, D]``: each pass reads and writes q and k (or their gradients) and reads cos and sin:
  2T(Hq + Hk)De + 2TDe.

The peers' helpers (:func:`~rlk.bench._peers.liger`, :func:`~rlk.bench._peers.compiled`,
:func:`~rlk.bench._peers.time_op`) are in :mod:`rlk.bench._peers`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import rlk
from rlk.bench import timing as _timing
from rlk.bench._peers import Case, compiled, liger, time_op

#: Shapes per op (``quick`` takes the first of each): real model sizes, each call >= 50 us on an
#: H200 (or timed as a CUDA graph of several). rms_norm (and rms_norm_residual): Llama-3-8B,
#: Llama-3.2-1B and Qwen2.5-0.5B hidden sizes, the last at two token counts, and a 70B-class
#: hidden size (8192) at 4096 tokens. silu_and_mul ``(T, I)``, gate and up being ``[T, I]``:
#: Llama-3-8B, Qwen2.5-0.5B. apply_rotary ``(T, Hq, Hk, D)``: Llama-3-8B, Qwen2.5-0.5B.
SHAPES: dict[str, list[tuple[int, ...]]] = {
    "rms_norm": [(16384, 4096), (65536, 2048), (65536, 896), (32768, 896), (4096, 8192)],
    "silu_and_mul": [(16384, 14336), (32768, 4864)],
    "apply_rotary": [(16384, 32, 8, 128), (65536, 14, 2, 64)],
}
DTYPE = torch.bfloat16
EPS = 1e-6

# --------------------------------------------------------------------------------------------
# The plain PyTorch code that ``compile`` compiles: rlk's semantics, unfused
# --------------------------------------------------------------------------------------------


def _rms_norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w.float()
    return y.to(x.dtype)


def _rms_norm_residual_ref(x, r, w):
    s = x + r  # rounded to x's dtype, as the residual stream is
    return _rms_norm_ref(s, w), s


def _silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos.float()[:, None] + rotated * sin.float()[:, None]).to(x.dtype)


def _rotary_ref(q, k, cos, sin):
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------


def _randn(*shape: int) -> torch.Tensor:
    return _timing.randn(*shape, dtype=DTYPE)


def _rms_norm(emit, T: int, H: int) -> None:
    x, w = _randn(T, H), _randn(H)
    cases: list[Case] = [
        ("rlk", lambda: rlk.rms_norm(x, w, EPS), (x, w)),
        ("compile", functools.partial(compiled(_rms_norm_ref), x, w), (x, w)),
    ]
    F = liger("LigerRMSNormFunction")
    if F is not None:
        # (X, W, eps, offset, casting_mode, in_place): "gemma" casting with offset 0 is rlk's
        # math (fp32 throughout, one rounding); in_place=False keeps Liger's backward from
        # writing dx over the caller's upstream gradient, which the timed loop reuses.
        cases.append(("liger", lambda: F.apply(x, w, EPS, 0.0, "gemma", False), (x, w)))
    e = x.element_size()
    fwd, fwd_bwd = {"nbytes": 2 * T * H * e}, {"nbytes": 5 * T * H * e}
    time_op(emit, "rms_norm", f"T={T} H={H}", DTYPE, cases, fwd, fwd_bwd)


def _rms_norm_residual(emit, T: int, H: int) -> None:
    x, r, w = _randn(T, H), _randn(T, H), _randn(H)
    cases: list[Case] = [
        ("rlk", lambda: rlk.rms_norm(x, w, EPS, residual=r), (x, r, w)),
        ("compile", functools.partial(compiled(_rms_norm_residual_ref), x, r, w), (x, r, w)),
    ]
    F = liger("LigerFusedAddRMSNormFunction")
    if F is not None:
        # (X, R, W, eps, offset, casting_mode, in_place) -> (y, s = x + r); as for rms_norm.
        cases.append(("liger", lambda: F.apply(x, r, w, EPS, 0.0, "gemma", False), (x, r, w)))
    e = x.element_size()
    fwd, fwd_bwd = {"nbytes": 4 * T * H * e}, {"nbytes": 8 * T * H * e}
    time_op(emit, "rms_norm_residual", f"T={T} H={H}", DTYPE, cases, fwd, fwd_bwd)


def _silu_and_mul(emit, T: int, I: int) -> None:
    # Gate and up as two tensors, as a model's gate_proj and up_proj make them; every impl
    # takes them so.
    gate, up = _randn(T, I), _randn(T, I)
    cases: list[Case] = [
        ("rlk", lambda: rlk.silu_and_mul(gate, up), (gate, up)),
        ("compile", functools.partial(compiled(_silu_and_mul_ref), gate, up), (gate, up)),
    ]
    F = liger("LigerSiLUMulFunction")
    if F is not None:
        cases.append(("liger", lambda: F.apply(gate, up), (gate, up)))
    e = gate.element_size()
    fwd, fwd_bwd = {"nbytes": 3 * T * I * e}, {"nbytes": 8 * T * I * e}
    time_op(emit, "silu_and_mul", f"T={T} I={I}", DTYPE, cases, fwd, fwd_bwd)


def _rope_cos_sin(T: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``cat(freqs, freqs)`` cos/sin of positions ``0..T-1`` (theta 1e6), in the model
    dtype, as a model's rotary embedding hands them to its attention layers."""
    inv_freq = 1e6 ** -(torch.arange(0, D, 2, device=_timing.DEVICE, dtype=torch.float32) / D)
    freqs = torch.arange(T, device=_timing.DEVICE, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def _hf_layout(t: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` seen as HF's ``[1, H, T, D]`` (a view: no copy)."""
    return t.unsqueeze(0).transpose(1, 2)


def _apply_rotary(emit, T: int, Hq: int, Hk: int, D: int) -> None:
    q, k = _randn(T, Hq, D), _randn(T, Hk, D)
    cos, sin = _rope_cos_sin(T, D)
    cases: list[Case] = [
        # rlk rotates q and k in one call, as a model does.
        ("rlk", lambda: rlk.apply_rotary(q, cos, sin, k=k), (q, k)),
        ("compile", functools.partial(compiled(_rotary_ref), q, k, cos, sin), (q, k)),
    ]
    F = liger("LigerRopeFunction")
    if F is not None:
        # Liger rotates q and k together, in HF's [B, H, T, D] views of [B, T, H, D] storage,
        # in place (and its backward rotates the upstream gradient in place). It gets its own
        # copies, so the inputs of the other impls stay as drawn; the timed calls keep rotating
        # those copies, which changes their values but not the work.
        ql, kl = q.clone(), k.clone()
        cases.append(("liger", lambda: F.apply(_hf_layout(ql), _hf_layout(kl), cos, sin), (ql, kl)))
    per_pass = 2 * T * (Hq + Hk) * D * q.element_size() + 2 * T * D * cos.element_size()
    fwd, fwd_bwd = {"nbytes": per_pass}, {"nbytes": 2 * per_pass}
    time_op(emit, "apply_rotary", f"T={T} Hq={Hq} Hk={Hk} D={D}", DTYPE, cases, fwd, fwd_bwd)


def run(quick: bool, emit: Callable[[dict], None]) -> None:
    """Emit the rows of every op and shape (only the first shape of each op when ``quick``)."""
    n = 1 if quick else None
    for T, H in SHAPES["rms_norm"][:n]:
        _rms_norm(emit, T, H)
        _rms_norm_residual(emit, T, H)
    for T, I in SHAPES["silu_and_mul"][:n]:
        _silu_and_mul(emit, T, I)
    for T, Hq, Hk, D in SHAPES["apply_rotary"][:n]:
        _apply_rotary(emit, T, Hq, Hk, D)
