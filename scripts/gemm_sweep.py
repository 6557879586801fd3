"""Decode-size GEMM on a CUDA GPU: where the time goes, and which launch configs stream W fastest.

    python3 scripts/gemm_sweep.py [--out DIR]

Three measurements, each side by side with cuBLAS (``F.linear``) in this process, bf16:

1. Per-call cost of one eager call at M=1 (host side included): ``rlk.linear``, the bare Triton
   launch of the same kernel, and ``F.linear``; each timed over a loop of many calls.
2. GPU time per product (CUDA graph of products over distinct weights, so W comes from HBM):
   cuBLAS, rlk's chosen config, and every decode candidate (BLOCK_M 64, BLOCK_N 16-128,
   stages 3-8). Every candidate's output is compared bitwise with the chosen config's: launch
   configs must never change a bit.
3. The same for a split-K variant with a fixed leaf width (K reduced per leaf by the same
   k-loop, leaves summed in ascending order by a second kernel): a different numerics, timed
   here only to see what more programs per SM would buy.

A table is printed last; the rows also go to ``DIR/gemm_sweep.json``.
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
from rlk.bench import _timing
from rlk_triton import gemm, tuning
from rlk_triton._triton import jit, tl, triton

SHAPES = [("o_proj", 4096, 4096), ("up", 4096, 14336), ("down", 14336, 4096), ("q05_up", 896, 4864)]
MS = [1, 16, 64, 256]
STREAM_BYTES = 256 << 20


def graph_ms(fn, n_inner: int) -> float:
    """GPU time of one ``fn()`` from a CUDA graph of ``fn`` (which runs n_inner products)."""
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = []

    # 1. eager per-call cost at M=1, o_proj
    x = torch.randn(1, 4096, device=dev, dtype=dt)
    w = torch.randn(4096, 4096, device=dev, dtype=dt) / 64
    table = rlk._plugins.backend_impl(x.device).ops["linear"].keywords["table"]
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

    # 2. and 3. GPU time per product
    cands = [
        {"BLOCK_M": 64, "BLOCK_N": bn, "GROUP_M": 8, "num_warps": 4, "num_stages": st}
        for bn in (16, 32, 64, 128)
        for st in (3, 4, 6, 8)
    ]
    leaf_cands = [(lk, c) for lk in (512, 1024) for c in cands if c["num_stages"] in (4, 6)]
    for name, K, N in SHAPES:
        n = max(1, min(16, math.ceil(STREAM_BYTES / (N * K * 2))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(n)]
        for M in MS:
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
    with open(os.path.join(args.out, "gemm_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\neager per call (us):", rows[0])
    print(
        f"{'shape':8} {'M':>4} {'cublas':>7} {'chosen':>7} {'best':>7} {'leaf':>7} "
        f"{'r_chosen':>8} {'r_best':>6} {'r_leaf':>6} bits  best cfg (BN,stages) / leaf"
    )
    for r in rows[1:]:
        bc, lc = r["best_cfg"], r["leaf_cfg"]
        lcs = f"{lc[0]}:{lc[1]['BLOCK_N']},{lc[1]['num_stages']}" if lc else "-"
        print(
            f"{r['shape']:8} {r['M']:>4} {r['cublas_us']:>7} {r['chosen_us']:>7} "
            f"{r['best_us']:>7} {r['leaf_us']:>7} {r['cublas_us'] / r['chosen_us']:>8.2f} "
            f"{r['cublas_us'] / r['best_us']:>6.2f} {r['cublas_us'] / r['leaf_us']:>6.2f} "
            f"{'ok' if r['bits_equal'] else 'DIFF'}  {bc['BLOCK_N']},{bc['num_stages']} / {lcs}"
        )


if __name__ == "__main__":
    main()
