"""``scripts/kernel_sweep.py``'s GEMM parts: ``decode`` (M = 1-256 candidates, a split-K
variant timed only), ``tma`` (descriptor and persistent kernels) and ``gemm`` (every candidate
at the bench's shapes), against cuBLAS."""

from __future__ import annotations

import functools
import json
import math

import torch
import torch.nn.functional as F

import rlk
from rlk.bench import timing as _timing
from rlk.selection import backend_impl
from rlk_triton import gemm, tuning
from rlk_triton._triton import jit, tl, triton
from sweeps.common import graph_ms, products_ms

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
