"""``scripts/kernel_sweep.py``'s attention parts: ``attention``, ``attnbwd``, ``paged``,
``offsets`` and ``kvsplit``, against SDPA's default backend."""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F

import rlk
from rlk_triton import tuning
from sweeps.common import _config_sweep, graph_ms, products_ms

ATTN_SHAPES = [
    (8, 4096, 32, 8, 128), (16, 2048, 14, 2, 64), (4, 8192, 16, 16, 128), (8, 2048, 28, 4, 128),
]  # fmt: skip
ATTN_FWD = [
    {"BLOCK_M": bm, "num_warps": w, "num_stages": st, **({"TMA": True} if tma else {})}
    for tma in (False, True)
    for bm, w in ((128, 8), (128, 4), (64, 4))
    for st in (2, 3, 4)
]
#: --attn-fwd-only: the attention part sweeps forward configs only (no backward, no 128-key
#: tiles).
ATTN_FWD_ONLY = False
ATTN_BWD = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
    for bm, bn, w in ((128, 128, 8), (128, 64, 4), (64, 64, 4), (64, 128, 4))
    for st in (1, 2, 3)
]


#: Paged decode launch configs tried beside the table's: deeper pipelines at 64-row tiles, and
#: register caps that fit 3 or 4 programs of 4 warps per SM (an offline sm_90 compile puts the
#: head_dim 64 decode kernel at 174 registers, two programs per SM; at 168 it does not spill,
#: at 128 it spills 24 bytes; the cap of 128 at 3 stages is the table's head_dim 64 decode
#: config), with deeper pipelines under the cap of 128.
PAGED_EXTRA = (
    *({"BLOCK_M": 64, "num_warps": 4, "num_stages": st} for st in (4, 5, 6, 8)),
    *({"BLOCK_M": 64, "num_warps": 4, "num_stages": st, "maxnreg": r}
      for st in (2, 3) for r in (128, 168)),
    *({"BLOCK_M": 64, "num_warps": 4, "num_stages": st, "maxnreg": 128} for st in (4, 5, 6)),
)  # fmt: skip


def paged_part(rows) -> None:
    """``rlk.paged_attention`` at the harness's decode shapes under every forward config of the
    table and PAGED_EXTRA (shuffled pages, CUDA-graph GPU time, bits against the chosen)."""
    from rlk.bench import attention as battn
    from rlk_triton import paged_attention

    for i, (b, ctx, hq, hk, d, page) in enumerate(battn.DECODE):
        if PAGED_SHAPES is not None and i not in PAGED_SHAPES:
            continue
        inputs = battn.decode_inputs(b, ctx, hq, hk, d, page, device="cuda")
        kv_bytes = 2 * b * ctx * hk * d * 2

        def fn(inputs=inputs):
            return rlk.paged_attention(*inputs)

        configs = list(paged_attention.TUNING["paged_attention.fwd"].configs)
        configs += [c for c in PAGED_EXTRA if c not in configs]
        _config_sweep(rows, "paged", f"B={b} ctx={ctx} Hq={hq} Hk={hk} D={d} page={page}", fn,
                      "paged_attention.fwd", configs, kv_bytes, float("nan"))  # fmt: skip


#: ``kvsplit``: the KV split constants timed (``attention_fwd.KV_SPLIT``; each a numerics).
KV_SPLITS = (4096, 2048, 1024, 512, 256)


def kv_split_part(rows) -> None:
    """What the KV split constant costs and buys: the causal training forward (and forward +
    backward) at ``ATTN_SHAPES`` and paged decode at the harness's shapes, under each of
    :data:`KV_SPLITS`, with the configs the tables choose (CUDA-graph GPU time). Each constant
    is a different numerics, so no bits are compared across them."""
    from rlk.bench import attention as battn
    from rlk_triton import attention_fwd

    cases = [(s, _attention_case(*s)) for s in ATTN_SHAPES]
    decodes = [(s, battn.decode_inputs(*s, device="cuda")) for s in battn.DECODE]
    old = attention_fwd.KV_SPLIT
    try:
        for split in KV_SPLITS:
            attention_fwd.KV_SPLIT = split
            for (b, s, hq, hk, d), (q, k, v, _, cu, _flops, step) in cases:

                def fwd(q=q, k=k, v=v, cu=cu):
                    return rlk.attention(q, k, v, cu, cu, causal=True)

                r = {"part": "kvsplit", "split": split,
                     "shape": f"B={b} S={s} Hq={hq} Hk={hk} D={d}",
                     "fwd_ms": round(graph_ms(fwd, 1), 4),
                     "fwdbwd_ms": round(graph_ms(step, 1), 4)}  # fmt: skip
                rows.append(r)
                print(json.dumps(r), flush=True)
            for (b, ctx, hq, hk, d, page), inputs in decodes:
                ms = graph_ms(lambda inputs=inputs: rlk.paged_attention(*inputs), 1)
                r = {
                    "part": "kvsplit",
                    "split": split,
                    "shape": f"B={b} ctx={ctx} Hq={hq} Hk={hk} D={d} page={page}",
                    "decode_ms": round(ms, 5),
                    "gbps": round(2 * b * ctx * hk * d * 2 / ms / 1e6),
                }
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        attention_fwd.KV_SPLIT = old


def print_kv_split(rows) -> None:
    ks = [r for r in rows if r["part"] == "kvsplit"]
    if not ks:
        return
    base = {r["shape"]: r for r in ks if r["split"] == KV_SPLITS[0]}
    head = f"vs {KV_SPLITS[0]}"
    print(f"\n{'KV_SPLIT':>8} {'shape':44} {'ms':>9} {head:>8} GB/s, or fwd+bwd ms and ratio")
    for r in ks:
        b = base[r["shape"]]
        if "fwd_ms" in r:
            print(f"{r['split']:>8} {r['shape']:44} {r['fwd_ms']:>9} "
                  f"{b['fwd_ms'] / r['fwd_ms']:>8.3f} {r['fwdbwd_ms']:>9} "
                  f"{b['fwdbwd_ms'] / r['fwdbwd_ms']:.3f}")  # fmt: skip
        else:
            print(
                f"{r['split']:>8} {r['shape']:44} {r['decode_ms']:>9} "
                f"{b['decode_ms'] / r['decode_ms']:>8.3f} {r['gbps']:>9}"
            )


def offsets_part(rows) -> None:
    """Attention with its row offsets in int32 (``OFF32``: the launch's choice for tensors
    below 2^31 elements) and in int64: ``rlk.paged_attention`` at the harness's decode shapes,
    the packed causal forward and forward + backward at ATTN_SHAPES, CUDA-graph GPU time of
    each, bits compared."""
    from rlk.bench import attention as battn
    from rlk_triton import attention_fwd

    span = attention_fwd._span
    cases = [
        (f"decode B={b} ctx={ctx} Hq={hq} Hk={hk} D={d} page={page}",
         functools.partial(rlk.paged_attention, *battn.decode_inputs(b, ctx, hq, hk, d, page,
                                                                     device="cuda")))
        for b, ctx, hq, hk, d, page in battn.DECODE
    ]  # fmt: skip
    for b, s, hq, hk, d in ATTN_SHAPES:
        q, k, v, _, cu, _, step = _attention_case(b, s, hq, hk, d)
        cases.append((f"fwd B={b} S={s} Hq={hq} Hk={hk} D={d}",
                      functools.partial(rlk.attention, q, k, v, cu, cu, causal=True)))  # fmt: skip
        cases.append((f"fwd+bwd B={b} S={s} Hq={hq} Hk={hk} D={d}", step))
    for name, fn in cases:
        r = {"part": "offsets", "shape": name}
        outs = {}
        for width, patch in (("int32", span), ("int64", lambda t: 2**31)):
            attention_fwd._span = patch
            try:
                outs[width] = fn()
                r[width + "_us"] = round(graph_ms(fn, 1) * 1e3, 2)
            finally:
                attention_fwd._span = span
        a, b_ = outs["int32"], outs["int64"]
        pairs = zip(a, b_, strict=True) if isinstance(a, tuple) else [(a, b_)]
        r["bits_equal"] = all(torch.equal(x, y) for x, y in pairs)
        rows.append(r)
        print(json.dumps(r), flush=True)


def print_offsets(rows) -> None:
    for r in (r for r in rows if r["part"] == "offsets"):
        bits = "ok" if r["bits_equal"] else "DIFF"
        print(f"{r['shape']:44} int32 {r['int32_us']:>9} us  int64 {r['int64_us']:>9} us  "
              f"{r['int64_us'] / r['int32_us']:.2f}x  {bits}")  # fmt: skip


def attention_part(rows) -> None:
    for shape in ATTN_SHAPES:
        _attention_shape(rows, *shape)


def _attention_case(b: int, s: int, hq: int, hk: int, d: int):
    """Random bf16 ``q, k, v, dO`` of B sequences of S tokens on the GPU, their offsets ``cu``,
    the causal forward's FLOPs (half the dense ones) and ``step``: one forward + backward."""
    t = b * s
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    do = torch.randn_like(q)
    cu = torch.arange(0, t + 1, s, device="cuda", dtype=torch.int32)
    flops = 2 * 2 * b * s * s * hq * d / 2
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def step():
        out = rlk.attention(*leaves, cu, cu, causal=True)
        return torch.autograd.grad(out, leaves, do)

    return q, k, v, do, cu, flops, step


def _attention_shape(rows, b: int, s: int, hq: int, hk: int, d: int) -> None:
    from rlk_triton import attention_fwd

    q, k, v, do, cu, flops, step = _attention_case(b, s, hq, hk, d)

    def fwd():
        return rlk.attention(q, k, v, cu, cu, causal=True)

    def tf(ms, mult=1.0):
        return round(mult * flops / ms / 1e9, 1)

    ref, ref_g = fwd(), step()
    fwd_ms = products_ms(lambda x, w: fwd(), None, [None])
    bwd_ms = products_ms(lambda x, w: step(), None, [None])

    def bhsd(x):
        x = x.view(b, s, -1, d).transpose(1, 2)
        return x.repeat_interleave(hq // x.shape[1], dim=1).contiguous()

    qs, ks, vs, dos = bhsd(q), bhsd(k), bhsd(v), bhsd(do)
    sg = [x.clone().requires_grad_() for x in (qs, ks, vs)]
    sdpa = F.scaled_dot_product_attention
    sdpa_ms = products_ms(lambda x, w: sdpa(qs, ks, vs, is_causal=True), None, [None])
    sdpa_bwd_ms = products_ms(
        lambda x, w: torch.autograd.grad(sdpa(*sg, is_causal=True), sg, dos), None, [None]
    )
    best_f, equal_f = (fwd_ms, None), True
    for cf in ATTN_FWD:
        with tuning.force("attention", {"attention.fwd": cf}):
            try:
                equal_f &= torch.equal(fwd(), ref)
                t_ = products_ms(lambda x, w: fwd(), None, [None])
            except Exception as e:
                print("skip attn fwd", cf, type(e).__name__, str(e)[:120])
                continue
        if t_ < best_f[0]:
            best_f = (t_, cf)
    best_b, equal_b = (bwd_ms, None), True
    for cf in [] if ATTN_FWD_ONLY else ATTN_BWD:
        with tuning.force("attention", {"attention.bwd": cf}):
            try:
                g = step()
                equal_b &= all(torch.equal(x, y) for x, y in zip(g, ref_g, strict=True))
                t_ = products_ms(lambda x, w: step(), None, [None])
            except Exception as e:
                print("skip attn bwd", cf, type(e).__name__, str(e)[:120])
                continue
        if t_ < best_b[0]:
            best_b = (t_, cf)
    # 128-key tiles: another softmax order (not bit-equal by design), timed for its worth.
    n128 = (float("inf"), None)
    saved = attention_fwd.BLOCK_N
    try:
        attention_fwd.BLOCK_N = 128
        for cf in [] if ATTN_FWD_ONLY else ATTN_FWD[:6]:
            with tuning.force("attention", {"attention.fwd": cf}):
                try:
                    fwd()
                    t_ = products_ms(lambda x, w: fwd(), None, [None])
                except Exception as e:
                    print("skip attn n128", cf, type(e).__name__, str(e)[:120])
                    continue
            if t_ < n128[0]:
                n128 = (t_, cf)
    finally:
        attention_fwd.BLOCK_N = saved
    r = {
        "part": "attention", "shape": f"B={b} S={s} Hq={hq} Hk={hk} D={d}",
        "fwd_TF": tf(fwd_ms), "fwd_best_TF": tf(best_f[0]), "fwd_best": best_f[1],
        "fwd_n128_TF": tf(n128[0]), "fwd_n128": n128[1], "sdpa_fwd_TF": tf(sdpa_ms),
        "fb_TF": tf(bwd_ms, 3.5), "fb_best_TF": tf(best_b[0], 3.5), "bwd_best": best_b[1],
        "sdpa_fb_TF": tf(sdpa_bwd_ms, 3.5), "fwd_bits_equal": bool(equal_f),
        "bwd_bits_equal": bool(equal_b),
    }  # fmt: skip
    rows.append(r)
    print(json.dumps(r), flush=True)


#: The backward part's variants: whether the dK/dV kernel issues the dO V^T product before the
#: exponent (attention_bwd._early_dp).
ATTN_BWD_VARIANTS = [False, True]


def attention_bwd_part(rows) -> None:
    """The causal backward at the attention part's shapes, for each ATTN_BWD_VARIANTS: GPU
    time per kernel of one forward + backward (torch.profiler), the whole step's time (CUDA
    graphs) and its bits against the first variant."""
    for shape in ATTN_SHAPES:
        _attention_bwd_shape(rows, *shape)


def _attention_bwd_shape(rows, b: int, s: int, hq: int, hk: int, d: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from rlk_triton import attention_bwd

    shape = f"B={b} S={s} Hq={hq} Hk={hk} D={d}"
    *_, flops, step = _attention_case(b, s, hq, hk, d)
    saved = attention_bwd._early_dp
    ref = None
    try:
        for early in ATTN_BWD_VARIANTS:
            attention_bwd._early_dp = lambda head_dim, early=early: early
            g = step()
            ref = g if ref is None else ref
            torch.cuda.synchronize()
            n = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    step()
                torch.cuda.synchronize()
            per: dict = {}
            kernels = ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel", "_delta_kernel")
            for e in prof.key_averages():
                if e.device_type.name != "CUDA":
                    continue
                name = next((kn for kn in kernels if kn in e.key), "other")
                per[name] = per.get(name, 0.0) + e.self_device_time_total / n
            us = products_ms(lambda x, w: step(), None, [None]) * 1e3
            equal = all(torch.equal(x, y) for x, y in zip(g, ref, strict=True))
            r = {"part": "attn_bwd", "shape": shape, "early_dp": early,
                 "us": round(us, 1), "fb_TF": round(3.5 * flops / us / 1e6, 1),
                 **{k_: round(v_, 1) for k_, v_ in sorted(per.items())},
                 "bits_equal": equal}  # fmt: skip
            rows.append(r)
            print(json.dumps(r), flush=True)
    finally:
        attention_bwd._early_dp = saved


#: The paged part's decode shapes, as indices into rlk.bench.attention.DECODE (--paged-shapes;
#: None: all).
PAGED_SHAPES = None
