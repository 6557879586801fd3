"""Launch configs of rlk's kernels on a CUDA GPU, against the peers, in GPU time.

    python3 scripts/kernel_sweep.py [--out DIR] [--parts decode,tma,rotary,attention]

Parts: ``decode`` and ``tma`` (GEMM, below), ``rotary`` (apply_rotary configs against Liger),
``attention`` (forward and backward configs of causal varlen attention against SDPA's default
backend, and the forward with 128-key tiles, a different numerics timed only to see its worth),
``logprobs`` (forward configs for each chunk-group constant ``GROUP``, with and without the
division skipped at temperature 1, against Liger's cross-entropy), ``silu`` and ``norm``
(``silu_and_mul`` and ``rms_norm`` forward configs against Liger; for ``norm`` also a copy of the
forward with a plain fp32 sum of squares, timed only, to see what the exact sum costs),
``normbwd`` (rms_norm's backward: each launch config, its pieces, other dweight row
partitions and a plain-sum copy, both timed only, against Liger and ``torch.compile``),
``fusedmem`` (linear_logprobs' peak memory and eager time under other chunk constants),
``sample`` (the launch configs of ``rlk.sample``: warps and the programs a threshold pass fills
the GPU with, at B = 1, 64 and 256; temperature alone and with top-k / top-p), ``sampleknobs``
(its module-level knobs: blocks per part of a threshold pass, the candidate step's warps),
``paged`` (``rlk.paged_attention``'s launch configs at the harness's decode shapes), ``attnbwd``
(the GPU time of each kernel of a causal forward + backward, with and without the dK/dV
kernel's early dO V^T product), ``gemm`` (every GEMM candidate at the bench's shapes below
0.9x cuBLAS, at projections no config was chosen on and at a k/v projection, M = 1-1024),
``offsets`` (attention, paged decode and packed forward and backward, with its row offsets in
int32 and in int64), ``kvsplit`` (the training forward and paged decode under each KV split
constant of :data:`KV_SPLITS`).
Every config's output is compared bitwise with the chosen config's where the numerics are the
same.

GEMM:

Three measurements, each side by side with cuBLAS (``F.linear``) in this process, bf16:

1. Per-call cost of one eager call at M=1 (host side included): ``rlk.linear``, the bare Triton
   launch of the same kernel, and ``F.linear``; each timed over a loop of many calls.
2. GPU time per product (CUDA graph of products over distinct weights, so W comes from HBM):
   cuBLAS, rlk's chosen config, and every decode candidate (BLOCK_M 64 or ``--bm``, BLOCK_N
   16-128 or ``--bn``, stages 3-8 or ``--stages``, one K tile per loop step or ``--unroll``,
   through pointers or descriptors). Every candidate's output is
   compared bitwise with the chosen config's: launch configs must never change a bit.
3. The same for a split-K variant with a fixed leaf width (K reduced per leaf by the same
   k-loop, leaves summed in ascending order by a second kernel): a different numerics, timed
   here only to see what more programs per SM would buy.

Tables are printed last; the rows also go to ``DIR/kernel_sweep.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os

import torch
import torch.nn.functional as F

import rlk
from rlk.bench import timing as _timing
from rlk.selection import backend_impl
from rlk_triton import gemm, tuning
from rlk_triton._triton import jit, tl, triton

SHAPES = [("o_proj", 4096, 4096), ("up", 4096, 14336), ("down", 14336, 4096), ("q05_up", 896, 4864)]
MS = [1, 16, 64, 256]
STREAM_BYTES = 256 << 20
#: The decode part's selection (main's --shapes, --ms, --stages, --no-leaf, --unroll, --bn, --bm).
DECODE: dict = {
    "shapes": None,
    "ms": MS,
    "stages": [3, 4, 6, 8],
    "leaf": True,
    "unroll": [1],
    "bn": [16, 32, 64, 128],
    "bm": [64],
}


def graph_ms(fn, n_inner: int) -> float:
    """GPU time of one ``fn()`` from a CUDA graph of ``fn`` (which runs n_inner products).

    Not ``rlk.bench.timing.time_call``: that one falls back to eager timing when capture
    fails, and a sweep must see such a config fail (it is skipped) rather than time its host."""
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            fn()
    return do_bench(g.replay, warmup=20, rep=80, return_mode="median") / (4 * n_inner)


def products_ms(op, x, ws) -> float:
    """GPU time of one ``op(x, w)``, from a graph of the products over every weight in ws."""
    return graph_ms(lambda: [op(x, w_) for w_ in ws], len(ws))


@jit
def _leaf_kernel(
    a_ptr, b_ptr, p_ptr, M, N, K, LEAF_K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    row0, col0 = gemm.tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    leaf = tl.program_id(1)
    k0 = leaf.to(tl.int64) * LEAF_K
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    mask_m = rm < M - row0
    mask_n = rn < N - col0
    acc = gemm.k_loop(
        a_ptr + row0 * stride_am + k0 * stride_ak, b_ptr + col0 * stride_bn + k0 * stride_bk,
        mask_m, mask_n, tl.minimum(LEAF_K, K - k0), stride_am, stride_ak, stride_bk, stride_bn,
        True, False, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    p = p_ptr + leaf.to(tl.int64) * M * N + (row0 + rm)[:, None] * N + (col0 + rn)[None, :]
    tl.store(p, acc, mask=mask_m[:, None] & mask_n[None, :])


@jit
def _leaf_sum_kernel(p_ptr, c_ptr, MN, LEAVES, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for i in range(1, LEAVES):
        acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def leaf_linear(x, w, leaf_k, cfg, scratch, out):
    M, K = x.shape
    N = w.shape[0]
    leaves = math.ceil(K / leaf_k)
    b = w.t()
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), leaves)
    _leaf_kernel[grid](
        x, b, scratch, M, N, K, leaf_k, x.stride(0), x.stride(1), b.stride(0), b.stride(1),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=64, GROUP_M=8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    _leaf_sum_kernel[(triton.cdiv(M * N, 1024),)](scratch, out, M * N, leaves, BLOCK=1024)
    return out


@jit
def _tma_kernel(
    a_desc, b_desc, c_desc, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, PERSISTENT: tl.constexpr,
):  # fmt: skip
    # The k-loop of gemm.k_loop (ascending BLOCK_K tiles, tl.dot into one fp32 tile from zero)
    # with tiles brought by the tensor-memory accelerator; out-of-range rows/K read as zero.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_in_group = GROUP_M * num_pid_n
    first = tl.program_id(0)
    step = NUM_SMS if PERSISTENT else num_tiles
    for tile in tl.range(first, num_tiles, step, flatten=PERSISTENT):
        group_id = tile // num_in_group
        first_m = group_id * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % num_in_group) % group_size
        pid_n = (tile % num_in_group) // group_size
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([row0, k0])
            b = b_desc.load([col0, k0])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([row0, col0], acc.to(c_desc.dtype))


def tma_linear(x, w, cfg, out, persistent):
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], 64
    a_desc = TensorDescriptor(x, [M, K], [K, 1], [bm, bk])
    b_desc = TensorDescriptor(w, [N, K], [K, 1], [bn, bk])
    c_desc = TensorDescriptor(out, [M, N], [N, 1], [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    grid = (min(tiles, gemm._NUM_SMS) if persistent else tiles,)
    _tma_kernel[grid](
        a_desc, b_desc, c_desc, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        NUM_SMS=gemm._NUM_SMS, PERSISTENT=persistent,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


TMA_SHAPES = [
    ("o_proj", 4096, 4096), ("up", 4096, 14336), ("down", 14336, 4096), ("q05_up", 896, 4864)
]  # fmt: skip
TMA_MS = [1, 64, 256, 1024, 4096]


def tma_part(rows) -> None:
    """TMA (tensor descriptors), one tile per program or persistent, against the pointer kernel:
    the same bits are required, and the time against cuBLAS."""
    dev, dt = "cuda", torch.bfloat16
    table = backend_impl(torch.device(dev)).ops["linear"].keywords["table"]
    big = [
        {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": wp, "num_stages": st}
        for bm, bn, wp in ((128, 256, 8), (128, 128, 8), (64, 128, 4), (64, 256, 8))
        for st in (3, 4)
    ]
    # Decode sizes: narrow N tiles (more programs) with deep pipelines.
    small = [
        {"BLOCK_M": 64, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": 4, "num_stages": st}
        for bn in (32, 64, 128)
        for st in (4, 6, 8)
    ]
    for name, K, N in TMA_SHAPES:
        for M in TMA_MS:
            cands = small if M <= 64 else big + small[3:6]
            n = max(1, min(8, math.ceil(STREAM_BYTES / (N * K * 2)))) if M <= 256 else 1
            ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(n)]
            x = torch.randn(M, K, device=dev, dtype=dt)
            cub = products_ms(F.linear, x, ws)
            ref = rlk.linear(x, ws[0])
            mine = products_ms(rlk.linear, x, ws)
            chosen = tuning.config(table, "linear.fwd", M=M, N=N, K=K, dtype_bytes=2)
            best = {False: (float("inf"), None), True: (float("inf"), None)}
            equal = True
            for pers in (False, True):
                for cf in cands:
                    out = torch.empty(M, N, device=dev, dtype=dt)
                    op = functools.partial(tma_linear, cfg=cf, out=out, persistent=pers)
                    try:
                        y = op(x, ws[0]).clone()
                        t = products_ms(op, x, ws)
                    except Exception as e:
                        print("skip tma", name, M, pers, cf, type(e).__name__, str(e)[:200])
                        continue
                    equal &= torch.equal(y, ref)
                    if t < best[pers][0]:
                        best[pers] = (t, cf)
            r = {
                "part": "tma", "shape": name, "M": M, "K": K, "N": N,
                "cublas_us": round(cub * 1e3, 2), "chosen_us": round(mine * 1e3, 2),
                "chosen_cfg": chosen,
                "tma_us": round(best[False][0] * 1e3, 2), "tma_cfg": best[False][1],
                "ptma_us": round(best[True][0] * 1e3, 2), "ptma_cfg": best[True][1],
                "bits_equal": bool(equal),
            }  # fmt: skip
            rows.append(r)
            print(json.dumps(r), flush=True)


ROTARY_SHAPES = [(16384, 32, 8, 128), (65536, 14, 2, 64)]


def rotary_part(rows) -> None:
    """apply_rotary launch configs (tokens and heads per program, warps) for q and k as a model
    rotates them; bits must not move, GB/s against Liger's fused q/k rotation."""

    for shape in ROTARY_SHAPES:
        _rotary_shape(rows, *shape)


def _rotary_shape(rows, T: int, Hq: int, Hk: int, D: int) -> None:
    from rlk.bench import norm
    from rlk.bench._peers import liger

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(T, Hq, D, device=dev, dtype=dt)
    k = torch.randn(T, Hk, D, device=dev, dtype=dt)
    cos, sin = norm._rope_cos_sin(T, D)
    nbytes = 2 * T * (Hq + Hk) * D * 2 + 2 * T * D * 2
    ref = rlk.apply_rotary(q, cos, sin, k=k)

    def both():
        return rlk.apply_rotary(q, cos, sin, k=k)

    base = products_ms(lambda x, w: both(), None, [None])
    best, equal = (float("inf"), None), True
    for tok in (1, 2, 4, 8, 16):
        for hd in (8, 16, 32):
            for wp in (2, 4, 8):
                cf = {"tokens": tok, "heads": hd, "num_warps": wp}
                with tuning.force("apply_rotary", {"apply_rotary.fwd": cf}):
                    got = both()
                    equal &= torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
                    t = products_ms(lambda x, w: both(), None, [None])
                if t < best[0]:
                    best = (t, cf)
    lig = float("nan")
    Fn = liger("LigerRopeFunction")
    if Fn is not None:
        ql, kl = q.clone(), k.clone()
        try:
            lig = products_ms(
                lambda x, w: Fn.apply(norm._hf_layout(ql), norm._hf_layout(kl), cos, sin),
                None,
                [None],
            )
        except Exception as e:  # a peer that cannot be captured in a graph
            print("liger rope:", type(e).__name__, str(e)[:200])
    r = {
        "part": "rotary", "shape": f"T={T} Hq={Hq} Hk={Hk} D={D}",
        "chosen_us": round(base * 1e3, 2), "best_us": round(best[0] * 1e3, 2),
        "best_cfg": best[1], "liger_us": round(lig * 1e3, 2),
        "best_GBps": round(nbytes / best[0] / 1e6), "bits_equal": bool(equal),
    }  # fmt: skip
    rows.append(r)
    print(json.dumps(r), flush=True)


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


# --------------------------------------------------------------------------------------------
# Memory-bound kernels: logprobs (the chunk-group constant and launch configs), silu_and_mul and
# rms_norm launch configs, each against Liger-Kernel, GPU time from CUDA graphs
# --------------------------------------------------------------------------------------------


def _liger_ms(name, make_call):
    from rlk.bench._peers import liger

    Fn = liger(name)
    if Fn is None:
        return float("nan")
    try:
        return products_ms(lambda x, w: make_call(Fn), None, [None])
    except Exception as e:  # a peer that cannot be captured in a graph
        print(name, type(e).__name__, str(e)[:200])
        return float("nan")


def _config_sweep(rows, part, shape, fn, key, configs, nbytes, peer_ms, ref=None):
    """Time ``fn`` under every config of kernel ``key``; bits compared with ``ref``."""
    op = key.split(".")[0]
    chosen = products_ms(lambda x, w: fn(), None, [None])
    ref = fn() if ref is None else ref
    for cf in configs:
        with tuning.force(op, {key: cf}):
            try:
                out = fn()
            except triton.runtime.errors.OutOfResources:
                print("skip", part, shape, cf, "out of resources", flush=True)
                continue
            equal = all(torch.equal(a, b) for a, b in zip(_tensors(out), _tensors(ref)))
            t = products_ms(lambda x, w: fn(), None, [None])
        r = {
            "part": part, "shape": shape, "key": key, "cfg": cf, "us": round(t * 1e3, 2),
            "chosen_us": round(chosen * 1e3, 2), "peer_us": round(peer_ms * 1e3, 2),
            "GBps": round(nbytes / t / 1e6), "bits_equal": bool(equal),
        }  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)


def _tensors(out):
    return out if isinstance(out, tuple) else (out,)


def logprobs_part(rows) -> None:
    for T, V in ((16384, 151936), (8192, 128256)):
        _logprobs_shape(rows, T, V)


def _logprobs_shape(rows, T: int, V: int) -> None:
    from rlk_triton import logprobs as lpmod

    logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, V, (T,), device="cuda")
    args = (logits.clone(), targets, None, -100, 0.0, 0.0, "none")
    peer = _liger_ms("LigerCrossEntropyFunction", lambda Fn: Fn.apply(*args)[0])
    configs = [
        {"ROWS": r, "num_warps": w} for r, w in ((1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16))
    ]
    chosen = [dict(tuning.config(lpmod.TUNING, "logprobs.fwd", T=T, V=V))]
    group0, unit0 = lpmod.GROUP, lpmod._unit
    try:
        for group in (1, 2, 4):
            lpmod.GROUP = group
            for unit in (True, False):
                lpmod._unit = unit0 if unit else (lambda temperature: False)
                _config_sweep(
                    rows, "logprobs", f"T={T} V={V} GROUP={group} unit={unit}",
                    lambda: rlk.logprobs(logits, targets), "logprobs.fwd",
                    configs if unit else chosen, T * V * 2, peer,
                )  # fmt: skip
    finally:
        lpmod.GROUP, lpmod._unit = group0, unit0


def silu_part(rows) -> None:
    for T, I in ((32768, 4864), (16384, 14336)):
        _silu_shape(rows, T, I)


def _silu_shape(rows, T: int, I: int) -> None:
    gate = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    peer = _liger_ms("LigerSiLUMulFunction", lambda Fn: Fn.apply(gate, up))
    configs = [{"block": 512, "num_warps": 2}] + [
        {"block": b, "num_warps": w} for b in (1024, 2048, 4096) for w in (4, 8)
    ]
    _config_sweep(
        rows, "silu", f"T={T} I={I}", lambda: rlk.silu_and_mul(gate, up), "silu_and_mul.fwd",
        configs, 3 * T * I * 2, peer,
    )  # fmt: skip


#: The (T, H) shapes of the norm and normbwd parts (--norm-shapes).
NORM_SHAPES = [(16384, 4096), (65536, 2048), (65536, 896), (32768, 896), (4096, 8192)]
#: The paged part's decode shapes, as indices into rlk.bench.attention.DECODE (--paged-shapes;
#: None: all).
PAGED_SHAPES = None


def norm_part(rows) -> None:
    for T, H in NORM_SHAPES:
        _norm_shape(rows, T, H)


@jit
def _plain_norm_kernel(X, W, Y, n_rows, H, eps, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    # rms_norm's forward with a plain fp32 tl.sum for the sum of squares: a numerics whose bits
    # follow the layout, timed only to see what the exact sum costs.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


def _plain_norm_us(x, w, cfg) -> float:
    from rlk_triton import norm as normmod

    T, H = x.shape
    block = normmod._block(H)
    rows = max(1, cfg["tile"] // block)
    y = torch.empty_like(x)

    def run():
        _plain_norm_kernel[(triton.cdiv(T, rows),)](
            x, w, y, T, H, 1e-6, BLOCK_H=block, ROWS=rows, num_warps=cfg["num_warps"]
        )

    return products_ms(lambda a, b: run(), None, [None]) * 1e3


def _norm_shape(rows, T: int, H: int) -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    peer = _liger_ms("LigerRMSNormFunction", lambda Fn: Fn.apply(x, w, 1e-6, 0.0, "gemma", False))
    configs = [{"tile": t, "num_warps": nw} for t in (2048, 4096, 8192) for nw in (4, 8, 16)]
    configs += [{"tile": t, "num_warps": nw} for t in (1024, 2048, 4096) for nw in (1, 2)]
    if H >= 8192:  # two rows per program
        configs += [{"tile": 16384, "num_warps": nw} for nw in (8, 16, 32)]
    _config_sweep(
        rows, "norm", f"T={T} H={H}", lambda: rlk.rms_norm(x, w, 1e-6), "rms_norm.fwd",
        configs, 2 * T * H * 2, peer,
    )  # fmt: skip
    from rlk_triton import norm as normmod

    chosen = tuning.config(normmod.TUNING, "rms_norm.fwd", rows=T, hidden=H)
    r = {"part": "norm_plain_sum", "shape": f"T={T} H={H}", "cfg": dict(chosen),
         "us": round(_plain_norm_us(x, w, chosen), 2), "peer_us": round(peer * 1e3, 2)}  # fmt: skip
    rows.append(r)
    print(json.dumps(r), flush=True)


def norm_bwd_part(rows) -> None:
    for T, H in NORM_SHAPES:
        _norm_bwd_shape(rows, T, H)


@jit
def _plain_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DWP, n_rows, H, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    DW_ROWS: tl.constexpr,
):  # fmt: skip
    # rms_norm's backward with plain fp32 tl.sum row and column sums: a numerics whose bits
    # follow the layout, timed only to see what the exact sums cost.
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    for i in range(DW_ROWS // ROWS):
        r = block * DW_ROWS + i * ROWS + tl.arange(0, ROWS)
        mask = (r < n_rows)[:, None] & col_ok[None, :]
        offs = r.to(tl.int64)[:, None] * H + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=r < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * x_hat, 1) / H
        tl.store(DX + offs, ((g - x_hat * c[:, None]) * rstd[:, None]).to(DX.dtype.element_ty),
                 mask=mask)  # fmt: skip
        acc += dy * x_hat
    tl.store(DWP + block.to(tl.int64) * H + cols, tl.sum(acc, 0), mask=col_ok)


def _norm_bwd_shape(rows, T: int, H: int) -> None:
    """rms_norm's backward at one shape, GPU time: the whole backward under each launch config
    (bits compared), its pieces (the dx kernel alone, the dweight partial sums), other row
    partitions of dweight (other numerics, timed only) and a plain-sum copy (timing only);
    Liger's and torch.compile's forward+backward beside it."""
    from rlk.bench import norm as bnorm
    from rlk.bench._peers import compiled, fwd_bwd_step
    from rlk_triton import norm as normmod

    table = backend_impl(torch.device("cuda")).ops["rms_norm"].keywords["table"]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, _, rstd = normmod._forward(x, w, 1e-6, None, table)
    shape = f"T={T} H={H}"

    def emit(variant, us, equal=None, **extra):
        r = {"part": "norm_bwd", "shape": shape, "variant": variant, "us": round(us, 2),
             "bits_equal": equal, **extra}  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)

    def us(fn):
        return products_ms(lambda a, b: fn(), None, [None]) * 1e3

    def bwd(need_dw=True):
        return normmod._backward(dy, None, x, w, rstd, need_dw, table)

    ref = bwd()
    emit("backward (chosen)", us(bwd), True,
         cfg=dict(tuning.config(table, "rms_norm.bwd", rows=T, hidden=H)))  # fmt: skip
    emit("dx kernel only", us(lambda: bwd(False)))
    block = normmod._block(H)
    part = torch.randn(-(-T // normmod._dw_rows(block)), H, device="cuda")
    emit(
        "dweight partial sums only",
        us(lambda: normmod._sum_partials(part, w.dtype, table)),
        cfg=dict(tuning.config(table, "rms_norm.dw", partials=part.shape[0], hidden=H)),
    )
    for cf in normmod.TUNING["rms_norm.dw"].configs:
        with tuning.force("rms_norm", {"rms_norm.dw": cf}):
            emit(f"partial sums {cf}", us(lambda: normmod._sum_partials(part, w.dtype, table)))
    for nw in (1, 2, 4, 8, 16):
        with tuning.force("rms_norm", {"rms_norm.bwd": {"num_warps": nw}}):
            got = bwd()
            equal = all(torch.equal(a, b) for a, b in zip(got, ref))
            emit(f"num_warps={nw}", us(bwd), equal)
    dw_rows0 = normmod._dw_rows
    try:
        for dw_rows in (16, 32, 64, 128):
            normmod._dw_rows = lambda b, n=dw_rows: n
            for nw in (1, 2, 4, 8, 16):
                with tuning.force("rms_norm", {"rms_norm.bwd": {"num_warps": nw}}):
                    emit(f"dweight rows={dw_rows} num_warps={nw}", us(bwd))
    finally:
        normmod._dw_rows = dw_rows0
    dx = torch.empty_like(x)
    for dw_rows, r, nw in ((16, max(1, 4096 // block), 4), (64, max(1, 4096 // block), 8)):
        plain_part = torch.empty(-(-T // dw_rows), H, device="cuda")

        def plain(dw_rows=dw_rows, r=r, nw=nw, plain_part=plain_part):
            _plain_norm_bwd_kernel[(-(-T // dw_rows),)](
                dy, x, w, rstd, dx, plain_part, T, H, BLOCK_H=block, ROWS=min(r, dw_rows),
                DW_ROWS=dw_rows, num_warps=nw,
            )  # fmt: skip

        emit(f"plain sums, dx + partials, DW_ROWS={dw_rows} num_warps={nw}", us(plain))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    emit("rlk fwd+bwd", us(fwd_bwd_step(lambda: rlk.rms_norm(xs, ws, 1e-6), [xs, ws])))
    cf = compiled(bnorm._rms_norm_ref)
    xc, wc = x.clone(), w.clone()
    emit("compile fwd+bwd", us(fwd_bwd_step(lambda: cf(xc, wc), [xc, wc])))
    emit("compile fwd", us(lambda: cf(x, w)))
    from rlk.bench._peers import liger

    Fn = liger("LigerRMSNormFunction")
    if Fn is not None:
        xl, wl = x.clone(), w.clone()
        step = fwd_bwd_step(lambda: Fn.apply(xl, wl, 1e-6, 0.0, "gemma", False), [xl, wl])
        emit("liger fwd+bwd", us(step))


def fused_memory_part(rows) -> None:
    for T, H, V in ((16384, 896, 151936), (16384, 4096, 128256), (32768, 4096, 128256)):
        _fused_memory_shape(rows, T, H, V)


def _fused_memory_shape(rows, T: int, H: int, V: int) -> None:
    """linear_logprobs at one shape under other chunk constants (none changes a bit): the peak
    memory of the forward and of the backward beyond what is allocated before each (GiB, the
    gradients included), and their times (CUDA events over eager calls: host included)."""
    from rlk.bench import timing as _timing
    from rlk_triton import fused_logprobs as fl

    hid = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    tgt = torch.randint(0, V, (T,), device="cuda")
    g = torch.randn(T, device="cuda")
    hr, wr = hid.clone().requires_grad_(), w.clone().requires_grad_()
    keys = ("BWD_TOKENS", "BWD_ELEMS", "DH_TOKENS", "DW_SLICE", "DW_TOKENS", "_FWD_SLICE_ELEMS")
    base = {k: getattr(fl, k) for k in keys}
    variants = [{}, {"BWD_TOKENS": 1024}, {"BWD_TOKENS": 4096}, {"DH_TOKENS": 16384},
                {"_FWD_SLICE_ELEMS": 1 << 25},
                {"DW_SLICE": 4096}, {"DW_TOKENS": 16384},
                {"BWD_TOKENS": 10**9, "BWD_ELEMS": 10**12}]  # fmt: skip

    def ms(fn, n=3):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def fwd():
        return rlk.linear_logprobs(hr, wr, tgt)

    def bwd():
        return torch.autograd.grad(fwd(), (hr, wr), g)

    for v in variants:
        for k, x in {**base, **v}.items():
            setattr(fl, k, x)
        fwd_gib = _timing.extra_memory_gib(fwd)
        step_gib = _timing.extra_memory_gib(bwd)
        r = {"part": "fused_memory", "shape": f"T={T} H={H} V={V}", "variant": v or "defaults",
             "fwd_GiB": round(fwd_gib, 3), "step_GiB": round(step_gib, 3),
             "fwd_ms": round(ms(fwd), 2), "step_ms": round(ms(bwd), 2)}  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)
    for k, x in base.items():
        setattr(fl, k, x)


def sample_part(rows) -> None:
    for B in (1, 64, 256, 1024):
        _sample_shape(rows, B, 151936)


#: Launch configs tried beside the table's (more or fewer programs per threshold pass).
SAMPLE_EXTRA = (
    {"num_warps": 2, "programs": 4096},
    {"num_warps": 1, "programs": 4096},
    {"num_warps": 2, "programs": 1024},
    {"num_warps": 4, "programs": 2048},
)


def _sample_shape(rows, B: int, V: int) -> None:
    logits = torch.randn(B, V, device="cuda") * 3
    seeds = torch.arange(B, device="cuda")
    offsets = torch.zeros(B, dtype=torch.int64, device="cuda")
    from rlk_triton import sampling

    configs = list(sampling.TUNING["sample.fwd"].configs)
    configs += [c for c in SAMPLE_EXTRA if c not in configs]
    for name, kw in (
        ("temperature", dict(temperature=0.8)),
        ("top_k_top_p", dict(temperature=0.8, top_k=50, top_p=0.9)),
    ):
        _config_sweep(
            rows, "sample", f"{name} B={B} V={V}",
            lambda kw=kw: rlk.sample(logits, seeds, offsets, **kw), "sample.fwd",
            configs, B * V * 4, float("nan"),
        )  # fmt: skip


#: sampling's module-level launch knobs (no bit depends on them): blocks per part of a threshold
#: pass, and the candidate step's warps; the first pair is the module's own.
SAMPLE_KNOBS = ((16, 4), (32, 4), (8, 4), (16, 8), (32, 8), (16, 2))


def sample_knobs_part(rows) -> None:
    """``rlk.sample`` under each (PART_BLOCKS, FEW_WARPS) of SAMPLE_KNOBS, the table's config."""
    from rlk_triton import sampling

    own = (sampling.PART_BLOCKS, sampling.FEW_WARPS)
    V = 151936
    for B in (1, 64, 256):
        logits = torch.randn(B, V, device="cuda") * 3
        seeds = torch.arange(B, device="cuda")
        offsets = torch.zeros(B, dtype=torch.int64, device="cuda")
        for name, kw in (
            ("top_k_top_p", dict(temperature=0.8, top_k=50, top_p=0.9)),
            ("top_p", dict(temperature=0.8, top_p=0.9)),
            ("top_k_1000", dict(temperature=0.8, top_k=1000)),
        ):
            ref = None
            for pb, fw in (own,) + tuple(k for k in SAMPLE_KNOBS if k != own):
                sampling.PART_BLOCKS, sampling.FEW_WARPS = pb, fw
                try:
                    out = rlk.sample(logits, seeds, offsets, **kw)
                    ref = out if ref is None else ref
                    args = (logits, seeds, offsets)
                    t = products_ms(lambda x, w, a=args, kw=kw: rlk.sample(*a, **kw), None, [None])
                finally:
                    sampling.PART_BLOCKS, sampling.FEW_WARPS = own
                r = {"part": "sample_knobs", "shape": f"{name} B={B} V={V}", "PART_BLOCKS": pb,
                     "FEW_WARPS": fw, "us": round(t * 1e3, 2),
                     "bits_equal": bool(torch.equal(out, ref))}  # fmt: skip
                rows.append(r)
                print(json.dumps(r), flush=True)


#: Launch configs outside ``gemm._CONFIGS``, timed beside them by the ``gemm`` part: persistent
#: and narrower descriptor tiles (wave quantization at mid M), deeper pointer pipelines.
_G = gemm.gemm_config
GEMM_EXTRA = [
    _G(64, 128, 4, 4, tma=True, persistent=True), _G(64, 128, 4, 6, tma=True, persistent=True),
    _G(128, 128, 8, 4, tma=True), _G(128, 128, 8, 4, tma=True, persistent=True),
    _G(128, 128, 4, 4, tma=True), _G(128, 64, 4, 4, tma=True), _G(128, 64, 4, 6, tma=True),
    _G(64, 256, 8, 4, tma=True), _G(64, 256, 8, 3, tma=True), _G(64, 32, 4, 8, tma=True),
    _G(64, 32, 4, 6, tma=True), _G(64, 64, 4, 6, tma=True, persistent=True),
    _G(128, 256, 8, 4, tma=True, persistent=True), _G(128, 256, 8, 4, tma=True),
    _G(256, 128, 8, 3, tma=True), _G(256, 128, 8, 3, tma=True, persistent=True),
    _G(64, 32, 4, 8, unroll=4), _G(64, 16, 4, 8), _G(64, 32, 4, 10),
]  # fmt: skip
#: (K, N, Ms) per projection: the bench's shapes below 0.9x cuBLAS, projections no config was
#: chosen on (Qwen2.5-7B qkv and o_proj, Qwen3-4B qkv and down, Qwen2-0.5B down), Llama-3-8B's
#: k/v projection at decode sizes (N = 1024: a few dozen tiles for 132 SMs), and the fused
#: projections the paged rollout runs (rlk_integrations.engine.fused: Llama-3-8B's q/k/v and
#: gate/up, Qwen2.5-7B's gate/up).
GEMM_SHAPES = {
    "qkv_fused": (4096, 6144, [16, 64, 256]),
    "gate_up": (4096, 28672, [16, 64, 256]),
    "q25_gate_up": (3584, 37888, [64]),
    "q05_up": (896, 4864, [1, 16, 64, 256, 1024]),
    "o_proj": (4096, 4096, [64, 256]),
    "lm_head": (4096, 151936, [256]),
    "q25_qkv": (3584, 4608, [64, 256, 1024]),
    "q25_o": (3584, 3584, [256]),
    "q3_4b_qkv": (2560, 6144, [256]),
    "q3_4b_down": (9728, 2560, [64, 256]),
    "q05_down": (4864, 896, [1024]),
    "up": (4096, 14336, [64]),
    "kv_proj": (4096, 1024, [16, 64]),
}


def gemm_part(rows) -> None:
    """Every bf16 candidate of ``gemm._CONFIGS`` and :data:`GEMM_EXTRA` at :data:`GEMM_SHAPES`
    (CUDA graphs, bits compared with the chosen config's). An eager call's host cost, layer by
    layer: ``scripts/host_overhead.py``."""

    dev, dt = "cuda", torch.bfloat16
    table = backend_impl(torch.device(dev)).ops["linear"].keywords["table"]
    cands = [c for i, c in enumerate(gemm._CONFIGS) if i not in (8, 9)] + GEMM_EXTRA  # bf16
    for name, (K, N, ms) in GEMM_SHAPES.items():
        if DECODE["shapes"] and name not in DECODE["shapes"]:
            continue
        n = max(1, min(16, math.ceil(STREAM_BYTES / (N * K * 2))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(n)]
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dt)
            n_w = n if M <= 256 else 1  # as rlk bench: distinct weights at decode sizes

            def us(op, ws=ws[:n_w], x=x):
                return graph_ms(lambda: [op(x, w_) for w_ in ws], len(ws)) * 1e3

            ref = rlk.linear(x, ws[0])
            r = {"part": "gemm", "shape": name, "M": M, "K": K, "N": N,
                 "cublas_us": round(us(F.linear), 2), "chosen_us": round(us(rlk.linear), 2),
                 "chosen_cfg": tuning.config(table, "linear.fwd", M=M, N=N, K=K)}  # fmt: skip
            timed, equal = [], True
            for cf in cands:
                if cf["BLOCK_M"] > max(64, 2 * M):
                    continue
                with tuning.force("linear", {"linear.fwd": cf}):
                    try:
                        equal &= torch.equal(rlk.linear(x, ws[0]), ref)
                        timed.append((round(us(rlk.linear), 2), cf))
                    except Exception as e:  # out of shared memory
                        print("skip", name, M, cf, type(e).__name__, flush=True)
            timed.sort(key=lambda t: t[0])
            rows.append({**r, "bits_equal": bool(equal), "top": timed[:4]})
            print(json.dumps(rows[-1]), flush=True)


def _gemm_cfg(cf) -> str:
    s = "{BLOCK_M}x{BLOCK_N}w{num_warps}s{num_stages}".format(**cf)
    s += ",tma" if cf.get("TMA") else ""
    s += ",persistent" if cf.get("PERSISTENT") else ""
    return s + (f",u{cf['UNROLL']}" if cf.get("UNROLL", 1) > 1 else "")


def print_gemm(rows) -> None:
    gm = [r for r in rows if r["part"] == "gemm"]
    if gm:
        print(f"\n{'shape':11} {'M':>5} {'cublas':>8} {'chosen':>8} {'r_ch':>5} {'best':>8} "
              f"{'r_best':>6} bits  chosen -> best / second")  # fmt: skip
    for r in gm:
        top = r["top"]
        second = f"{_gemm_cfg(top[1][1])} {top[1][0]}" if len(top) > 1 else ""
        print(
            f"{r['shape']:11} {r['M']:>5} {r['cublas_us']:>8} {r['chosen_us']:>8} "
            f"{r['cublas_us'] / r['chosen_us']:>5.2f} {top[0][0]:>8} "
            f"{r['cublas_us'] / top[0][0]:>6.2f} {'ok' if r['bits_equal'] else 'DIFF'}  "
            f"{_gemm_cfg(r['chosen_cfg'])} -> {_gemm_cfg(top[0][1])} / {second}"
        )


def print_memory_bound(rows) -> None:
    """Per part and shape: the chosen config, the fastest one, and the peer, in us."""
    groups: dict = {}
    for r in rows:
        if r["part"] in ("logprobs", "silu", "norm", "sample", "paged"):
            groups.setdefault((r["part"], r["shape"]), []).append(r)
    if groups:
        print(f"\n{'part':8} {'shape':36} {'chosen':>8} {'best':>8} {'peer':>8} bits  best cfg")
    for (part, shape), rs in groups.items():
        best = min(rs, key=lambda r: r["us"])
        ok = all(r["bits_equal"] for r in rs)
        print(
            f"{part:8} {shape:36} {rs[0]['chosen_us']:>8} {best['us']:>8} {best['peer_us']:>8} "
            f"{'ok' if ok else 'DIFF'}  {best['cfg']}"
        )
    for r in rows:
        if r["part"] == "fused_memory":
            print(
                f"linear_logprobs {r['shape']:24} {str(r['variant']):28} fwd {r['fwd_GiB']:6.3f}"
                f" GiB {r['fwd_ms']:8.2f} ms  fwd+bwd {r['step_GiB']:6.3f} GiB"
                f" {r['step_ms']:8.2f} ms"
            )
    for r in rows:
        if r["part"] == "norm_bwd":
            eq = {None: "", True: "bits ok", False: "DIFF"}[r["bits_equal"]]
            print(f"norm bwd {r['shape']:16} {r['variant']:52} {r['us']:>8} us {eq}")
    for r in rows:
        if r["part"] == "sample_knobs":
            ok = "ok" if r["bits_equal"] else "DIFF"
            print(f"sample {r['shape']:30} PART_BLOCKS {r['PART_BLOCKS']:>2} FEW_WARPS "
                  f"{r['FEW_WARPS']} {r['us']:>8} us {ok}")  # fmt: skip
    for r in rows:
        if r["part"] == "norm_plain_sum":
            print(f"norm, plain fp32 sum (timing only) {r['shape']:22} {r['us']:>8} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="decode,tma,rotary,attention")
    ap.add_argument("--shapes", default=None, help="decode, gemm: the shapes (o_proj,up,...)")
    ap.add_argument("--ms", default=None, help="decode: comma-separated M (default 1,16,64,256)")
    ap.add_argument("--stages", default=None, help="decode: pipeline depths (default 3,4,6,8)")
    ap.add_argument("--no-leaf", action="store_true", help="decode: skip the split-K variant")
    ap.add_argument("--unroll", default="1", help="decode: K tiles per loop iteration (1,2,4)")
    ap.add_argument("--bn", default="16,32,64,128", help="decode: BLOCK_N candidates")
    ap.add_argument("--bm", default="64", help="decode: BLOCK_M candidates (4 warps each)")
    ap.add_argument("--attn-fwd-only", action="store_true", help="attention: forward configs")
    ap.add_argument("--norm-shapes", default=None, help="norm, normbwd: TxH,TxH,...")
    ap.add_argument("--paged-shapes", default=None, help="paged: indices into DECODE (0,1,..)")
    ap.add_argument(
        "--gemm-ms", default=None, help="gemm: time rlk bench's shapes at these M instead (256,...)"
    )
    args = ap.parse_args()
    parts = args.parts.split(",")
    global ATTN_FWD_ONLY, NORM_SHAPES, PAGED_SHAPES
    ATTN_FWD_ONLY = args.attn_fwd_only
    if args.norm_shapes:
        NORM_SHAPES = [tuple(int(n) for n in sh.split("x")) for sh in args.norm_shapes.split(",")]
    if args.paged_shapes:
        PAGED_SHAPES = {int(i) for i in args.paged_shapes.split(",")}
    DECODE.update(
        shapes=args.shapes.split(",") if args.shapes else None,
        ms=[int(m) for m in args.ms.split(",")] if args.ms else MS,
        stages=[int(t) for t in args.stages.split(",")] if args.stages else [3, 4, 6, 8],
        leaf=not args.no_leaf,
        unroll=[int(u) for u in args.unroll.split(",")],
        bn=[int(b) for b in args.bn.split(",")],
        bm=[int(b) for b in args.bm.split(",")],
    )
    if args.gemm_ms:
        from rlk.bench import gemm as bench_gemm

        ms = [int(m) for m in args.gemm_ms.split(",")]
        GEMM_SHAPES.clear()
        GEMM_SHAPES.update({name: (K, N, ms) for name, K, N in bench_gemm.SHAPES})
    rows: list[dict] = []
    runs = {
        "decode": decode_part, "tma": tma_part, "rotary": rotary_part,
        "attention": attention_part, "attnbwd": attention_bwd_part, "logprobs": logprobs_part,
        "silu": silu_part,
        "norm": norm_part, "normbwd": norm_bwd_part, "sample": sample_part,
        "fusedmem": fused_memory_part, "sampleknobs": sample_knobs_part, "paged": paged_part,
        "gemm": gemm_part, "offsets": offsets_part, "kvsplit": kv_split_part,
    }  # fmt: skip
    unknown = sorted(set(parts) - set(runs))
    if unknown:
        ap.error(f"unknown parts {unknown}; parts: {', '.join(runs)}")
    try:
        for name, part in runs.items():
            if name in parts:
                part(rows)
    finally:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernel_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print_tables(rows)
    print_memory_bound(rows)
    print_gemm(rows)
    print_offsets(rows)
    print_kv_split(rows)


def decode_part(rows) -> None:
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)

    # 1. eager per-call cost at M=1, o_proj
    x = torch.randn(1, 4096, device=dev, dtype=dt)
    w = torch.randn(4096, 4096, device=dev, dtype=dt) / 64
    table = backend_impl(x.device).ops["linear"].keywords["table"]
    cfg = tuning.config(table, "linear.fwd", M=1, N=4096, K=4096, dtype_bytes=2)
    c = torch.empty(1, 4096, device=dev, dtype=dt)
    eager = {
        "rlk.linear": _timing.eager_call_us(lambda: rlk.linear(x, w)),
        "triton launch": _timing.eager_call_us(lambda: gemm._launch(x, w.t(), None, c, cfg)),
        "F.linear": _timing.eager_call_us(lambda: F.linear(x, w)),
    }
    eager["gpu (rlk, graph)"] = graph_ms(lambda: rlk.linear(x, w), 1) * 1e3
    eager["gpu (cublas, graph)"] = graph_ms(lambda: F.linear(x, w), 1) * 1e3
    rows.append({"part": "eager_us", **{k: round(v, 2) for k, v in eager.items()}})
    print(json.dumps(rows[-1]), flush=True)

    # 2. and 3. GPU time per product
    # Pointer-kernel candidates, and descriptor ones (TMA: the tile of W is one bulk copy).
    cands = [
        gemm.gemm_config(bm, bn, 4, st, tma=tma, unroll=u)
        for bm in DECODE["bm"]
        for tma in (False, True)
        for bn in DECODE["bn"]
        for st in DECODE["stages"]
        for u in DECODE["unroll"]
        if not (tma and bn < 32)  # a descriptor's box is at least 16 bytes wide per row
    ]
    leaf_cands = [
        (lk, c)
        for lk in (512, 1024)
        for c in cands
        if c["num_stages"] in (4, 6) and not c["TMA"] and c["UNROLL"] == 1 and DECODE["leaf"]
    ]
    for name, K, N in SHAPES:
        if DECODE["shapes"] is not None and name not in DECODE["shapes"]:
            continue
        n = max(1, min(16, math.ceil(STREAM_BYTES / (N * K * 2))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(n)]
        for M in DECODE["ms"]:
            x = torch.randn(M, K, device=dev, dtype=dt)
            wbytes = N * K * 2
            cub = products_ms(F.linear, x, ws)
            chosen = tuning.config(table, "linear.fwd", M=M, N=N, K=K, dtype_bytes=2)
            ref = rlk.linear(x, ws[0])
            mine = products_ms(rlk.linear, x, ws)
            best = (mine, "chosen", chosen)
            ok = True
            for cf in cands:
                with tuning.force("linear", {"linear.fwd": cf}):
                    try:
                        y = rlk.linear(x, ws[0])
                        t = products_ms(rlk.linear, x, ws)
                    except Exception as e:  # out of shared memory for deep pipelines
                        print("skip", name, M, cf, type(e).__name__)
                        continue
                ok &= torch.equal(y, ref)
                if t < best[0]:
                    best = (t, "cand", cf)
            lbest = (float("inf"), None)
            for lk, cf in leaf_cands:
                leaves = math.ceil(K / lk)
                scratch = torch.empty(leaves * M * N, device=dev, dtype=torch.float32)
                out = torch.empty(M, N, device=dev, dtype=dt)
                try:
                    op = functools.partial(leaf_linear, leaf_k=lk, cfg=cf, scratch=scratch, out=out)
                    t = products_ms(op, x, ws)
                except Exception as e:
                    print("skip leaf", name, M, lk, cf, type(e).__name__)
                    continue
                if t < lbest[0]:
                    lbest = (t, (lk, cf))
            r = {
                "part": "graph", "shape": name, "M": M, "K": K, "N": N,
                "cublas_us": round(cub * 1e3, 2), "chosen_us": round(mine * 1e3, 2),
                "best_us": round(best[0] * 1e3, 2), "best_cfg": best[2],
                "leaf_us": round(lbest[0] * 1e3, 2), "leaf_cfg": lbest[1],
                "bits_equal": bool(ok), "W_GBps_cublas": round(wbytes / cub / 1e6),
            }  # fmt: skip
            rows.append(r)
            print(json.dumps(r), flush=True)


def print_tables(rows) -> None:
    for r in rows:
        if r["part"] == "eager_us":
            print("\neager per call (us):", r)
    dec = [r for r in rows if r["part"] == "graph"]
    if dec:
        print(
            f"{'shape':8} {'M':>5} {'cublas':>7} {'chosen':>7} {'best':>7} {'leaf':>7} "
            f"{'r_chosen':>8} {'r_best':>6} {'r_leaf':>6} bits  best (BMxBN,stages,unroll) / leaf"
        )
    for r in dec:
        bc, lc = r["best_cfg"], r["leaf_cfg"]
        lcs = f"{lc[0]}:{lc[1]['BLOCK_N']},{lc[1]['num_stages']}" if lc else "-"
        bcs = f"{bc['BLOCK_M']}x{bc['BLOCK_N']},{bc['num_stages']},u{bc.get('UNROLL', 1)}"
        bcs += ",tma" if bc.get("TMA") else ""
        print(
            f"{r['shape']:8} {r['M']:>5} {r['cublas_us']:>7} {r['chosen_us']:>7} "
            f"{r['best_us']:>7} {r['leaf_us']:>7} {r['cublas_us'] / r['chosen_us']:>8.2f} "
            f"{r['cublas_us'] / r['best_us']:>6.2f} {r['cublas_us'] / r['leaf_us']:>6.2f} "
            f"{'ok' if r['bits_equal'] else 'DIFF'}  {bcs} / {lcs}"
        )
    tma = [r for r in rows if r["part"] == "tma"]
    if tma:
        print(f"\n{'shape':8} {'M':>5} {'cublas':>8} {'chosen':>8} {'tma':>8} {'p-tma':>8} "
              f"{'r_ch':>5} {'r_tma':>5} {'r_ptma':>6} bits  tma cfg / p-tma cfg")  # fmt: skip
    for r in tma:

        def c(cf):
            return (
                "-" if cf is None else "{BLOCK_M}x{BLOCK_N}w{num_warps}s{num_stages}".format(**cf)
            )

        print(
            f"{r['shape']:8} {r['M']:>5} {r['cublas_us']:>8} {r['chosen_us']:>8} "
            f"{r['tma_us']:>8} {r['ptma_us']:>8} {r['cublas_us'] / r['chosen_us']:>5.2f} "
            f"{r['cublas_us'] / r['tma_us']:>5.2f} {r['cublas_us'] / r['ptma_us']:>6.2f} "
            f"{'ok' if r['bits_equal'] else 'DIFF'}  {c(r['tma_cfg'])} / {c(r['ptma_cfg'])}"
        )
    for r in rows:
        if r["part"] in ("rotary", "attention"):
            print(r["part"], {k: v for k, v in r.items() if k != "part"})


if __name__ == "__main__":
    main()
