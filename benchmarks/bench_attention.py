"""attention / paged_attention vs torch SDPA (flash backend) and, where installed, flash-attn.

    python benchmarks/run.py --only attention [--quick]
    python benchmarks/bench_attention.py [--quick]

Rows: causal prefill forward, forward+backward (TFLOP/s, causal FLOPs = half the dense ones;
backward counted as 2.5x the forward), and decode over a paged KV cache (GB/s of KV bytes read;
compare with the copy bandwidth the harness prints).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_table, format_rows, median_ms, require_cuda, row  # noqa: E402

DT = torch.bfloat16


def _flash_attn():
    try:
        import flash_attn

        return flash_attn
    except ImportError:
        return None


def _prefill_rows(b, h, hk, s, d, table, fa) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlk_triton import attention as attn

    shape = f"B={b} Hq={h} Hk={hk} S={s} D={d}"
    flops = 4 * b * h * s * s * d / 2
    scale = d**-0.5
    q = torch.randn(b * s, h, d, device="cuda", dtype=DT)
    k = torch.randn(b * s, hk, d, device="cuda", dtype=DT)
    v = torch.randn(b * s, hk, d, device="cuda", dtype=DT)
    do = torch.randn_like(q)
    cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    rows = []

    def rlk_fwd():
        return attn.attention(q, k, v, cu, cu, True, scale, table=table)

    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))

    def rlk_fwd_bwd():
        o = attn.attention(ql, kl, vl, cu, cu, True, scale, table=table)
        o.backward(do)

    rows.append(row("attention.fwd", shape, "bf16", "rlk", median_ms(rlk_fwd), flops=flops))
    rows.append(
        row("attention.fwd+bwd", shape, "bf16", "rlk", median_ms(rlk_fwd_bwd), flops=3.5 * flops)
    )

    # SDPA wants [B, H, S, D]; GQA through enable_gqa where the torch has it.
    qs = q.view(b, s, h, d).transpose(1, 2).contiguous()
    ks = k.view(b, s, hk, d).transpose(1, 2).contiguous()
    vs = v.view(b, s, hk, d).transpose(1, 2).contiguous()
    if hk != h:
        ks = ks.repeat_interleave(h // hk, dim=1)
        vs = vs.repeat_interleave(h // hk, dim=1)
    dos = torch.randn_like(qs)
    qg, kg, vg = (x.clone().requires_grad_() for x in (qs, ks, vs))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = median_ms(lambda: sdpa(qs, ks, vs, is_causal=True))
        rows.append(row("attention.fwd", shape, "bf16", "sdpa-flash", ms, flops=flops))

        def sdpa_fwd_bwd():
            sdpa(qg, kg, vg, is_causal=True).backward(dos)

        ms = median_ms(sdpa_fwd_bwd)
        rows.append(row("attention.fwd+bwd", shape, "bf16", "sdpa-flash", ms, flops=3.5 * flops))

    if fa is not None:
        fn = fa.flash_attn_varlen_func
        ms = median_ms(lambda: fn(q, k, v, cu, cu, s, s, causal=True))
        rows.append(row("attention.fwd", shape, "bf16", "flash-attn", ms, flops=flops))
        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        ms = median_ms(lambda: fn(qf, kf, vf, cu, cu, s, s, causal=True).backward(do))
        rows.append(row("attention.fwd+bwd", shape, "bf16", "flash-attn", ms, flops=3.5 * flops))
        ms = median_ms(
            lambda: fn(qf, kf, vf, cu, cu, s, s, causal=True, deterministic=True).backward(do)
        )
        rows.append(
            row("attention.fwd+bwd", shape, "bf16", "flash-attn-det", ms, flops=3.5 * flops)
        )
    return rows


def _decode_rows(b, h, hk, ctx, d, page, table, fa) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlk_triton import attention as attn

    shape = f"B={b} Hq={h} Hk={hk} ctx={ctx} D={d} page={page}"
    pages_per_seq = ctx // page
    n_pages = b * pages_per_seq
    kc = torch.randn(n_pages, page, hk, d, device="cuda", dtype=DT)
    vc = torch.randn_like(kc)
    bt = torch.randperm(n_pages, device="cuda").to(torch.int32).view(b, pages_per_seq)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    q = torch.randn(b, h, d, device="cuda", dtype=DT)
    kv_bytes = 2 * b * ctx * hk * d * q.element_size()
    flops = 4 * b * h * ctx * d
    rows = []
    ms = median_ms(lambda: attn.paged_attention(q, kc, vc, bt, lens, cu_q, d**-0.5, table=table))
    rows.append(
        row("paged_attention.decode", shape, "bf16", "rlk", ms, nbytes=kv_bytes, flops=flops)
    )

    # SDPA over a dense (already gathered) cache: what a non-paged engine reads.
    kd = (
        kc[bt.long()].view(b, ctx, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1).contiguous()
    )
    vd = (
        vc[bt.long()].view(b, ctx, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1).contiguous()
    )
    qd = q.view(b, h, 1, d)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ms = median_ms(lambda: sdpa(qd, kd, vd))
    rows.append(
        row(
            "paged_attention.decode",
            shape,
            "bf16",
            "sdpa-flash(dense,MHA)",
            ms,
            nbytes=kv_bytes * (h // hk),
            flops=flops,
        )
    )
    if fa is not None and page % 256 == 0:  # flash-attn's paged KV needs page_size % 256 == 0
        fn = fa.flash_attn_with_kvcache
        ms = median_ms(lambda: fn(q.view(b, 1, h, d), kc, vc, cache_seqlens=lens, block_table=bt))
        rows.append(
            row(
                "paged_attention.decode",
                shape,
                "bf16",
                "flash-attn",
                ms,
                nbytes=kv_bytes,
                flops=flops,
            )
        )
    return rows


def run(quick: bool = False) -> list[dict]:
    require_cuda()
    table = cuda_table()
    fa = _flash_attn()
    prefill = [(8, 32, 32, 4096, 128), (16, 14, 14, 2048, 64)]
    if not quick:
        prefill += [(4, 32, 8, 4096, 128), (2, 28, 4, 8192, 128)]
    decode = [(64, 32, 8, 4096, 128, 16)]
    if not quick:
        decode += [
            (64, 32, 8, 4096, 128, 64),
            (128, 32, 8, 8192, 128, 16),
            (64, 32, 32, 4096, 128, 16),
        ]
    rows = []
    for shp in prefill:
        rows += _prefill_rows(*shp, table, fa)
        torch.cuda.empty_cache()
    for shp in decode:
        rows += _decode_rows(*shp, table, fa)
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    print(format_rows(run(quick="--quick" in sys.argv)))
