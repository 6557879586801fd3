"""Attention: ``rlk.attention`` (packed varlen, causal) and ``rlk.paged_attention`` (decode).

Peers, on the same data:

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with PyTorch's default
  backend selection (cuDNN attention on an H200), on ``[B, H, S, D]`` with K/V repeated to the
  query heads (the layout every backend takes); ``sdpa-flash``: the same forced onto the
  FlashAttention-2 backend. ``flash-attn`` rows where the package imports.
- paged decode: ``sdpa`` over the same keys and values gathered into a dense cache (what an
  engine without pages reads, GQA through ``enable_gqa``); ``flashinfer`` is not installed on
  the machines measured so far.

TFLOP/s: causal forward ``2 B Hq S^2 D`` (half of the dense ``4 B Hq S^2 D``); forward +
backward 3.5x the forward. Decode GB/s counts the K/V bytes of the cache read once.
"""

from __future__ import annotations

import contextlib
import sys

import torch

import rlk
from rlk.bench import timing as _timing

# (B, S, Hq, Hk, D)
SHAPES = [
    (8, 4096, 32, 8, 128), (16, 2048, 14, 2, 64), (4, 8192, 16, 16, 128), (8, 2048, 28, 4, 128),
]  # fmt: skip
QUICK_SHAPES = SHAPES[:1]
# (B, ctx, Hq, Hk, D, page): the rollout batch sizes, and the corners of B = 1-256 with
# contexts of 512-32768 (one long sequence; a few short ones; mid-size batches).
DECODE = [
    (64, 4096, 32, 8, 128, 16),
    (64, 4096, 32, 8, 128, 128),
    (256, 2048, 14, 2, 64, 32),
    (1, 8192, 32, 8, 128, 16),
    (8, 512, 14, 2, 64, 16),
    (1, 32768, 32, 8, 128, 16),
    (8, 2048, 28, 4, 128, 16),
    (16, 8192, 32, 8, 128, 16),
]
QUICK_DECODE = DECODE[:1]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    yield "sdpa", contextlib.nullcontext()
    yield "sdpa-flash", sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _flash_attn():
    try:
        import flash_attn

        return flash_attn
    except ImportError:
        return None


def _train_rows(b, s, hq, hk, d, emit) -> None:
    dev, dt = _timing.DEVICE, torch.bfloat16
    shape = f"B={b} S={s} Hq={hq} Hk={hk} D={d}"
    flops = 2 * b * hq * s * s * d
    t = b * s
    q = torch.randn(t, hq, d, device=dev, dtype=dt)
    k = torch.randn(t, hk, d, device=dev, dtype=dt)
    v = torch.randn(t, hk, d, device=dev, dtype=dt)
    do = torch.randn_like(q)
    cu = torch.arange(0, t + 1, s, device=dev, dtype=torch.int32)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def rlk_fwd():
        return rlk.attention(q, k, v, cu, cu, causal=True)

    emit(_timing.timed("attention.fwd", shape, "bf16", "rlk", rlk_fwd, flops=flops))

    def rlk_step():
        return torch.autograd.grad(rlk.attention(qg, kg, vg, cu, cu, causal=True), (qg, kg, vg), do)

    emit(_timing.timed("attention.fwd+bwd", shape, "bf16", "rlk", rlk_step, flops=3.5 * flops))

    def bhsd(x):
        x = x.view(b, s, -1, d).transpose(1, 2)
        return x.repeat_interleave(hq // x.shape[1], dim=1).contiguous()

    qs, ks, vs, dos = bhsd(q), bhsd(k), bhsd(v), bhsd(do)
    qsg, ksg, vsg = (x.clone().requires_grad_() for x in (qs, ks, vs))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for impl, ctx in _sdpa_backends():
        with ctx:

            def sdpa_fwd():
                return sdpa(qs, ks, vs, is_causal=True)

            def sdpa_step():
                out = sdpa(qsg, ksg, vsg, is_causal=True)
                return torch.autograd.grad(out, (qsg, ksg, vsg), dos)

            emit(_timing.timed("attention.fwd", shape, "bf16", impl, sdpa_fwd, flops=flops))
            emit(
                _timing.timed(
                    "attention.fwd+bwd", shape, "bf16", impl, sdpa_step, flops=3.5 * flops
                )
            )
    fa = _flash_attn()
    if fa is not None:

        def fa_fwd():
            return fa.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True)

        emit(_timing.timed("attention.fwd", shape, "bf16", "flash-attn", fa_fwd, flops=flops))


def decode_inputs(b, ctx, hq, hk, d, page, device=None):
    """``(q, k_cache, v_cache, block_table, seq_lens, cu_q)`` of one bf16 decode step: ``b``
    sequences of ``ctx`` keys in pages of ``page`` slots, the pages in shuffled order (a paged
    cache after many requests came and went), one query token each."""
    dev, dt = device or _timing.DEVICE, torch.bfloat16
    per_seq = ctx // page
    kc = torch.randn(b * per_seq, page, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.randperm(b * per_seq, device=dev).to(torch.int32).view(b, per_seq)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    q = torch.randn(b, hq, d, device=dev, dtype=dt)
    return q, kc, vc, bt, lens, cu_q


def _decode_rows(b, ctx, hq, hk, d, page, emit) -> None:
    shape = f"B={b} ctx={ctx} Hq={hq} Hk={hk} D={d} page={page}"
    q, kc, vc, bt, lens, cu_q = decode_inputs(b, ctx, hq, hk, d, page)
    kv_bytes = 2 * b * ctx * hk * d * 2
    flops = 4 * b * hq * ctx * d

    def rlk_decode():
        return rlk.paged_attention(q, kc, vc, bt, lens, cu_q)

    op = "paged_attention.decode"
    emit(_timing.timed(op, shape, "bf16", "rlk", rlk_decode, nbytes=kv_bytes, flops=flops))
    # The same keys and values, gathered into a dense [B, Hk, ctx, D] cache.
    kd = kc[bt.long()].view(b, ctx, hk, d).transpose(1, 2).contiguous()
    vd = vc[bt.long()].view(b, ctx, hk, d).transpose(1, 2).contiguous()
    qd = q.view(b, hq, 1, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_decode():
        return sdpa(qd, kd, vd, enable_gqa=hq != hk)

    try:
        emit(_timing.timed(op, shape, "bf16", "sdpa", sdpa_decode, nbytes=kv_bytes, flops=flops))
    except RuntimeError as e:  # no backend takes this GQA layout: say so, time nothing
        print(f"sdpa decode skipped at {shape}: {e}", file=sys.stderr)


def run(quick: bool, emit) -> None:
    for b, s, hq, hk, d in QUICK_SHAPES if quick else SHAPES:
        _train_rows(b, s, hq, hk, d, emit)
    for b, ctx, hq, hk, d, page in QUICK_DECODE if quick else DECODE:
        _decode_rows(b, ctx, hq, hk, d, page, emit)
