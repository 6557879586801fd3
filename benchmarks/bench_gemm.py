"""rlk.linear (batch-invariant GEMM) vs cuBLAS (torch F.linear) vs batch_invariant_ops.

Harness entry: ``run(quick)`` (called by benchmarks/run.py) times the tuned choice on the
Llama-3-8B / Qwen2.5-7B projection shapes. Standalone, for tuning::

    python benchmarks/bench_gemm.py                       # the harness table
    python benchmarks/bench_gemm.py --shape 512,4096,4096 --configs   # every candidate
    python benchmarks/bench_gemm.py --sweep --configs     # every candidate on every shape
    python benchmarks/bench_gemm.py --shape 1,4096,4096 --graph       # CUDA-graph timing
    python benchmarks/bench_gemm.py --shape 4096,4096,4096 --backward # dX and dW too

Shapes are ``M,K,N``: ``x [M, K] @ W[N, K].T``. TFLOP/s = 2*M*N*K / time; ``ratio`` is rlk's
throughput over cuBLAS's, measured in the same process on the same inputs. ``--configs``
forces each candidate of the ``linear.fwd`` rule (``cfg=i``) beside the one the chooser picks
(``chosen=i``), so the chooser in rlk_triton/gemm.py can be set from the fastest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import format_rows, median_ms, require_cuda  # noqa: E402

# (model, projection, K, N)
SHAPES = [
    ("llama3-8b", "o", 4096, 4096),
    ("llama3-8b", "qkv", 4096, 6144),
    ("llama3-8b", "up", 4096, 14336),
    ("llama3-8b", "down", 14336, 4096),
    ("llama3-8b", "lm_head", 4096, 128256),
    ("qwen2.5-7b", "o", 3584, 3584),
    ("qwen2.5-7b", "up", 3584, 18944),
    ("qwen2.5-7b", "down", 18944, 3584),
    ("qwen2.5-7b", "lm_head", 3584, 151936),
]
MS = [1, 16, 64, 256, 512, 4096, 16384]
QUICK_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[8]]
QUICK_MS = [1, 64, 512, 4096]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _impl():
    """The linear op exactly as rlk's selected backend serves CUDA tensors (minus validation)."""
    # The cuda backend's own loader (its tables), without requiring every other op to exist.
    from rlk_cuda.plugin import _load

    return _load()


def _peer():
    try:
        from batch_invariant_ops import matmul_persistent
    except ImportError:
        try:
            from batch_invariant_ops.batch_invariant_ops import matmul_persistent
        except ImportError:
            return None
    return matmul_persistent


def _timer(graph: bool):
    if not graph:
        return median_ms
    from triton.testing import do_bench_cudagraph

    return lambda fn: float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def bench_shape(
    M, K, N, dtype=torch.bfloat16, *, configs=False, graph=False, backward=False, label=""
):
    from rlk_triton import gemm, tuning

    impl = _impl()
    lin = impl.ops["linear"]
    table = lin.keywords["table"]
    timer = _timer(graph)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    flops = 2.0 * M * N * K
    shape = f"{label}M={M},K={K},N={N}"
    dt = str(dtype).replace("torch.", "")
    rows = []

    cublas_ms = timer(lambda: torch.nn.functional.linear(x, w))
    rows.append(_row(shape, dt, "cublas", cublas_ms, flops, cublas_ms))
    chosen = table["linear.fwd"].choose(M=M, N=N, K=K, dtype_bytes=x.element_size())
    ms = timer(lambda: lin(x, w, None))
    rows.append(_row(shape, dt, f"rlk chosen={chosen}", ms, flops, cublas_ms))
    if configs:
        for i, cfg in enumerate(table["linear.fwd"].configs):
            with tuning.force("linear", {"linear.fwd": cfg}):
                try:
                    ms = timer(lambda: lin(x, w, None))
                except Exception as e:  # e.g. out of shared memory: report, keep going
                    rows.append({"shape": shape, "impl": f"rlk cfg={i}", "error": str(e)[:60]})
                    continue
            rows.append(_row(shape, dt, f"rlk cfg={i}", ms, flops, cublas_ms, cfg=_short(cfg)))
    peer = _peer()
    if peer is not None and dtype != torch.float32:
        wt = w.t()
        ms = timer(lambda: peer(x, wt))
        rows.append(_row(shape, dt, "batch_invariant_ops", ms, flops, cublas_ms))
    if backward:
        dy = torch.randn(M, N, device="cuda", dtype=dtype)
        # dX = dY @ W and dW = dY.T @ X: cuBLAS vs the rlk kernels, each 2*M*N*K flops.
        ref = timer(lambda: torch.mm(dy, w))
        rows.append(_row(shape, dt, "cublas dX", ref, flops, ref))
        ms = timer(lambda: gemm._matmul(dy, w, None, dtype, table, "linear.bwd_dx"))
        rows.append(_row(shape, dt, "rlk dX", ms, flops, ref))
        ref = timer(lambda: torch.mm(dy.t(), x))
        rows.append(_row(shape, dt, "cublas dW", ref, flops, ref))
        ms = timer(lambda: gemm._matmul(dy.t(), x, None, dtype, table, "linear.bwd_dw"))
        rows.append(_row(shape, dt, "rlk dW", ms, flops, ref))
    return rows


def _short(cfg):
    return "{BLOCK_M}x{BLOCK_N} g{GROUP_M} w{num_warps} s{num_stages}".format(**cfg)


def _row(shape, dtype, impl, ms, flops, ref_ms, **extra):
    r = {"op": "linear", "shape": shape, "dtype": dtype, "impl": impl, "ms": ms}
    r["TFLOP/s"] = flops / ms / 1e9
    r["ratio"] = ref_ms / ms
    r.update(extra)
    return r


def run(quick: bool = False) -> list[dict]:
    require_cuda()
    rows = []
    for model, proj, K, N in QUICK_SHAPES if quick else SHAPES:
        for M in QUICK_MS if quick else MS:
            rows += bench_shape(M, K, N, label=f"{model}.{proj} ")
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", action="append", default=[], help="M,K,N (repeatable)")
    p.add_argument("--sweep", action="store_true", help="all harness shapes")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--configs", action="store_true", help="time every candidate config")
    p.add_argument("--graph", action="store_true", help="time with CUDA graphs (decode shapes)")
    p.add_argument("--backward", action="store_true", help="time dX and dW too")
    args = p.parse_args()
    require_cuda()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape]
    if args.sweep or not shapes:
        for _, _, K, N in QUICK_SHAPES if args.quick else SHAPES:
            shapes += [(M, K, N) for M in (QUICK_MS if args.quick else MS)]
    for M, K, N in shapes:
        rows = bench_shape(
            M,
            K,
            N,
            DTYPES[args.dtype],
            configs=args.configs,
            graph=args.graph,
            backward=args.backward,
        )
        print(format_rows(rows), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
